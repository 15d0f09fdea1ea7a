"""Block-scaled tensor schemes: what a scheme is (SPEC §2-3), not how it is computed.

Every scheme is a frozen dataclass; names such as ``"nvfp4"`` resolve to a default instance and keyword
overrides (``flavor=``, ``block=``, ``scale_mode=``) make a variant with :func:`dataclasses.replace`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .formats import BF16, E2M1, E2M3, E3M2, E4M3, E4M3FNUZ, E5M2, E5M2FNUZ, INT8, UE5M3, UE8M0, Format

__all__ = ["NVFP4", "NVFP4UE5M3", "MX", "MX_ELEMS", "FP8Tensor", "FP8Blockwise", "BF16Cast", "Scheme", "SCHEMES", "get_scheme",
           "FLAVORS", "SCALE_MODES"]

FLAVORS = ("te", "paper", "torchao", "modelopt")
SCALE_MODES = ("rceil", "floor", "ceil", "even")


def _check_block(block, allowed_rows, cols) -> tuple[int, int]:
    if isinstance(block, int):
        block = (1, block)
    if (not isinstance(block, tuple) or len(block) != 2 or block[0] not in allowed_rows or block[1] != cols):
        rows = " or ".join(f"({r}, {cols})" for r in allowed_rows)
        raise ValueError(f"block={block!r} is not supported for this scheme; use {rows}")
    return block


@dataclass(frozen=True)
class NVFP4:
    """E2M1 elements, 16-element blocks (or 16x16 tiles), E4M3 block scale, FP32 tensor scale.

    Variants: ``row_scaled=True`` (TransformerEngine's ``row_scaled_nvfp4``, 1x16 te/paper only): one FP32
    second-level scale per row from that row's amax, so ``global_amax`` is a vector; ``per_tensor_scale=False``
    (torchao's ``nvfp4_quantize(..., per_tensor_scale=None)``, torchao flavour only): no FP32 tensor scale, the
    E4M3 block scale is ``fl(amax_b/6)`` clamped to [2^-6, 448]; ``four_over_six="mae"|"mse"`` (TE's
    ``nvfp4_use_4over6``, te flavour, RNE): each block (or 16x16 tile) tries its amax mapped to 6 and, with a
    1.5x larger scale, to 4, and keeps the candidate with the smaller error (ties: map to 6);
    ``four_over_six_fast_math`` measures that error in the FP16 product domain, and
    ``four_over_six_e4m3_max=256`` sets S_enc = 6 * 256 / amax; ``four_over_six_ties="map_to_4"`` resolves equal
    errors the other way (not TE's rule: it models a kernel that does, for validation). 4over6 combines with
    ``row_scaled`` (1x16): each row's S_enc = 6 * e4m3_max / amax_row, as TE's reference does."""
    block: tuple[int, int] = (1, 16)
    flavor: str = "te"
    elem: Format = E2M1
    scale_fmt: Format = E4M3
    row_scaled: bool = False
    per_tensor_scale: bool = True
    four_over_six: str | None = None
    four_over_six_fast_math: bool = False
    four_over_six_e4m3_max: int = 448
    four_over_six_ties: str = "map_to_6"

    @property
    def e4m3_max(self) -> int:
        """The E4M3 maximum in the second-level scale S_enc = 6 * e4m3_max / amax (256 or 448 with 4over6)."""
        return self.four_over_six_e4m3_max if self.four_over_six else 448

    def __post_init__(self):
        object.__setattr__(self, "block", _check_block(self.block, (1, 16), 16))
        if self.four_over_six is not None:
            if self.four_over_six not in ("mae", "mse"):
                raise ValueError(f"four_over_six={self.four_over_six!r}: use 'mae', 'mse' or None")
            if self.flavor != "te" or not self.per_tensor_scale:
                raise ValueError(f"four_over_six is TransformerEngine's: use flavor='te' (not {self.flavor!r})")
        if self.four_over_six_ties not in ("map_to_6", "map_to_4"):
            raise ValueError(f"four_over_six_ties={self.four_over_six_ties!r}: use 'map_to_6' (TE) or 'map_to_4'")
        if self.four_over_six_e4m3_max not in (448, 256):
            raise ValueError(f"four_over_six_e4m3_max={self.four_over_six_e4m3_max!r}: use 448 or 256")
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor={self.flavor!r} is not an NVFP4 flavour; use one of {list(FLAVORS)}")
        if self.row_scaled and (self.block != (1, 16) or self.flavor not in ("te", "paper")):
            raise ValueError("row_scaled=True is TransformerEngine's per-row tensor scale: it takes 1x16 blocks and "
                             f"the te or paper flavour, not block={self.block}, flavor={self.flavor!r}")
        if not self.per_tensor_scale and self.flavor != "torchao":
            raise ValueError("per_tensor_scale=False is torchao's single-level NVFP4: use flavor='torchao' "
                             f"(not {self.flavor!r})")

    @property
    def name(self) -> str:
        return "nvfp4_2d" if self.block[0] == 16 else "nvfp4"


# the OCP Microscaling v1.0 element types and the concrete format each one makes
MX_ELEMS = {E2M1: "mxfp4", E4M3: "mxfp8_e4m3", E5M2: "mxfp8_e5m2", E2M3: "mxfp6_e2m3", E3M2: "mxfp6_e3m2",
            INT8: "mxint8"}


@dataclass(frozen=True)
class MX:
    """OCP microscaling: ``elem`` elements, 32-element blocks, UE8M0 power-of-two scales."""
    elem: Format = E2M1
    block: tuple[int, int] = (1, 32)
    scale_mode: str = "rceil"
    scale_fmt: Format = UE8M0

    def __post_init__(self):
        object.__setattr__(self, "block", _check_block(self.block, (1,), 32))
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode={self.scale_mode!r} is not an MX scale mode; use one of "
                             f"{list(SCALE_MODES)}")
        if self.elem not in MX_ELEMS:
            raise ValueError(f"elem={self.elem!r}: MX elements are {', '.join(MX_ELEMS.values())}'s "
                             f"({', '.join(f.name.upper() for f in MX_ELEMS)})")

    @property
    def name(self) -> str:
        return MX_ELEMS[self.elem]


@dataclass(frozen=True)
class NVFP4UE5M3:
    """E2M1 elements in 16-element blocks (or 16x16 tiles) with unsigned E5M3 block scales, under an FP32 tensor
    scale that maps the tensor amax to ``scale_target`` x 6 (``per_tensor_scale=False``: none): Hu, Luschi and
    Balanca's UE5M3 recipe (:mod:`fp4sim.ue5m3` states the rule)."""
    block: tuple[int, int] = (1, 16)
    scale_target: float = 448.0
    per_tensor_scale: bool = True
    elem: Format = E2M1
    scale_fmt: Format = UE5M3

    def __post_init__(self):
        object.__setattr__(self, "block", _check_block(self.block, (1, 16), 16))
        t = self.scale_target
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < float(t) < float("inf")):
            raise ValueError(f"scale_target={t!r}: a finite positive number (448 by default)")
        object.__setattr__(self, "scale_target", float(t))
        if not isinstance(self.per_tensor_scale, bool):
            raise TypeError(f"per_tensor_scale={self.per_tensor_scale!r}: give True or False")

    @property
    def name(self) -> str:
        return "nvfp4_ue5m3"


@dataclass(frozen=True)
class FP8Tensor:
    """FP8 with one FP32 scale per tensor from the current amax ("current scaling"): OCP's E4M3 / E5M2, or the
    FNUZ formats of AMD's CDNA3 (E4M3FNUZ, max 240; E5M2FNUZ), as TransformerEngine on ROCm scales them."""
    elem: Format = E4M3

    def __post_init__(self):
        if self.elem not in (E4M3, E5M2, E4M3FNUZ, E5M2FNUZ):
            raise ValueError(f"elem={self.elem!r}: per-tensor FP8 takes E4M3, E5M2, E4M3FNUZ or E5M2FNUZ elements")

    @property
    def name(self) -> str:
        return f"fp8_{self.elem.name}"


@dataclass(frozen=True)
class FP8Blockwise:
    """E4M3 with an FP32 scale ``amax_b / 448`` per 1x128 block (activations, gradients) or 128x128 tile
    (weights), as DeepSeek-V3's recipe."""
    block: tuple[int, int] = (1, 128)
    elem: Format = E4M3

    def __post_init__(self):
        object.__setattr__(self, "block", _check_block(self.block, (1, 128), 128))

    @property
    def name(self) -> str:
        return "fp8_blockwise"


@dataclass(frozen=True)
class BF16Cast:
    """Round to bfloat16 (RNE, overflow to Inf as IEEE)."""
    elem: Format = BF16

    @property
    def name(self) -> str:
        return "bf16"


Scheme = NVFP4 | NVFP4UE5M3 | MX | FP8Tensor | FP8Blockwise | BF16Cast

SCHEMES: dict[str, Scheme] = {
    "nvfp4": NVFP4(), "nvfp4_2d": NVFP4(block=(16, 16)),
    "mxfp4": MX(E2M1), "mxfp8_e4m3": MX(E4M3), "mxfp8_e5m2": MX(E5M2),
    "mxfp6_e2m3": MX(E2M3), "mxfp6_e3m2": MX(E3M2), "mxint8": MX(INT8),
    "fp8_e4m3": FP8Tensor(E4M3), "fp8_e5m2": FP8Tensor(E5M2),
    "fp8_e4m3fnuz": FP8Tensor(E4M3FNUZ), "fp8_e5m2fnuz": FP8Tensor(E5M2FNUZ),
    "fp8_blockwise": FP8Blockwise(), "bf16": BF16Cast(),
    "nvfp4_ue5m3": NVFP4UE5M3(), "nvfp4_ue5m3_2d": NVFP4UE5M3(block=(16, 16)),
}


def get_scheme(scheme, *, flavor=None, block=None, scale_mode=None, row_scaled=None,
               per_tensor_scale=None, four_over_six=None, four_over_six_fast_math=None,
               four_over_six_e4m3_max=None, four_over_six_ties=None, scale_target=None) -> Scheme:
    """Resolve a scheme name or object and apply keyword overrides (``None`` keeps the scheme's own)."""
    if isinstance(scheme, str):
        if scheme.lower() not in SCHEMES:
            raise ValueError(f"scheme={scheme!r} is not known; use one of {sorted(SCHEMES)} or a scheme object")
        scheme = SCHEMES[scheme.lower()]
    elif not isinstance(scheme, (NVFP4, NVFP4UE5M3, MX, FP8Tensor, FP8Blockwise, BF16Cast)):
        raise TypeError(f"scheme must be a scheme name or object, not {type(scheme).__name__}")
    changes = {}
    for key, val in (("flavor", flavor), ("block", block), ("scale_mode", scale_mode), ("row_scaled", row_scaled),
                     ("per_tensor_scale", per_tensor_scale), ("four_over_six", four_over_six),
                     ("four_over_six_fast_math", four_over_six_fast_math),
                     ("four_over_six_e4m3_max", four_over_six_e4m3_max), ("four_over_six_ties", four_over_six_ties),
                     ("scale_target", scale_target)):
        if val is None:
            continue
        if not any(f.name == key for f in dataclasses.fields(scheme)):
            raise ValueError(f"{key}= does not apply to scheme {scheme.name!r}")
        changes[key] = tuple(val) if key == "block" and not isinstance(val, int) else val
    return dataclasses.replace(scheme, **changes) if changes else scheme
