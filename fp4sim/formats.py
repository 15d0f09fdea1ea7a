"""Element formats: what each code means.

A format is a frozen dataclass; every property (max, min normal, value table, ...) is derived from the few
defining fields, so the documentation's tables, the encoders and the tests all read the same numbers.

Formats
-------
* ``E2M1``  -- FP4, s1 e2 m1, bias 1. No Inf, no NaN; always saturates.
* ``E4M3``  -- OCP E4M3FN, s1 e4 m3, bias 7. No Inf; NaN = S.1111.111.
* ``E5M2``  -- s1 e5 m2, bias 15. IEEE-like: Inf = S.11111.00, NaN = S.11111.{01,10,11}.
* ``UE8M0`` -- unsigned power-of-two scale, code e means 2^(e-127); 0xFF is NaN; no zero.
* ``BF16``  -- bfloat16, s1 e8 m7, bias 127, IEEE specials (16-bit codes).
* ``E2M3``, ``E3M2`` -- OCP FP6 (MXFP6's elements), bias 1 and 3; no Inf, no NaN; always saturate.
* ``E3M4``  -- s1 e3 m4, bias 3, IEEE specials (ml_dtypes' float8_e3m4).
* ``E4M3FNUZ``, ``E5M2FNUZ``, ``E4M3B11FNUZ`` -- the "FNUZ" FP8 formats of AMD's CDNA3 (bias 8 and 16) and of
  Graphcore / XLA (bias 11): no Inf, no negative zero; the negative-zero code 0x80 is the only NaN.
* ``INT8``  -- OCP MXINT8's element: two's complement, value = int8 / 64 (-2 .. 1 63/64); no Inf, no NaN.
* ``BINARY8P2`` .. ``BINARY8P7`` -- IEEE P3109's 8-bit interim formats binary8pP (signed, extended): P - 1
  mantissa bits, bias 2^(7 - P); 0x80 is the only NaN (no -0), 0x7F / 0xFF are +-Inf.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["Format", "E2M1", "E4M3", "E5M2", "UE8M0", "UE5M3", "BF16", "E2M3", "E3M2", "E3M4", "E4M3FNUZ",
           "E5M2FNUZ", "E4M3B11FNUZ", "INT8", "BINARY8P3", "BINARY8P4", "FORMATS", "get_format", "spec_markdown"]


@dataclass(frozen=True)
class Format:
    """A binary floating-point element format.

    Parameters
    ----------
    name : str
        Canonical lower-case name (``"e2m1"``, ``"e4m3"``, ...).
    ebits, mbits : int
        Exponent and mantissa field widths.
    bias : int
        Exponent bias.
    signed : bool
        Whether the format has a sign bit (UE8M0 has none).
    ieee_specials : bool
        True when the all-ones exponent field holds Inf (mantissa 0) and NaN (otherwise), as in IEEE-754.
    nan_all_ones : bool
        True when only the all-ones code (per sign) is NaN and the rest of the top binade is finite (E4M3FN).
    subnormals : bool
        Whether exponent field 0 encodes subnormals (False for UE8M0, where code 0 is 2^-127).
    nan_neg_zero : bool
        True when the negative-zero code (the sign bit alone) is the format's only NaN, so the format has no
        -0 (the FNUZ FP8 formats, IEEE P3109): a result that rounds to zero is +0 whatever its sign.
    inf_all_ones : bool
        True when the all-ones magnitude is +-Inf and every other magnitude is finite (IEEE P3109's extended
        formats).
    twos_complement : bool
        True when a negative value is stored as the two's complement of its magnitude code (OCP's INT8, whose
        magnitudes are those of an s1 e1 m6 format with bias 1: integer / 64); it has no -0.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    signed: bool = True
    ieee_specials: bool = False
    nan_all_ones: bool = False
    subnormals: bool = True
    nan_neg_zero: bool = False
    inf_all_ones: bool = False
    twos_complement: bool = False

    # ---- identity: the registered formats stay the same objects through copy, deepcopy and pickle --------
    def _canonical(self):
        reg = FORMATS.get(self.name)
        return reg if reg == self else None

    def __reduce__(self):
        if self._canonical() is not None:
            return (get_format, (self.name,))
        return super().__reduce__()

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        """Total width of one code in bits."""
        return int(self.signed) + self.ebits + self.mbits

    @property
    def n_codes(self) -> int:
        """Number of distinct codes (2**bits)."""
        return 1 << self.bits

    @property
    def code_dtype(self) -> np.dtype:
        """NumPy dtype that holds one unpacked code (uint8, or uint16 for BF16)."""
        return np.dtype(np.uint8) if self.bits <= 8 else np.dtype(np.uint16)

    @property
    def sign_mask(self) -> int:
        return (1 << (self.bits - 1)) if self.signed else 0

    # ---- special codes -----------------------------------------------------------------------------------
    @property
    def has_inf(self) -> bool:
        return self.ieee_specials or self.inf_all_ones

    @property
    def has_nan(self) -> bool:
        return self.ieee_specials or self.nan_all_ones or self.nan_neg_zero or not self.signed

    @property
    def has_neg_zero(self) -> bool:
        """Whether -0 has a code of its own (the sign bit alone)."""
        return self.signed and not (self.nan_neg_zero or self.twos_complement)

    @property
    def always_saturates(self) -> bool:
        """True for a format with neither Inf nor NaN (E2M1, FP6, INT8): overflow can only give +-max."""
        return not (self.has_inf or self.has_nan)

    @property
    def max_code(self) -> int:
        """Code (positive) of the largest finite value."""
        top = (1 << (self.ebits + self.mbits)) - 1  # all ones below the sign
        if self.ieee_specials:
            return top - (1 << self.mbits)          # exponent field all-ones is reserved
        if self.nan_all_ones or self.inf_all_ones or not self.signed:
            return top - 1                          # only the all-ones code is NaN (Inf)
        return top

    @property
    def nan_code(self) -> int | None:
        """Canonical NaN code produced by encoders (positive sign), or None when the format has no NaN."""
        if not self.signed:
            return self.n_codes - 1
        if self.nan_neg_zero:
            return self.sign_mask
        if self.nan_all_ones or self.ieee_specials:
            return (1 << (self.ebits + self.mbits)) - 1
        return None

    @property
    def inf_code(self) -> int | None:
        """Code of +Inf, or None."""
        if self.ieee_specials:
            return ((1 << self.ebits) - 1) << self.mbits
        if self.inf_all_ones:
            return (1 << (self.ebits + self.mbits)) - 1
        return None

    def signed_code(self, mag: int, negative: bool) -> int:
        """The code of magnitude code ``mag`` with a sign: the sign bit set (none on a zero where the format
        has no -0), or the two's complement."""
        if not (negative and self.signed):
            return mag
        if self.twos_complement:
            return (-mag) % self.n_codes
        if mag == 0 and not self.has_neg_zero:
            return 0
        return mag | self.sign_mask

    # ---- derived values ----------------------------------------------------------------------------------
    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal value."""
        return (1 - self.bias) if self.subnormals else -self.bias

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite value."""
        return (self.max_code >> self.mbits) - self.bias

    @property
    def max(self) -> float:
        """Largest finite value."""
        return float(self.value_of(self.max_code))

    @property
    def min_normal(self) -> float:
        return float(2.0 ** self.emin)

    @property
    def min_subnormal(self) -> float | None:
        """Smallest positive value (None when the format has no subnormals)."""
        return float(2.0 ** (self.emin - self.mbits)) if self.subnormals else None

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next larger value."""
        return float(2.0 ** -self.mbits) if self.mbits else 1.0

    def value_of(self, code: int) -> float:
        """Exact value of one code as a Python float (NaN for NaN codes, +-inf for Inf codes)."""
        code = int(code)
        if not 0 <= code < self.n_codes:
            raise ValueError(f"code {code} is outside 0..{self.n_codes - 1} for {self.name}")
        sign = -1.0 if (self.signed and code & self.sign_mask) else 1.0
        if self.nan_neg_zero and code == self.sign_mask:
            return float("nan")
        if self.twos_complement:
            mag = (-code) % self.n_codes if sign < 0 else code    # 0x80 -> 128: -2 in INT8
        else:
            mag = code & (self.sign_mask - 1) if self.signed else code
        if self.nan_code is not None and mag == self.nan_code and not self.nan_neg_zero:
            return float("nan")
        if self.inf_all_ones and mag == self.inf_code:
            return sign * float("inf")
        e = mag >> self.mbits
        m = mag & ((1 << self.mbits) - 1)
        if self.ieee_specials and e == (1 << self.ebits) - 1:
            return sign * float("inf") if m == 0 else float("nan")
        if self.subnormals and e == 0:
            return sign * m * 2.0 ** (self.emin - self.mbits)
        return sign * (1.0 + m / (1 << self.mbits)) * 2.0 ** (e - self.bias)

    @cached_property
    def values(self) -> np.ndarray:
        """float32 value of every code, indexed by code (length ``n_codes``)."""
        with np.errstate(over="ignore"):
            return np.array([self.value_of(c) for c in range(self.n_codes)], dtype=np.float32)

    @property
    def finite_values(self) -> np.ndarray:
        """Sorted distinct finite non-negative values (float64)."""
        v = self.values.astype(np.float64)
        return np.unique(np.abs(v[np.isfinite(v)]))

    def __repr__(self) -> str:  # short, since formats appear in many reprs
        return f"fp4sim.{self.name.upper()}"


E2M1 = Format("e2m1", ebits=2, mbits=1, bias=1)
E4M3 = Format("e4m3", ebits=4, mbits=3, bias=7, nan_all_ones=True)
E5M2 = Format("e5m2", ebits=5, mbits=2, bias=15, ieee_specials=True)
UE8M0 = Format("ue8m0", ebits=8, mbits=0, bias=127, signed=False, subnormals=False)
# unsigned E5M3 block scales (Hu, Luschi, Balanca 2026): IEEE-style, the all-ones exponent field holds Inf (0xF8)
# and NaN (0xF9-0xFF), so the largest finite value is 61,440; subnormals down to 2^-17; a sign is ignored
UE5M3 = Format("ue5m3", ebits=5, mbits=3, bias=15, signed=False, ieee_specials=True)
BF16 = Format("bf16", ebits=8, mbits=7, bias=127, ieee_specials=True)
# OCP Microscaling v1.0's FP6 elements (no Inf, no NaN) and INT8 element (two's complement, an implicit 2^-6)
E2M3 = Format("e2m3", ebits=2, mbits=3, bias=1)
E3M2 = Format("e3m2", ebits=3, mbits=2, bias=3)
INT8 = Format("int8", ebits=1, mbits=6, bias=1, twos_complement=True)
# IEEE-style E3M4 (ml_dtypes' float8_e3m4) and the FNUZ FP8 formats (AMD CDNA3, Graphcore; ml_dtypes' *fnuz)
E3M4 = Format("e3m4", ebits=3, mbits=4, bias=3, ieee_specials=True)
E4M3FNUZ = Format("e4m3fnuz", ebits=4, mbits=3, bias=8, nan_neg_zero=True)
E5M2FNUZ = Format("e5m2fnuz", ebits=5, mbits=2, bias=16, nan_neg_zero=True)
E4M3B11FNUZ = Format("e4m3b11fnuz", ebits=4, mbits=3, bias=11, nan_neg_zero=True)


def _p3109(p: int) -> Format:
    """IEEE P3109's interim binary8pP, signed and extended (gfloat's ``format_info_p3109(8, p)``): P - 1
    mantissa bits, bias 2^(7 - P), 0x80 the only NaN, 0x7F / 0xFF the infinities."""
    return Format(f"binary8p{p}", ebits=8 - p, mbits=p - 1, bias=2 ** (7 - p), nan_neg_zero=True, inf_all_ones=True)


P3109 = tuple(_p3109(p) for p in range(2, 8))
BINARY8P3, BINARY8P4 = P3109[1], P3109[2]

FORMATS: dict[str, Format] = {f.name: f for f in (E2M1, E4M3, E5M2, UE8M0, UE5M3, BF16, E2M3, E3M2, E3M4, E4M3FNUZ,
                                                  E5M2FNUZ, E4M3B11FNUZ, INT8) + P3109}
_ALIASES = {"fp4": "e2m1", "float4_e2m1": "e2m1", "e4m3fn": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2",
            "e8m0": "ue8m0", "bfloat16": "bf16", "float6_e2m3": "e2m3", "float6_e2m3fn": "e2m3",
            "float6_e3m2": "e3m2", "float6_e3m2fn": "e3m2", "fp6_e2m3": "e2m3", "fp6_e3m2": "e3m2",
            "float8_e3m4": "e3m4", "float8_e4m3fnuz": "e4m3fnuz", "fp8_e4m3fnuz": "e4m3fnuz",
            "float8_e5m2fnuz": "e5m2fnuz", "fp8_e5m2fnuz": "e5m2fnuz", "float8_e4m3b11fnuz": "e4m3b11fnuz",
            "ocp_int8": "int8", **{f"p3109_k8p{p}se": f"binary8p{p}" for p in range(2, 8)}}


USED_BY = {
    "e2m1": "NVFP4, MXFP4 elements",
    "e4m3": "OCP FP8; NVFP4 block scales; MXFP8, FP8 training",
    "e5m2": "OCP FP8 (gradients)",
    "ue8m0": "MX block scales",
    "ue5m3": "block scales (Hu, Luschi, Balanca)",
    "bf16": "high-precision operands",
    "e2m3": "OCP MXFP6 elements; Blackwell f8f6f4 MMA",
    "e3m2": "OCP MXFP6 elements; Blackwell f8f6f4 MMA",
    "e3m4": "ml_dtypes float8_e3m4",
    "e4m3fnuz": "AMD CDNA3 (MI300) FP8",
    "e5m2fnuz": "AMD CDNA3 (MI300) FP8",
    "e4m3b11fnuz": "Graphcore IPU, XLA",
    "int8": "OCP MXINT8 elements",
    **{f"binary8p{p}": "IEEE P3109 interim (gfloat)" for p in range(2, 8)},
}


def get_format(fmt: "Format | str") -> Format:
    """Return the Format for a Format object or a name such as ``"e2m1"`` (case-insensitive)."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str):
        key = fmt.lower()
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
        raise ValueError(f"fmt={fmt!r} is not a known format; use one of {sorted(FORMATS)} or a Format object")
    raise TypeError(f"fmt must be a fp4sim Format or its name, not {type(fmt).__name__}")


def spec_markdown() -> str:
    """Markdown tables describing every format, generated from the Format objects (used by docs/formats.md)."""
    def num(v):
        if v is None:
            return "—"
        v = float(v)
        e = math.log2(v) if v > 0 else None
        if e is not None and e == int(e) and abs(e) >= 4:
            return f"2^{int(e)}"
        return f"{v:g}"

    rows = ["| format | bits | layout | bias | max finite | min normal | min subnormal | eps | Inf | NaN codes | "
            "encode(NaN) | overflow: saturate / not | used by |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in FORMATS.values():
        layout = ("s1 " if f.signed else "") + f"e{f.ebits} m{f.mbits}"
        if f.twos_complement:
            layout = f"two's complement int{f.bits} / 2^{f.mbits}"
        inf = "none" if not f.has_inf else (f"{f.inf_code:#x} / {f.inf_code | f.sign_mask:#x}" if f.signed
                                            else f"{f.inf_code:#x}")
        if f.nan_code is None:
            nan = "none"
        elif f.nan_neg_zero:
            nan = f"{f.nan_code:#x} only (no −0)"
        elif f.ieee_specials:
            nan = (f"{f.inf_code + 1:#x}–{f.nan_code:#x}" + (" (and negatives)" if f.signed else "")
                   + f"; canonical {f.nan_code:#x}")
        elif f.signed:
            nan = f"{f.nan_code:#x}, {f.nan_code | f.sign_mask:#x}"
        else:
            nan = f"{f.nan_code:#x}"
        enc_nan = f.nan_code if f.nan_code is not None else f.max_code
        nosat = f.inf_code if f.has_inf else (f.nan_code if f.nan_code is not None else f.max_code)
        if f.twos_complement:
            sign = f" (−max: {f.signed_code(f.max_code, True):#x})"
        elif f.nan_neg_zero and not f.has_inf:
            sign = " (the NaN, either sign)"
        else:
            sign = " (sign kept)" if f.signed else ""
        min_normal = "—" if f.twos_complement else num(f.min_normal)
        bias = "—" if f.twos_complement else f.bias
        rows.append(f"| {f.name.upper()} | {f.bits} | {layout} | {bias} | {num(f.max)} | {min_normal} | "
                    f"{num(f.min_subnormal)} | {num(f.eps)} | {inf} | {nan} | {enc_nan:#x} | "
                    f"{f.max_code:#x} / {nosat:#x}{sign} | {USED_BY.get(f.name, '')} |")
    return "\n".join(rows) + "\n"
