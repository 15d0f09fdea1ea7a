"""The tensor-core inner-product models: a block-FMA step's parameters per chip and input format.

A model is a :class:`BlockFMA` per input format family (``"fp8"`` for E4M3 / E5M2 and their mix, ``"bf16"``,
``"fp16"``, ``"tf32"``) plus what the library around the instruction does with K on that chip (the slow-
accumulation restart, the split-K layouts). The step itself is defined in :mod:`fp4sim.tensorcore` (module
docstring) and computed by ``fp4sim/cpu/tensorcore.py``.

Sources (facts, not code): Khattak and Mikaitis, "Accurate Models of NVIDIA Tensor Cores", ACM TACO 23(3), 2026
(arXiv 2512.07004), whose MATLAB toolbox holds each model's parameters and the hardware test vectors that
``tests/data/tensorcore_vectors`` keeps; mmaemu 0.1.0 for the GEMM-level behaviour of cuBLAS's FP8 GEMMs on an
H100 PCIe and an RTX 4060 (the 128-element restart of slow accumulation, the split-K layouts, the +0 rule for a
zero step result, the epilogue, the non-finite rules) and for its hardware-validated FP8 parameters where they
differ from the toolbox's (Hopper's ``min_exp``; the late addend of the B200 mma.sync fit).
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BlockFMA", "TensorCoreModel", "MODELS", "get_model", "family_of"]


@dataclass(frozen=True)
class BlockFMA:
    """One block-FMA step: ``nfma`` products per step; each term truncated toward zero to ``frac`` fraction bits
    below the step's alignment exponent (the largest product exponent, and the addend's unless ``late``, clamped
    below at ``min_exp``); the exact sum truncated to ``frac_out`` fraction bits below its own exponent (at least
    -126); ``late``: the addend is not aligned with the products but added after them with a float32 nearest-even
    addition; ``c_emin``: the addend's exponent is clamped below at this value (MMA-Sim reads a subnormal addend
    at exponent -126; None: its own exponent, as mmaemu)."""
    nfma: int
    frac: int
    frac_out: int
    min_exp: int
    late: bool = False
    c_emin: int | None = None

    def __post_init__(self):
        if not (isinstance(self.nfma, int) and 1 <= self.nfma <= 64):
            raise ValueError(f"nfma={self.nfma!r}: use a positive integer up to 64")
        if not (isinstance(self.frac, int) and 1 <= self.frac <= 25):
            raise ValueError(f"frac={self.frac!r}: use an integer in 1 ... 25 (the exact float64 sums need it)")
        if not (isinstance(self.frac_out, int) and 1 <= self.frac_out <= 23):
            raise ValueError(f"frac_out={self.frac_out!r}: use an integer in 1 ... 23 (a float32 accumulator)")
        if not (isinstance(self.min_exp, int) and -200 <= self.min_exp <= 0):
            raise ValueError(f"min_exp={self.min_exp!r}: use an integer in -200 ... 0")


@dataclass(frozen=True)
class TensorCoreModel:
    """A chip's inner-product models (``steps``: format family -> BlockFMA) and its library's K walk:
    ``slow_chunk`` (the K elements after which slow accumulation restarts the chain and adds the chunk results
    in float32; None: not characterised), ``split_schemes`` (the split-K layouts measured: ``"contiguous"`` runs
    of ``split_tile``-wide k-tiles per split, or ``"serial"`` / ``"pairwise"``: tile t to split t mod S, the
    partials combined in that order)."""
    name: str
    chip: str
    steps: dict
    slow_chunk: int | None
    split_tile: int | None
    split_schemes: tuple
    evidence: str
    instruction: str = ""
    aliases: tuple = field(default=())

    def step(self, family: str) -> BlockFMA:
        try:
            return self.steps[family]
        except KeyError:
            have = ", ".join(sorted(self.steps))
            raise ValueError(f"model={self.name!r} ({self.chip}) has no {family.upper()} inner-product model: it "
                             f"models {have} inputs") from None


_FP8 = "fp8"
MODELS = {
    "hopper": TensorCoreModel(
        "hopper", "H100 / H200 (sm_90)",
        {_FP8: BlockFMA(32, 13, 13, -132),
         "bf16": BlockFMA(16, 25, 23, -133), "fp16": BlockFMA(16, 25, 23, -133), "tf32": BlockFMA(8, 25, 23, -133)},
        slow_chunk=128, split_tile=128, split_schemes=("contiguous",),
        instruction="FP8: the wgmma unit behind cuBLAS's FP8 GEMMs (not sm_90's FP8 mma.sync); BF16 / FP16 / "
                    "TF32: the mma.sync (wmma) unit of the toolbox's measurements",
        evidence="FP8: mmaemu's H100 PCIe recordings (cuBLASLt 12.8.3.14, 374 unsplit and 1,049 split live calls) "
                 "and the toolbox's H100 and H200 vectors; an H200's own torch._scaled_mm outputs (72 GEMMs, "
                 "CUDA 13.0); BF16 / FP16 / TF32: the toolbox's H100 and H200 vectors and 8 H200 matmuls"),
    "ada": TensorCoreModel(
        "ada", "RTX 40xx / L40S (sm_89)",
        {_FP8: BlockFMA(16, 13, 13, -132),
         "bf16": BlockFMA(8, 24, 23, -132), "fp16": BlockFMA(8, 24, 23, -132), "tf32": BlockFMA(4, 24, 23, -132)},
        slow_chunk=128, split_tile=64, split_schemes=("serial", "pairwise"),
        instruction="mma.sync",
        evidence="FP8: mmaemu's RTX 4060 recordings (1.06e8 instruction outputs; cuBLASLt 12.8.3.14 GEMMs) and the "
                 "toolbox's Ada and L40S vectors; BF16 / FP16 / TF32: the toolbox's Ada and L40S vectors"),
    "ampere": TensorCoreModel(
        "ampere", "A100 (sm_80)",
        {"bf16": BlockFMA(8, 24, 23, -132), "fp16": BlockFMA(8, 24, 23, -132), "tf32": BlockFMA(4, 24, 23, -132)},
        slow_chunk=None, split_tile=None, split_schemes=(),
        instruction="mma.sync", evidence="the toolbox's A100 vectors"),
    "b200": TensorCoreModel(
        "b200", "B200 (sm_100), tcgen05",
        {_FP8: BlockFMA(32, 25, 23, -133, c_emin=-126), "bf16": BlockFMA(16, 25, 23, -133, c_emin=-126),
         "fp16": BlockFMA(16, 25, 23, -133, c_emin=-126), "tf32": BlockFMA(8, 25, 23, -133, c_emin=-126)},
        slow_chunk=None, split_tile=None, split_schemes=(),
        instruction="tcgen05.mma kind::f8f6f4 (FP8 and FP6 operands in any mix), kind::f16, kind::tf32, without "
                    "block scales: one chain over K (cuBLAS's K walk on B200 is not characterised)",
        evidence="MMA-Sim 2.1.1's TCGen05MMA model (a fused sum of 32 bytes of products, 25 fraction bits, the "
                 "addend read at exponent -126 at least, truncated to float32); not compared with B200 hardware "
                 "here"),
    "b200_mma": TensorCoreModel(
        "b200_mma", "B200 (sm_100), mma.sync",
        {_FP8: BlockFMA(32, 25, 23, -133, late=True),
         "bf16": BlockFMA(16, 25, 23, -133), "fp16": BlockFMA(16, 25, 23, -133), "tf32": BlockFMA(8, 25, 23, -133)},
        slow_chunk=None, split_tile=None, split_schemes=(),
        instruction="the legacy mma.sync path (not tcgen05, which cuBLAS uses on B200)",
        evidence="the toolbox's B200 vectors (FP8: a fit that is not unique, mmaemu's b200_mma_sync)"),
}


def get_model(name) -> TensorCoreModel:
    """The model named ``name`` (or a TensorCoreModel passed through); ValueError naming the choices."""
    if isinstance(name, TensorCoreModel):
        return name
    if isinstance(name, str) and name in MODELS:
        return MODELS[name]
    raise ValueError(f"model={name!r}: use one of {', '.join(repr(m) for m in MODELS)} (or 'exact')")


def family_of(dtype_name: str) -> str:
    """The format family of an input dtype name ('float8_e4m3fn' -> 'fp8', 'bfloat16' -> 'bf16', ...)."""
    n = str(dtype_name).replace("torch.", "")
    if n in ("float8_e4m3fn", "float8_e5m2", "e4m3", "e5m2", "float6_e2m3fn", "float6_e3m2fn", "e2m3", "e3m2"):
        return _FP8                               # (Blackwell's kind::f8f6f4 takes FP6 in the FP8 step)
    fam = {"bfloat16": "bf16", "float16": "fp16", "tf32": "tf32"}.get(n)
    if fam is None:
        raise ValueError(f"{n} inputs have no tensor-core model (FP8 E4M3 / E5M2, BF16, FP16 or TF32)")
    return fam
