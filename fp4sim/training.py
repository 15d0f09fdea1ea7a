"""What a low-precision training recipe quantizes: the six operands of a linear layer's three GEMMs.

A linear layer ``y = x Wᵀ`` runs three GEMMs per step:

=======  =====================  ==========================  ==========================
GEMM     computes               operand 1 (along the dot)   operand 2 (along the dot)
=======  =====================  ==========================  ==========================
Fprop    y  = x · Wᵀ            ``fprop_x``: x along K      ``fprop_w``: W along K
Dgrad    dx = dy · W            ``dgrad_dy``: dy along N    ``dgrad_w``: W along N
Wgrad    dW = dyᵀ · x           ``wgrad_dy``: dy along M    ``wgrad_x``: x along M
=======  =====================  ==========================  ==========================

(M tokens, K input features, N output features.) Each operand is quantized from the high-precision tensor
along its GEMM's dot-product axis, with its own :class:`Operand` settings; an RHT of size d, when set on both
operands of a GEMM, rotates both along the dot axis with the same signs (the product is unchanged in exact
arithmetic). :meth:`Recipe.preset` builds the paper's recipes and their ablations.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass, field

__all__ = ["Operand", "Recipe", "PRESETS", "OPERANDS", "presets_markdown", "SlowPathWarning"]


class SlowPathWarning(UserWarning):
    """A recipe whose operands cannot take the fused fast-path kernels (``accumulate="fast"``): its training
    steps run several times slower than the presets' (:meth:`Recipe.general_path_operands` says which and why)."""

OPERANDS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy")
GEMM_OF = {"fprop_x": "fprop", "fprop_w": "fprop", "dgrad_dy": "dgrad", "dgrad_w": "dgrad", "wgrad_x": "wgrad",
           "wgrad_dy": "wgrad"}
_SCHEMES = ("nvfp4", "nvfp4_ue5m3", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxint8",
            "fp8_blockwise", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz", "bf16")
SIGNS = ("te", "fixed", "per_transform", "per_layer", "none")
BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
AMAX_MODES = ("current", "delayed", "history")
TENSOR_SCALED = ("nvfp4", "nvfp4_ue5m3", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz")   # the schemes with a per-tensor amax


@dataclass(frozen=True)
class Operand:
    """How one GEMM operand is quantized.

    Parameters
    ----------
    scheme : an fp4sim scheme name (``"nvfp4"``, ``"mxfp4"``, ``"mxfp8_e4m3"``, ``"fp8_blockwise"``, ``"fp8_e4m3"``,
        ``"bf16"``, ...) or None (kept in float32).
    block : ``(1, 16)`` or ``(16, 16)`` for NVFP4, ``(1, 128)`` or ``(128, 128)`` for FP8 blockwise; None for
        the scheme's default.
    rounding : ``"rne"`` or ``"sr"`` (stochastic, Philox bits keyed by the recipe seed and a per-call counter).
    rht : None, or the Hadamard size d (2..128) applied along the dot axis before quantizing (the tensor amax is
        taken after the transform).
    rht_signs : ``"te"`` (TransformerEngine's 16-element vector; d = 16), ``"fixed"`` (one vector from the
        recipe seed), ``"per_layer"`` (one vector per layer from the recipe seed and the layer's index, as
        torchao's NVFP4 training draws one per layer; :func:`fp4sim.emulate.per_layer_signs`), ``"per_transform"``
        (a new vector for every GEMM call) or ``"none"`` (all +1).
    four_over_six : None, or ``"mae"`` / ``"mse"``: NVFP4 block scales by TransformerEngine's 4over6 rule with that
        error measure (round to nearest only).
    amax : the tensor amax behind the per-tensor scale (NVFP4's FP32 scale, FP8's tensor scale): ``"current"``
        (default: this call's tensor), ``"delayed"`` (sample-and-hold: measured on the calls ``c`` with ``c %
        amax_every == 0`` and held in between, so the scale a kernel uses is up to ``amax_every - 1`` calls
        stale) or ``"history"`` (TransformerEngine's delayed scaling: the largest amax of the previous
        ``amax_window`` calls, this call's measured after; the first call, with no history, uses its own). A
        tensor that outgrew the held amax saturates, as in the real kernels. The state travels with the layer
        (QuantLinear's state_dict), so a resumed run continues bit for bit.
    amax_every, amax_window : the refresh period of ``"delayed"`` and the history length of ``"history"``.
    rbits_mapping : the stochastic-rounding rule, as :func:`fp4sim.encode` names it: ``"te"`` (round up iff the
        8 remainder bits below the quantum plus the random byte r carry) or ``"midpoint"`` (up iff delta + (2r +
        1) / 512 >= 1: unbiased at the 1/256 lattice midpoints, Graphcore's ``StochasticFast``).
    per_token : NVFP4 1x16 only: one FP32 outer scale per row of the operand as its GEMM reads it instead of
        one per tensor — per token for a row-wise operand (x, dy along the features), per feature for a
        column-wise one (the Wgrad operands, along the tokens) — TransformerEngine's
        ``NVFP4PerTokenBlockScaling``; fp4sim's ``row_scaled`` quantization along the operand's axis.
    scale_target, per_tensor_scale : ``"nvfp4_ue5m3"`` only (UE5M3 block scales, :mod:`fp4sim.ue5m3`): the target
        the tensor amax maps to over 6 (None: 448), and whether there is an FP32 tensor scale at all.
    """
    scheme: str | None = None
    block: tuple | None = None
    rounding: str = "rne"
    rht: int | None = None
    rht_signs: str = "te"
    four_over_six: str | None = None
    amax: str = "current"
    amax_every: int = 1
    amax_window: int = 1
    rbits_mapping: str = "te"
    per_token: bool = False
    scale_target: float | None = None
    per_tensor_scale: bool = True

    def __post_init__(self):
        if self.scheme is not None and self.scheme not in _SCHEMES:
            raise ValueError(f"Operand scheme={self.scheme!r}: use one of {list(_SCHEMES)} or None")
        if self.rounding not in ("rne", "sr"):
            raise ValueError(f"Operand rounding={self.rounding!r}: use 'rne' or 'sr'")
        if self.rbits_mapping not in ("te", "midpoint"):
            raise ValueError(f"Operand rbits_mapping={self.rbits_mapping!r}: use 'te' or 'midpoint'")
        if self.rbits_mapping != "te" and self.rounding != "sr":
            raise ValueError(f"Operand rbits_mapping={self.rbits_mapping!r} is a stochastic-rounding rule; the "
                             "operand rounds to nearest (rounding='sr' to use it)")
        if self.rht is not None and (not isinstance(self.rht, int) or self.rht < 2 or self.rht > 128
                                     or self.rht & (self.rht - 1)):
            raise ValueError(f"Operand rht={self.rht!r}: a power of two in 2..128, or None")
        if self.rht_signs not in SIGNS:
            raise ValueError(f"Operand rht_signs={self.rht_signs!r}: use one of {list(SIGNS)}")
        if self.rht_signs == "te" and self.rht not in (None, 16):
            raise ValueError(f"rht_signs='te' is TransformerEngine's 16-element vector; rht={self.rht} needs "
                             "'fixed', 'per_transform' or 'none'")
        if self.four_over_six is not None:
            if self.four_over_six not in ("mae", "mse"):
                raise ValueError(f"Operand four_over_six={self.four_over_six!r}: use 'mae', 'mse' or None")
            if self.scheme != "nvfp4" or self.rounding != "rne":
                raise ValueError(f"Operand four_over_six={self.four_over_six!r}: 4over6 is an NVFP4 round-to-nearest "
                                 f"rule (scheme 'nvfp4', rounding 'rne'), not {self.scheme!r} with {self.rounding!r}")
        if self.amax not in AMAX_MODES:
            raise ValueError(f"Operand amax={self.amax!r}: use one of {list(AMAX_MODES)}")
        for k in ("amax_every", "amax_window"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Operand {k}={v!r}: a number of calls >= 1")
        if self.scheme != "nvfp4_ue5m3" and (self.scale_target is not None or self.per_tensor_scale is not True):
            raise ValueError(f"Operand scale_target / per_tensor_scale: options of the 'nvfp4_ue5m3' scheme (UE5M3 "
                             f"block scales), not of {self.scheme!r}")
        if not isinstance(self.per_tensor_scale, bool):
            raise TypeError(f"Operand per_tensor_scale={self.per_tensor_scale!r}: give True or False")
        if self.scale_target is not None and (isinstance(self.scale_target, bool) or not isinstance(
                self.scale_target, (int, float)) or not 0 < self.scale_target < float("inf")):
            raise ValueError(f"Operand scale_target={self.scale_target!r}: a finite positive number")
        if not isinstance(self.per_token, bool):
            raise TypeError(f"Operand per_token={self.per_token!r}: give True or False")
        if self.per_token and (self.scheme != "nvfp4" or (self.block is not None and tuple(self.block) != (1, 16))
                               or self.amax != "current"):
            raise ValueError(f"Operand per_token=True: a per-row outer scale is an NVFP4 1x16 option with the current "
                             f"amax (scheme {self.scheme!r}, block {self.block}, amax {self.amax!r} here)")
        if self.amax != "current" and self.scheme not in TENSOR_SCALED:
            raise ValueError(f"Operand amax={self.amax!r}: only a per-tensor scale can be delayed; scheme "
                             f"{self.scheme!r} has none (use one of {list(TENSOR_SCALED)})")
        if self.block is not None:
            if isinstance(self.block, (str, bytes)) or not hasattr(self.block, "__len__"):
                raise ValueError(f"Operand block={self.block!r}: a (rows, columns) pair such as (1, 16), or None")
            object.__setattr__(self, "block", tuple(self.block))
            if self.scheme is None:
                raise ValueError(f"Operand block={self.block}: an unquantized operand (scheme=None) has no blocks")
            from .schemes import get_scheme
            try:
                get_scheme(self.scheme, block=self.block)
            except (TypeError, ValueError) as e:
                raise ValueError(f"Operand({self.scheme!r}, block={self.block}): {e}") from None

    @property
    def quantized(self) -> bool:
        return self.scheme is not None

    def label(self) -> str:
        if self.scheme is None:
            return "fp32"
        b = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        r = f" RHT{self.rht}" if self.rht else ""
        f = f" 4over6-{self.four_over_six.upper()}" if self.four_over_six else ""
        a = (f" amax/{self.amax_every}" if self.amax == "delayed" else f" amax-hist{self.amax_window}"
             if self.amax == "history" else "")
        m = "-mid" if self.rbits_mapping == "midpoint" else ""
        t = " per-token" if self.per_token else ""
        u = (f" T{self.scale_target:g}" if self.scale_target is not None else "") + \
            ("" if self.per_tensor_scale else " no-tensor-scale")
        return f"{self.scheme}{b} {self.rounding.upper()}{m}{r}{f}{a}{t}{u}"


@dataclass(frozen=True)
class Recipe:
    """The six operands (see the module docstring), which layers stay in high precision, and the RNG seed.

    Parameters
    ----------
    fprop_x, fprop_w, dgrad_dy, dgrad_w, wgrad_x, wgrad_dy : the :class:`Operand` of each GEMM input.
    keep : name globs of linear layers that stay in high precision (``high_precision``), e.g. ``("lm_head",)``.
    keep_first, keep_last : the first / last N transformer blocks stay in high precision; a layer's block is the
        first integer component of its name (``layers.11.mlp.up`` is block 11; ``block_pattern`` changes the rule).
    high_precision : the scheme of the layers kept: ``"bf16"`` (default: all six operands rounded to bf16, as the
        paper's BF16 layers) or None (plain float32).
    rht_dtype : ``"bf16"`` (default; TransformerEngine's kernels round the rotated tensor to bf16) or ``"fp32"``.
    dgrad_w_reuse_fprop : simulation-only: Dgrad uses the weight exactly as quantized for Fprop (along K), not
        re-quantized along N (the paper's Fig. 14 "same dim" case for 1x16 weights).
    wgrad_x_reuse_fprop : simulation-only: Wgrad uses the activation exactly as quantized for Fprop (along K), not
        re-quantized along the tokens (Fig. 14's "same dim" case for 1x16 activations); needs a Wgrad GEMM
        without an RHT (the Fprop copy is not rotated).
    accumulate : the GEMMs' accumulation model, any name :func:`fp4sim.gemm` takes: ``"exact"`` / ``"te_reference"``
        (TE's reference rule), ``"fast"`` (dequantize + BLAS), an NVFP4 model such as ``"k64_rtz"`` (the native
        Blackwell model, fitted through TE), ``"tcgen05"`` (MMA-Sim's Blackwell instructions: NVFP4, MXFP4, MXFP8,
        MXFP6) or a chip's tensor-core model (``"hopper"``, ``"hopper_fast_accum"``, ``"ada"``, ``"ampere"``,
        ``"b200"``, ``"b200_mma"``: FP8 and BF16 GEMMs as that chip computes them, so the FP8 and BF16 baselines
        train as Hopper does; ``"cdna3"``: AMD MI300's FP8 FNUZ and BF16 GEMMs) — each applies to the GEMMs of the formats it models; every other GEMM of the run then uses
        its exact rule.
    accumulate_grid : ``grid`` of the kG models (None, or 1024: the accumulator rounded to multiples of 1/1024).
    backward_override : TransformerEngine's switch of the same name. None (default): the backward GEMMs quantize
        their operands as the recipe says. ``"high_precision"``: Dgrad and Wgrad run on the original x, W and dy in
        the high-precision format (:attr:`high_precision`: bf16-rounded, or float32), as a kept layer's backward.
        ``"dequantized"``: they run on the forward's quantized x and W, dequantized (the gradients of the quantized
        forward: what RL fine-tuning uses for train / inference consistency), and dy, all in the high-precision
        format. Either replaces the six backward operands, so it cannot be combined with the reuse switches; the
        dequantized mode needs Fprop operands without an RHT (their values would be rotated).
    seed : the Philox key of stochastic rounding and of ``"fixed"`` / ``"per_transform"`` RHT signs.
    on_nonfinite : what :class:`fp4sim.torch.QuantLinear` does when an operand it quantizes holds NaN or Inf. The
        bits stay the hardware's either way (E2M1 encodes NaN as +6 under CUDA's satfinite rule, so a NaN does
        not reach the output of an NVFP4 / MXFP4 GEMM). ``"warn"`` (default): a NaN in an operand quantized to
        FP4 warns once per layer and operand; ``"raise"``: a NaN or Inf in any quantized operand raises
        FloatingPointError naming the layer and operand; ``"ignore"``: no check.
    """
    fprop_x: Operand = Operand()
    fprop_w: Operand = Operand()
    dgrad_dy: Operand = Operand()
    dgrad_w: Operand = Operand()
    wgrad_x: Operand = Operand()
    wgrad_dy: Operand = Operand()
    keep: tuple = ()
    keep_first: int = 0
    keep_last: int = 0
    block_pattern: str = r"(?:^|\.)(\d+)(?:\.|$)"
    high_precision: str | None = "bf16"
    rht_dtype: str = "bf16"
    dgrad_w_reuse_fprop: bool = False
    wgrad_x_reuse_fprop: bool = False
    accumulate: str = "exact"
    accumulate_grid: int | None = None
    backward_override: str | None = None
    seed: int = 0
    on_nonfinite: str = "warn"
    name: str = "custom"
    identity: bool = field(default=False, repr=False)

    def __post_init__(self):
        for op in OPERANDS:
            if not isinstance(getattr(self, op), Operand):
                raise TypeError(f"Recipe.{op} must be an Operand, not {type(getattr(self, op)).__name__}")
        if self.rht_dtype not in ("bf16", "fp32"):
            raise ValueError(f"rht_dtype={self.rht_dtype!r}: use 'bf16' or 'fp32'")
        from .gemm import parse_accumulate
        parse_accumulate(self.accumulate, self.accumulate_grid)     # ValueError naming the choices
        if self.backward_override not in BACKWARD_OVERRIDES:
            raise ValueError(f"backward_override={self.backward_override!r}: use one of {list(BACKWARD_OVERRIDES)}")
        if self.backward_override is not None:
            both = [k for k in ("dgrad_w_reuse_fprop", "wgrad_x_reuse_fprop") if getattr(self, k)]
            if both:
                raise ValueError(f"backward_override={self.backward_override!r} replaces the backward operands, so "
                                 f"{both[0]} has nothing to act on; set one or the other")
        if self.backward_override == "dequantized" and self.fprop_x.rht:
            raise ValueError("backward_override='dequantized' reuses the Fprop operands, which have a "
                             f"{self.fprop_x.rht}-point RHT here (their values are rotated); drop rht_fprop")
        if self.on_nonfinite not in ("warn", "raise", "ignore"):
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r}: use 'warn', 'raise' or 'ignore'")
        if self.high_precision not in (None, "bf16"):
            raise ValueError(f"high_precision={self.high_precision!r}: use 'bf16' or None (float32)")
        if isinstance(self.keep, str):
            object.__setattr__(self, "keep", (self.keep,))
        for k in ("keep_first", "keep_last"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{k}={v!r}: a number of blocks >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 63:
            raise ValueError(f"seed={self.seed!r}: an integer in [0, 2**63)")
        for k in ("dgrad_w_reuse_fprop", "wgrad_x_reuse_fprop"):
            if not isinstance(getattr(self, k), bool):
                raise TypeError(f"{k}={getattr(self, k)!r}: give True or False")
        if self.wgrad_x_reuse_fprop and self.wgrad_x.rht:
            raise ValueError("wgrad_x_reuse_fprop: Wgrad would reuse Fprop's copy of x, which has no RHT, but the "
                             f"Wgrad GEMM has a {self.wgrad_x.rht}-point RHT; disable it (disable_rht=True)")
        for g in ("fprop", "dgrad", "wgrad"):
            a, b = [getattr(self, op) for op in OPERANDS if GEMM_OF[op] == g]
            if (a.rht, a.rht_signs if a.rht else None) != (b.rht, b.rht_signs if b.rht else None):
                raise ValueError(f"the {g} GEMM's operands must share one RHT (size and signs), or neither has one: "
                                 f"{a.rht}/{a.rht_signs} vs {b.rht}/{b.rht_signs}")
            if a.quantized != b.quantized:
                raise ValueError(f"the {g} GEMM quantizes one operand and not the other; quantize both or neither")

    # ------------------------------------------------------------------------------------------ layers
    def block_of(self, name: str):
        m = re.search(self.block_pattern, name)
        return int(m.group(1)) if m else None

    def keeps(self, name: str, n_blocks: int | None) -> bool:
        """Whether the layer ``name`` stays in high precision (``n_blocks``: how many blocks the model has)."""
        if any(fnmatch.fnmatchcase(name, g) for g in self.keep):
            return True
        b = self.block_of(name)
        if b is None or n_blocks is None:
            return False
        return b < self.keep_first or b >= n_blocks - self.keep_last

    def backward_recipe(self) -> "Recipe":
        """The recipe the backward GEMMs run under: this one, or with ``backward_override`` set the high-precision
        recipe (on the original or the dequantized forward operands, which :mod:`fp4sim.emulate` chooses)."""
        return self if self.backward_override is None else self.high_precision_recipe()

    def general_path_operands(self) -> dict:
        """``{operand: why}`` for the operands that ``accumulate="fast"`` quantizes through the general path
        (``fake_quantize``, the planning layer) instead of a fused fast-path kernel (:mod:`fp4sim.fastpath`): UE5M3
        block scales (no fused kernel), and every operand of a recipe with a delayed or history amax (the fast
        path reads the current amax only). The values are the same bits either way; the step is slower (see
        docs/training.md for the measured factors). Empty unless ``accumulate`` is ``"fast"``."""
        if self.accumulate != "fast":
            return {}
        held = sorted({getattr(self, op).amax for op in OPERANDS} - {"current"})
        if held:
            why = (f"a {' / '.join(held)} amax: the fast path reads the current amax, so every operand takes the "
                   "general path")
            return {op: why for op in OPERANDS if getattr(self, op).quantized}
        return {op: "UE5M3 block scales have no fused fast-path kernel" for op in OPERANDS
                if getattr(self, op).scheme == "nvfp4_ue5m3"}

    def high_precision_recipe(self) -> "Recipe":
        """The recipe a kept layer runs under."""
        if self.high_precision is None:
            return Recipe.preset("none", seed=self.seed, on_nonfinite=self.on_nonfinite)
        return Recipe.preset("bf16", seed=self.seed, accumulate=self.accumulate,
                             accumulate_grid=self.accumulate_grid, on_nonfinite=self.on_nonfinite)

    def table(self) -> str:
        """The six operands as a Markdown table (the paper's Fig. 5)."""
        rows = ["| GEMM | operand | quantization |", "|---|---|---|"]
        for op in OPERANDS:
            rows.append(f"| {GEMM_OF[op]} | {op.split('_')[1]} | {getattr(self, op).label()} |")
        return "\n".join(rows)

    # ------------------------------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, **overrides) -> "Recipe":
        """A named recipe with switches and field overrides.

        Names: ``"none"`` (no quantization: exactly ``nn.Linear``), ``"bf16"``, ``"nvfp4_paper"``, ``"mxfp4_paper"``,
        ``"mxfp8"``, ``"mxfp6"`` (every operand MXFP6 E3M2, round to nearest), ``"fp8_blockwise"``. Switches (TransformerEngine's names, then the paper's ablations):
        ``disable_rht``, ``disable_stochastic_rounding``, ``disable_2d_quantization``, ``sr_activations``,
        ``sr_weights``, ``sr_backward`` (SR on every backward operand), ``rht_fprop``, ``rht_dgrad``,
        ``rht_size=d``, ``rht_signs=`` ``"te" | "fixed" | "per_transform" | "none"``, ``weights_1d_reuse``
        (1x16 weights quantized once along K and reused in Dgrad), ``four_over_six="mae" | "mse"`` (TE's 4over6
        block scales on every round-to-nearest NVFP4 operand), ``delayed_amax=D`` / ``amax_history=N`` (every
        operand with a per-tensor scale takes :class:`Operand`'s ``amax="delayed"`` / ``"history"``),
        ``per_token`` (every NVFP4 1x16 operand takes ``per_token=True``), ``scale_format="ue5m3"`` (every NVFP4
        operand with UE5M3 block scales) and ``per_tensor_scale=False`` (those without a tensor scale). Any other
        keyword is a Recipe field (e.g.
        ``backward_override="dequantized"``, TransformerEngine's switch of that name).
        """
        if name not in PRESETS:
            raise ValueError(f"preset {name!r} is not known; use one of {list(PRESETS)}")
        sw = {k: overrides.pop(k) for k in list(overrides) if k in _SWITCHES}
        for k, v in sw.items():
            if k == "rht_size":
                if isinstance(v, bool) or not isinstance(v, int):
                    raise TypeError(f"rht_size={v!r}: give the Hadamard size as an integer (2..128)")
            elif k == "rht_signs":
                if v not in SIGNS:
                    raise ValueError(f"rht_signs={v!r}: use one of {list(SIGNS)}")
            elif k == "four_over_six":
                if v not in ("mae", "mse"):
                    raise ValueError(f"four_over_six={v!r}: use 'mae' or 'mse'")
            elif k == "scale_format":
                if v not in ("e4m3", "ue5m3"):
                    raise ValueError(f"scale_format={v!r}: use 'e4m3' (NVFP4) or 'ue5m3'")
            elif k == "per_tensor_scale":
                if not isinstance(v, bool):
                    raise TypeError(f"per_tensor_scale={v!r}: a switch takes True or False")
            elif k == "per_token":
                if not isinstance(v, bool):
                    raise TypeError(f"per_token={v!r}: a switch takes True or False")
            elif k == "rbits_mapping":
                if v not in ("te", "midpoint"):
                    raise ValueError(f"rbits_mapping={v!r}: use 'te' or 'midpoint'")
            elif k in ("delayed_amax", "amax_history"):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"{k}={v!r}: a number of calls >= 1")
            elif not isinstance(v, bool):
                raise TypeError(f"{k}={v!r}: a switch takes True or False")
        bad = [k for k in overrides if k not in {f.name for f in dataclasses.fields(cls)}]
        if bad:
            raise ValueError(f"Recipe.preset({name!r}): unknown switches or fields {bad}; switches: "
                             f"{sorted(_SWITCHES)}")
        r = PRESETS[name]()
        ops = {op: getattr(r, op) for op in OPERANDS}
        rep = dataclasses.replace
        if name == "none" and sw:
            raise ValueError("the 'none' preset quantizes nothing; its switches do not apply")
        if sw.get("disable_2d_quantization"):
            for op in ("fprop_w", "dgrad_w"):
                if ops[op].block and ops[op].block[0] > 1:
                    ops[op] = rep(ops[op], block=(1, ops[op].block[1]))
        if sw.get("weights_1d_reuse"):
            for op in ("fprop_w", "dgrad_w"):
                if ops[op].block and ops[op].block[0] > 1:
                    ops[op] = rep(ops[op], block=(1, ops[op].block[1]))
            overrides["dgrad_w_reuse_fprop"] = True
        if sw.get("sr_activations"):
            for op in ("fprop_x", "wgrad_x"):
                ops[op] = rep(ops[op], rounding="sr")
        if sw.get("sr_weights"):
            for op in ("fprop_w", "dgrad_w"):
                ops[op] = rep(ops[op], rounding="sr")
        if sw.get("sr_backward"):
            for op in ("dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy"):
                ops[op] = rep(ops[op], rounding="sr")
        if sw.get("disable_stochastic_rounding"):
            for op in OPERANDS:
                ops[op] = rep(ops[op], rounding="rne", rbits_mapping="te")
        if "rbits_mapping" in sw:
            hit = [op for op in OPERANDS if ops[op].rounding == "sr"]
            if not hit:
                raise ValueError(f"rbits_mapping={sw['rbits_mapping']!r}: preset {name!r} (with these switches) "
                                 "rounds nothing stochastically")
            for op in hit:
                ops[op] = rep(ops[op], rbits_mapping=sw["rbits_mapping"])
        if sw.get("four_over_six"):
            hit = [op for op in OPERANDS if ops[op].scheme == "nvfp4" and ops[op].rounding == "rne"]
            if not hit:
                raise ValueError(f"four_over_six={sw['four_over_six']!r}: 4over6 applies to round-to-nearest NVFP4 "
                                 f"operands and preset {name!r} has none (it would change nothing); use an NVFP4 "
                                 "preset such as 'nvfp4_paper'")
            for op in hit:
                ops[op] = rep(ops[op], four_over_six=sw["four_over_six"])
        if sw.get("scale_format") == "ue5m3" and sw.get("per_token"):
            raise ValueError("per_token=True with scale_format='ue5m3': fp4sim's per-row (per-token) outer scale is an "
                             "option of NVFP4's E4M3 block scales; UE5M3 block scales take one tensor scale "
                             "(per_tensor_scale=True) or none (False), their range being wide enough without it. "
                             "Choose one of the two switches")
        if sw.get("scale_format") == "ue5m3":
            hit = [op for op in OPERANDS if ops[op].scheme == "nvfp4"]
            if not hit:
                raise ValueError(f"scale_format='ue5m3': preset {name!r} has no NVFP4 operand")
            for op in hit:
                if ops[op].four_over_six:
                    raise ValueError("scale_format='ue5m3' with four_over_six: 4over6 is an E4M3 block-scale rule")
                ops[op] = rep(ops[op], scheme="nvfp4_ue5m3")
        if "per_tensor_scale" in sw:
            hit = [op for op in OPERANDS if ops[op].scheme == "nvfp4_ue5m3"]
            if not hit:
                raise ValueError("per_tensor_scale=: an option of UE5M3 block scales; add scale_format='ue5m3'")
            for op in hit:
                ops[op] = rep(ops[op], per_tensor_scale=sw["per_tensor_scale"])
        if sw.get("per_token"):
            hit = [op for op in OPERANDS if ops[op].scheme == "nvfp4" and ops[op].block in (None, (1, 16))]
            if not hit:
                raise ValueError(f"per_token=True: preset {name!r} has no NVFP4 1x16 operand")
            for op in hit:
                ops[op] = rep(ops[op], per_token=True)
        for k, mode, field_ in (("delayed_amax", "delayed", "amax_every"), ("amax_history", "history", "amax_window")):
            if k in sw:
                hit = [op for op in OPERANDS if ops[op].scheme in TENSOR_SCALED]
                if not hit:
                    raise ValueError(f"{k}={sw[k]}: preset {name!r} has no operand with a per-tensor scale")
                for op in hit:
                    ops[op] = rep(ops[op], amax=mode, **{field_: sw[k]})
        d_default = next((ops[op].rht for op in OPERANDS if ops[op].rht), 16)
        d = sw.get("rht_size", d_default)
        signs = sw.get("rht_signs")
        gemms = {"wgrad"} if any(ops[op].rht for op in ("wgrad_x", "wgrad_dy")) else set()
        if sw.get("rht_fprop"):
            gemms.add("fprop")
        if sw.get("rht_dgrad"):
            gemms.add("dgrad")
        if sw.get("disable_rht"):
            gemms = set()
        for op in OPERANDS:
            if GEMM_OF[op] in gemms:
                cur = ops[op].rht_signs if ops[op].rht else ("te" if d == 16 else "fixed")
                s = signs or cur
                if s == "te" and d != 16:
                    s = "fixed"
                ops[op] = rep(ops[op], rht=d, rht_signs=s)
            else:
                ops[op] = rep(ops[op], rht=None, rht_signs="te")
        for op in OPERANDS:                  # an operand given by name replaces the preset's (after the switches)
            if op in overrides:
                ops[op] = overrides.pop(op)
        return rep(r, **ops, **overrides)


def presets_markdown() -> str:
    """Every preset's six operands as one Markdown table, then the switches and the Recipe fields a preset call
    takes (docs/training.md's; ``fp4sim recipes``)."""
    names = [n for n in PRESETS if n != "none"]
    recs = [Recipe.preset(n) for n in names]
    rows = ["| GEMM | operand | " + " | ".join(f"`{n}`" for n in names) + " |",
            "|---|---|" + "---|" * len(names)]
    for op in OPERANDS:
        rows.append(f"| {GEMM_OF[op]} | {op.split('_')[1]} | " + " | ".join(getattr(r, op).label() for r in recs)
                    + " |")
    rows += ["", "| `Recipe.preset(name, ...)` keyword | what it does |", "|---|---|"]
    rows += [f"| `{k}` | {v} |" for k, v in SWITCH_DOCS.items()]
    return "\n".join(rows) + "\n"


SWITCH_DOCS = {
    "disable_rht": "no random Hadamard transform anywhere",
    "disable_stochastic_rounding": "every operand rounds to nearest",
    "disable_2d_quantization": "1x16 weight blocks instead of 16x16",
    "sr_activations / sr_weights / sr_backward": "stochastic rounding on x / W / every backward operand",
    "rht_fprop / rht_dgrad": "the RHT on the Fprop / Dgrad GEMM as well",
    "rht_size=d": "the Hadamard size (2..128)",
    "rht_signs=": "`te`, `fixed` (from the seed), `per_layer` (from the seed and the layer index), "
                  "`per_transform` (new every call) or `none`",
    "weights_1d_reuse": "1x16 weights quantized once along K and reused in Dgrad (simulation only)",
    "four_over_six=": "TE's 4over6 block scales (`mae` / `mse`) on the round-to-nearest NVFP4 operands",
    "rbits_mapping=": "the SR rule of every stochastically rounded operand: `te` (truncated remainder + random "
                      "byte) or `midpoint` (delta + (2r + 1) / 512 >= 1)",
    "per_token": "one FP32 outer scale per row (token) of every NVFP4 1x16 operand, per column for the Wgrad "
                 "operands (TE's NVFP4PerTokenBlockScaling); 16x16 weights keep theirs per tensor",
    "scale_format=": "`e4m3` (NVFP4) or `ue5m3`: every NVFP4 operand with unsigned E5M3 block scales (Hu, Luschi, "
                     "Balanca 2026)",
    "per_tensor_scale=False": "UE5M3 block scales without the FP32 tensor scale",
    "delayed_amax=D": "every per-tensor scale from an amax measured every D calls and held in between",
    "amax_history=N": "every per-tensor scale from the largest amax of the previous N calls (TE's delayed "
                      "scaling)",
    "backward_override=": "TE's switch: `None`; `high_precision` (Dgrad / Wgrad on the original x, W, dy in the "
                          "high-precision format); `dequantized` (on the forward's quantized x, W dequantized)",
    "keep / keep_first / keep_last": "layers (name globs, first / last N blocks) kept in high precision",
    "high_precision=": "the kept layers' format: `bf16` or None (float32)",
    "accumulate=": "the GEMMs' accumulation model (`exact`, `fast`, `k64_rtz`, ...)",
    "seed=": "the Philox key of stochastic rounding and of the RHT signs",
}


_SWITCHES = {"disable_rht", "disable_stochastic_rounding", "disable_2d_quantization", "sr_activations",
             "sr_weights", "sr_backward", "rht_fprop", "rht_dgrad", "rht_size", "rht_signs", "weights_1d_reuse",
             "four_over_six", "delayed_amax", "amax_history", "rbits_mapping", "per_token", "scale_format",
             "per_tensor_scale"}


def _uniform(op: Operand, name: str) -> Recipe:
    return Recipe(**{o: op for o in OPERANDS}, name=name)


def _paper(scheme, d, signs, wblock, ablock) -> Recipe:
    act = Operand(scheme, ablock)
    w = Operand(scheme, wblock)
    g = Operand(scheme, ablock, rounding="sr")
    return Recipe(fprop_x=act, fprop_w=w, dgrad_dy=g, dgrad_w=w,
                  wgrad_x=dataclasses.replace(act, rht=d, rht_signs=signs),
                  wgrad_dy=dataclasses.replace(g, rht=d, rht_signs=signs), name=f"{scheme}_paper")


PRESETS = {
    "none": lambda: Recipe(name="none", identity=True),
    "bf16": lambda: _uniform(Operand("bf16"), "bf16"),
    "nvfp4_paper": lambda: _paper("nvfp4", 16, "te", (16, 16), (1, 16)),
    "mxfp4_paper": lambda: _paper("mxfp4", 32, "fixed", None, None),
    "mxfp8": lambda: _uniform(Operand("mxfp8_e4m3"), "mxfp8"),
    "mxfp6": lambda: _uniform(Operand("mxfp6_e3m2"), "mxfp6"),
    "fp8_blockwise": lambda: Recipe(fprop_x=Operand("fp8_blockwise", (1, 128)),
                                    fprop_w=Operand("fp8_blockwise", (128, 128)),
                                    dgrad_dy=Operand("fp8_blockwise", (1, 128)),
                                    dgrad_w=Operand("fp8_blockwise", (128, 128)),
                                    wgrad_x=Operand("fp8_blockwise", (1, 128)),
                                    wgrad_dy=Operand("fp8_blockwise", (1, 128)), name="fp8_blockwise"),
}
