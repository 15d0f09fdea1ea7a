"""FP4 tensors of llama.cpp's GGUF files — ggml's block types MXFP4 (type 39) and NVFP4 (type 40) — read through
gguf-py's reader into fp4sim's conventions, and ggml's MXFP4 quantizer rule.

One GGUF row of a 2-D tensor (out, in) holds the row's blocks in order; per block:

=========  =================================================  =================================================
           MXFP4 (type 39)                                    NVFP4 (type 40)
=========  =================================================  =================================================
elements   32                                                 64, as four sub-blocks of 16 with a scale each
bytes      17: one E8M0 scale byte, then 16 bytes of codes    36: four UE4M3 scale bytes, then 4 x 8 code bytes
codes      byte j: element j (low nibble), element j + 16     sub-block s, byte j: element j (low nibble),
           (high) — ggml's Q4_0 habit                         element j + 8 (high)
value      E2M1 x 2^(e - 127) (ggml keeps E2M1 x 2 and the    E2M1 x E4M3(s): ggml keeps E2M1 x 2 and the
           scale halved, the same product)                    scale x 0.5; byte 0x7F reads as zero; there is
                                                              no tensor scale
=========  =================================================  =================================================

fp4sim packs element 2i of a row in the low nibble of byte i and 2i + 1 in the high one (gpt-oss's MXFP4
safetensors too), so the same 17 bytes of a GGUF MXFP4 block mean another tensor read in fp4sim's order:
:attr:`GGUFTensor.codes` returns them reordered, :func:`to_ggml_order` goes back.

ggml's MXFP4 quantizer (gguf-py's ``MXFP4.quantize_blocks``), as a rule: the shared exponent ``e = floor(log2
amax) - 2 + 127`` (0 for an all-zero block), the log2 evaluated in float32 — so an amax within a few float32 ulps
below a power of two from 8 on takes the exponent of that power (log2(7.9999995) rounds to 3.0) — the OCP rule
whose values above 6 · 2^(e - 127) clip to 6 — and each
element the E2M1 code whose value times the scale is nearest in float32 (``|2^(e-128) · 2k - x|``), the first in
code order on a tie: ties go to the smaller magnitude (not to even), and a negative value that rounds to zero is
+0 (code 0, not fp4sim's -0, code 8). fp4sim's ``mxfp4`` with ``scale_mode="floor"`` gives the same scale bytes
(:func:`ggml_mxfp4_quantize` says where the codes differ).

llama.cpp's NVFP4 quantizer (``quantize_row_nvfp4_ref`` in ggml's C source), as a rule: per 16-element
sub-block, the scale byte ``ggml_ue4m3(fl(amax / 6))`` (:func:`ggml_ue4m3`: its own UE4M3 rounding, not
round-to-nearest-even: the fourth mantissa bit rounds half up, a scale at or above 2^8 — after that rounding,
so from 248 on — becomes 448 (byte 0x7E), and below 2^-6 the subnormal ``trunc(s · 512 + 0.5)``, at most 7), no
tensor scale, and each element by the MXFP4 rule's nearest-candidate search over ``E2M1 x E4M3(byte)`` (ties
to the smaller magnitude, +0 for negatives that round to zero).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["read_gguf", "GGUFFile", "GGUFTensor", "block_layout", "ggml_mxfp4_quantize", "ggml_nvfp4_quantize", "ggml_ue4m3",
           "rule_costs", "te_nvfp4_blocks", "other_fp4_bytes", "to_ggml_order", "from_ggml_order", "to_gguf_blocks",
           "FP4_TYPES"]

FP4_TYPES = {39: "MXFP4", 40: "NVFP4"}
_BLOCK = {"MXFP4": (32, 17, 1), "NVFP4": (64, 36, 4)}          # elements, bytes, scale bytes per block
_SUB = {"MXFP4": 32, "NVFP4": 16}                             # elements per scale


def block_layout(kind: str) -> tuple:
    """(elements, bytes, scale bytes per block, elements per scale) of ggml's FP4 block type ``kind`` ("MXFP4":
    (32, 17, 1, 32); "NVFP4": (64, 36, 4, 16))."""
    if kind not in _BLOCK:
        raise ValueError(f"kind={kind!r}: ggml's FP4 block types are 'MXFP4' and 'NVFP4'")
    return _BLOCK[kind] + (_SUB[kind],)


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading GGUF files needs gguf-py: pip install 'fp4sim[inspect]' (or pip install gguf)") \
            from None
    return gguf


def from_ggml_order(q: np.ndarray, sub: int) -> np.ndarray:
    """Codes (rows, K) uint8, one per element, from ggml's packed sub-blocks of ``sub`` elements (``sub / 2``
    bytes each: byte j holds element j low and element j + sub/2 high): (rows, K / 2) -> (rows, K)."""
    R, nbytes = q.shape
    h = sub // 2
    g = q.reshape(R, nbytes // h, h)
    return np.concatenate([g & 0x0F, g >> 4], axis=-1).reshape(R, 2 * nbytes)


def to_ggml_order(codes: np.ndarray, sub: int) -> np.ndarray:
    """The inverse of :func:`from_ggml_order`: codes (rows, K) one per element -> ggml's bytes (rows, K / 2)."""
    R, K = codes.shape
    h = sub // 2
    g = np.asarray(codes, np.uint8).reshape(R, K // sub, sub)
    return (g[:, :, :h] | (g[:, :, h:] << 4)).reshape(R, K // 2).astype(np.uint8)


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: ``name``, ggml ``type`` name ("MXFP4", "NVFP4", "F32", "Q4_1", ...), ``shape``
    in NumPy order (rows, ..., K: ggml lists its dimensions innermost first), and, for the two FP4 types,
    ``codes`` (uint8 (rows, K / 2), fp4sim's packing: element 2i low), ``scales`` (uint8 (rows, K / 32) E8M0
    bytes for MXFP4; (rows, K / 16) UE4M3 bytes for NVFP4) and the dequantized ``values()`` (float32).

    Where its bytes lie: ``offset`` (from the file's start), ``n_bytes`` (what its type and shape need),
    ``region`` (the bytes from its offset to the next tensor's, or to the file's end for the last: ``n_bytes``
    plus the alignment padding in a well-formed file) and ``missing`` (bytes the file ends before its data does:
    a truncated file; reading the codes, scales or values of such a tensor is a ValueError)."""
    name: str
    type: str
    shape: tuple
    raw: np.ndarray = field(repr=False)
    offset: int = 0
    n_bytes: int = 0
    region: int = 0
    missing: int = 0
    file: Path | None = None

    def region_bytes(self) -> np.ndarray:
        """The bytes of the tensor's region (:attr:`region` of them, fewer where the file ends first)."""
        if self.file is None:
            return np.ascontiguousarray(self.raw, np.uint8).reshape(-1)
        with open(self.file, "rb") as f:
            f.seek(self.offset)
            return np.frombuffer(f.read(self.region), np.uint8)

    @property
    def fp4(self) -> bool:
        return self.type in _BLOCK

    @property
    def truncation(self) -> str | None:
        """Why the tensor's data cannot be read whole ("truncated: the file ends ..."), or None: a GGUF file cut
        short leaves the tensors whose data it ends before without their bytes (wholly, for a tensor that starts
        past the end)."""
        if not self.missing:
            return None
        there = self.n_bytes - self.missing
        return (f"truncated: the file ends {self.missing} bytes before its data does ("
                + (f"{there} of its {self.n_bytes} bytes are there)" if there > 0 else
                   f"none of its {self.n_bytes} bytes are there)"))

    def stored(self) -> np.ndarray:
        """The tensor's data as gguf-py reads it (any type: float types as their values, quantized types as
        their raw rows); ValueError naming the tensor where the file ends before its data does — never the
        zero-filled bytes of a truncated read."""
        why = self.truncation
        if why:
            raise ValueError(f"{self.name}: {why}")
        return np.asarray(self.raw)

    def _blocks(self):
        if not self.fp4:
            raise ValueError(f"{self.name}: a {self.type} tensor, not one of ggml's FP4 types (MXFP4, NVFP4)")
        raw = self.stored()
        n, nbytes, ns = _BLOCK[self.type]
        K = self.shape[-1]
        rows = int(np.prod(self.shape[:-1], dtype=np.int64))
        b = np.ascontiguousarray(raw, np.uint8).reshape(rows, K // n, nbytes)
        return b, ns, rows, K

    @property
    def scales(self) -> np.ndarray:
        b, ns, rows, K = self._blocks()
        return np.ascontiguousarray(b[:, :, :ns]).reshape(rows, -1)

    @property
    def codes(self) -> np.ndarray:
        """The E2M1 codes in fp4sim's packing (element 2i in the low nibble of byte i), (rows, K / 2)."""
        from .layout import pack_fp4
        b, ns, rows, K = self._blocks()
        q = np.ascontiguousarray(b[:, :, ns:]).reshape(rows, -1)
        return pack_fp4(from_ggml_order(q, _SUB[self.type]))

    def quantized(self):
        """The tensor as an fp4sim :class:`~fp4sim.QuantizedTensor` (rows, K) along K, for ``fs.dequantize``,
        ``fs.gemm`` and the validators: MXFP4 as fp4sim's ``mxfp4``; NVFP4 as ``nvfp4`` without a tensor scale
        (the ``torchao`` flavour's ``per_tensor_scale=False``: E2M1 x E4M3(s), ggml's 0.5 factor folded into the
        scale byte's meaning). An NVFP4 scale byte's sign bit is dropped, as ggml reads the byte (ggml's UE4M3 is
        unsigned; :attr:`scales` keeps the stored bytes, and ``validate checkpoint`` names a set sign bit as a
        fault), so ``fs.dequantize`` of this tensor equals :meth:`values` except where the two readings differ: a
        scale byte 0x7F (or 0xFF) is E4M3's NaN for fp4sim and zero for ggml (its quantizer never writes it), and
        code 8 decodes to -0 in fp4sim, +0 in ggml."""
        from .qtensor import QuantizedTensor
        from .schemes import get_scheme
        b, ns, rows, K = self._blocks()
        sch = (get_scheme("mxfp4") if self.type == "MXFP4" else
               get_scheme("nvfp4", flavor="torchao", per_tensor_scale=False))
        s = self.scales if self.type == "MXFP4" else self.scales & np.uint8(0x7F)
        return QuantizedTensor(codes=self.codes, scales=s, global_amax=None, scheme=sch, axis=1, shape=(rows, K))

    def values(self) -> np.ndarray:
        """The stored values as ggml reads them, float32 (rows, K): E2M1 x 2^(e - 127) (MXFP4; E8M0 255 is NaN,
        as OCP defines it) or E2M1 x E4M3(s) (NVFP4; byte 0x7F reads as zero and the scale's sign bit is not
        read); code 8 (E2M1's -0) reads as +0, as ggml's integer table has it."""
        from .formats import E2M1, E4M3
        from .layout import unpack_fp4
        c = unpack_fp4(self.codes)
        s = self.scales
        if self.type == "MXFP4":       # (byte 255 is NaN: 2^128 is never formed, so no overflow is warned of)
            f = np.where(s == 255, np.float32(np.nan), np.ldexp(np.float32(1), np.minimum(s, 254).astype(np.int32)
                                                                 - 127))
        else:
            s = s & 0x7F
            f = np.where(s == 0x7F, np.float32(0), E4M3.values[s])
        f = f.astype(np.float32)
        rows, K = c.shape
        sub = _SUB[self.type]
        e2m1 = np.where(np.arange(16) == 8, 0.0, E2M1.values).astype(np.float32)    # ggml reads code 8 as +0
        v = e2m1[c].reshape(rows, K // sub, sub) * f[:, :, None]
        return v.reshape(rows, K).astype(np.float32)


@dataclass
class GGUFFile:
    """A GGUF file's tensors by name (:class:`GGUFTensor`) and its key-value metadata (``fields``: name -> value
    where gguf-py decodes it to a scalar or string), and the ``alignment`` of its tensors' data (32 unless
    ``general.alignment`` says otherwise)."""
    path: Path
    tensors: dict
    fields: dict
    alignment: int = 32

    @property
    def fp4(self) -> dict:
        return {n: t for n, t in self.tensors.items() if t.fp4}


def _reader_class():
    """gguf-py's reader, recording the reads that the file ends before (a truncated file) instead of failing on
    them: such a read comes back padded with zeros and is listed in ``short`` as (offset, bytes missing)."""
    gguf = _gguf()

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            count = int(count)
            item = np.dtype(dtype).itemsize
            have = max(0, min(len(self.data) - int(offset), item * count))
            if have < item * count:
                self.__dict__.setdefault("short", []).append((int(offset), item * count - have))
                buf = np.zeros(item * count, np.uint8)
                buf[:have] = self.data[offset:offset + have]
                arr = buf.view(dtype)
                return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else
                                                       override_order))
            return super()._get(offset, dtype, count, override_order)
    return Reader


def other_fp4_bytes(kind: str, shape) -> tuple:
    """(the other FP4 type's name, the bytes it needs for ``shape``) — "NVFP4" for "MXFP4" and the reverse;
    (other, None) where the shape's last dimension is no multiple of its blocks."""
    other = "NVFP4" if kind == "MXFP4" else "MXFP4"
    n, nbytes, _ = _BLOCK[other]
    K = int(shape[-1])
    if K % n:
        return other, None
    return other, int(np.prod(shape[:-1], dtype=np.int64)) * (K // n) * nbytes


def read_gguf(path) -> GGUFFile:
    """Read a GGUF file's tensor headers and metadata (gguf-py's reader, memory-mapped: the bytes are read when a
    tensor's codes, scales or values are asked for). ValueError naming the file when it is no GGUF file or ends
    inside its header; a tensor whose data the file ends before is kept with its ``missing`` bytes counted."""
    _gguf()
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such file")
    try:
        r = _reader_class()(str(p))
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"{p}: not a readable GGUF file ({' '.join(str(e).split())[:200]})") from None
    short = dict(r.__dict__.get("short", []))
    starts = sorted({int(t.data_offset) for t in r.tensors})
    if short and (not starts or min(short) < starts[0]):
        raise ValueError(f"{p}: the file ends inside its header (truncated): no tensor can be read")
    size = len(r.data)
    tensors = {}
    for t in r.tensors:
        shape = tuple(int(v) for v in reversed([int(x) for x in t.shape]))
        off, need = int(t.data_offset), int(t.n_bytes)
        later = [o for o in starts if o > off]
        region = (later[0] if later else size) - off
        tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, t.data, offset=off, n_bytes=need,
                                     region=max(0, region), missing=int(short.get(off, 0)), file=p)
        if t.tensor_type.name in _BLOCK and shape[-1] % _BLOCK[t.tensor_type.name][0]:
            raise ValueError(f"{p}: {t.name} is {t.tensor_type.name} with a last dimension of {shape[-1]}, not a "
                             f"multiple of its {_BLOCK[t.tensor_type.name][0]}-element blocks")
    fields = {}
    for name, f in r.fields.items():
        try:
            v = f.contents()
        except (ValueError, IndexError, TypeError, AttributeError):
            continue
        if isinstance(v, (str, int, float, bool)):
            fields[name] = v
    return GGUFFile(p, tensors, fields, int(r.alignment))


def _rule_input(x, multiple: int, kind: str) -> np.ndarray:
    """``x`` as a float32 (rows, K) array, K a multiple of ``multiple``; ValueError naming ``x`` otherwise, or for
    NaN / Inf (ggml's rules have no code for them)."""
    a = np.asarray(x, np.float32)
    if a.ndim != 2 or a.shape[1] % multiple:
        raise ValueError(f"x: a 2-D array (rows, K) with K a multiple of {multiple} is needed, not shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"x holds NaN or Inf: ggml's {kind} rule has no code for them")
    return a


def ggml_mxfp4_quantize(x) -> tuple:
    """ggml's MXFP4 quantizer (the module docstring's rule, gguf-py's ``MXFP4.quantize_blocks`` byte for byte):
    ``(codes, scales)`` of a 2-D float32 ``x`` (rows, K), K a multiple of 32 — codes in fp4sim's packing
    (uint8 (rows, K / 2)), scales the E8M0 bytes (uint8 (rows, K / 32)). :func:`to_ggml_order` gives the bytes
    ggml writes. ValueError for NaN / Inf (the rule has no answer for them) or a block amax below 2^-125 (its
    exponent byte would leave E8M0's range)."""
    from .formats import E2M1
    from .layout import pack_fp4
    a = _rule_input(x, 32, "MXFP4")
    R, K = a.shape
    blk = a.reshape(R, K // 32, 32)
    amax = np.abs(blk).max(-1)
    if ((amax > 0) & (amax < np.float32(2.0 ** -125))).any():
        raise ValueError("x: a block amax below 2^-125 has no E8M0 exponent under ggml's rule "
                         "(floor(log2 amax) - 2 + 127 < 0)")
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax.astype(np.float32))) - 2 + 127, 0).astype(np.uint8)
    # the candidates' values in code order 0..15 (E2M1 x 2^(e-127), exact in float32) and |candidate - x|
    # rounded to float32, as the rule computes it; argmin takes the first of equal errors
    half = np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float32)
    doubled = np.round(E2M1.values.astype(np.float64) * 2).astype(np.float32)           # 0, 1, ..., 12, -0, ...
    cand = (half[:, :, None] * doubled[None, None, :]).astype(np.float32)
    err = np.abs(cand[:, :, None, :] - blk[:, :, :, None]).astype(np.float32)
    codes = np.argmin(err, axis=-1).astype(np.uint8).reshape(R, K)
    return pack_fp4(codes), e.astype(np.uint8)


def ggml_ue4m3(v) -> np.ndarray:
    """ggml's float32 -> UE4M3 scale byte (``ggml_fp32_to_ue4m3``) of non-negative float32 values: clamped to
    [0, 448]; a normal value keeps three mantissa bits and adds the fourth (half up, in magnitude), the carry
    moving into the exponent; an exponent field of 15 or more, before or after that carry, gives 448 (0x7E) — so
    scales in [248, 256) round up to 448, not to 256; below 2^-6 the subnormal byte is ``trunc(fl(v · 512) + 0.5)``
    clamped to 7 (so [7.5, 8) x 2^-9 stays at 7 x 2^-9 instead of becoming 2^-6); zero and negatives give 0."""
    a = np.clip(np.asarray(v, np.float32), np.float32(0), np.float32(448)).astype(np.float32)
    bits = a.view(np.uint32).astype(np.int64)
    e = ((bits >> 23) & 0xFF) - 127 + 7
    m = ((bits >> 20) & 7) + ((bits >> 19) & 1)
    carry = m > 7
    m = np.where(carry, 0, m)
    e2 = np.where(carry, e + 1, e)
    normal = np.where(e2 >= 15, 0x7E, (e2 << 3) | m)
    sub = np.clip((a * np.float32(512) + np.float32(0.5)).astype(np.float32).astype(np.int64), 0, 7)
    out = np.where(a <= 0, 0, np.where(e <= 0, sub, np.where(e >= 15, 0x7E, normal)))
    return out.astype(np.uint8)


def _nearest_codes(blk, d):
    """The MXFP4 rule's element search: per element of ``blk`` (..., n) the first code whose E2M1 value times
    ``d`` (..., broadcast) is nearest in float32."""
    from .formats import E2M1
    cand = (d[..., None, None] * E2M1.values.astype(np.float32)[None, :]).astype(np.float32)
    err = np.abs(cand - blk[..., None]).astype(np.float32)
    return np.argmin(err, axis=-1).astype(np.uint8)


def ggml_nvfp4_quantize(x) -> tuple:
    """llama.cpp's NVFP4 quantizer (the module docstring's rule): ``(codes, scales)`` of a 2-D float32 ``x``
    (rows, K), K a multiple of 16 (GGUF tensors: of 64) — codes in fp4sim's packing (uint8 (rows, K / 2)),
    scales the UE4M3 bytes (uint8 (rows, K / 16)); there is no tensor scale. :func:`to_gguf_blocks` gives the
    36-byte blocks ggml writes. ValueError for NaN or Inf."""
    from .formats import E4M3
    from .layout import pack_fp4
    a = _rule_input(x, 16, "NVFP4")
    R, K = a.shape
    blk = a.reshape(R, K // 16, 16)
    sb = ggml_ue4m3((np.abs(blk).max(-1) / np.float32(6)).astype(np.float32))
    d = np.where(sb == 0x7F, np.float32(0), E4M3.values[sb]).astype(np.float32)
    codes = _nearest_codes(blk, d).reshape(R, K)
    return pack_fp4(codes), sb


def to_gguf_blocks(codes, scales, kind: str) -> np.ndarray:
    """The GGUF rows (uint8 (rows, K / block x bytes per block)) of codes in fp4sim's packing and their scale
    bytes: ``kind`` "MXFP4" (17-byte blocks of 32) or "NVFP4" (36-byte blocks of 64: four scale bytes, then the
    four sub-blocks' codes)."""
    from .layout import unpack_fp4
    if kind not in _BLOCK:
        raise ValueError(f"kind={kind!r}: 'MXFP4' or 'NVFP4'")
    n, nbytes, ns = _BLOCK[kind]
    c = unpack_fp4(np.asarray(codes, np.uint8))
    R, K = c.shape
    if K % n:
        raise ValueError(f"codes: K = {K} is not a multiple of {kind}'s {n}-element blocks")
    q = to_ggml_order(c, _SUB[kind]).reshape(R, K // n, n // 2)
    s = np.asarray(scales, np.uint8).reshape(R, K // n, ns)
    return np.concatenate([s, q], axis=-1).reshape(R, -1)


COST_RULES = ("ggml MXFP4", "MXFP4 floor", "MXFP4 rceil", "NVFP4/32 (TE)", "ggml NVFP4", "NVFP4 (TE, tensor scale)")
BITS_PER_VALUE = {"ggml MXFP4": 4.25, "MXFP4 floor": 4.25, "MXFP4 rceil": 4.25, "NVFP4/32 (TE)": 4.25,
                  "ggml NVFP4": 4.5, "NVFP4 (TE, tensor scale)": 4.5}


def te_nvfp4_blocks(x, n: int = 16) -> tuple:
    """TransformerEngine's NVFP4 rule with one E4M3 scale per ``n`` elements of a row: ``(codes, scales)``, codes
    unpacked (uint8 (rows, K), one per element), scales the E4M3 bytes (rows, K / n). The FP32 tensor scale
    ``S_enc = 2688 / amax`` (1 for an all-zero tensor), each block's byte ``E4M3(amax_b · fl(S_enc / 6))``, the
    elements ``E2M1(x · fl(1 / fl(E4M3(s) · fl(1 / S_enc))))``, round-to-nearest-even throughout. ``n = 16`` is
    fp4sim's ``nvfp4`` (the codes and bytes of ``fs.quantize(x, "nvfp4")``); ``n = 32`` spends MXFP4's 4.25 bits
    per value on NVFP4's scale format. A value decodes as ``E2M1 · E4M3(s) · fl(1 / S_enc)``."""
    from .elements import encode
    from .formats import E4M3
    f32 = np.float32
    a = np.asarray(x, f32)
    if a.ndim != 2 or a.shape[1] % n or not np.isfinite(a).all():
        raise ValueError(f"x: a finite 2-D array (rows, K) with K a multiple of {n} is needed")
    R, K = a.shape
    amax = f32(np.abs(a).max()) if a.size else f32(0)
    s_enc = f32(1) if amax == 0 else f32(min(f32(2688.0) / amax, np.finfo(f32).max))
    s_dec = f32(f32(1) / s_enc)
    blk = a.reshape(R, K // n, n)
    sb = encode((np.abs(blk).max(-1) * f32(s_enc * (f32(1) / f32(6)))).astype(f32), "E4M3")
    with np.errstate(divide="ignore"):
        enc = np.minimum(f32(1) / (E4M3.values[sb].astype(f32) * s_dec).astype(f32), np.finfo(f32).max)
    codes = encode((blk * enc.astype(f32)[..., None]).astype(f32), "E2M1")
    return codes.reshape(R, K), sb, s_dec


def rule_costs(x) -> dict:
    """What each FP4 rule costs on a high-precision 2-D weight ``x`` (rows, K; K a multiple of 64): ``{"rel_mse":
    {rule: sum (y - x)^2 / sum x^2}, "clipped_blocks": share of 32-element blocks whose largest value exceeds
    6 x the scale ggml's MXFP4 rule chooses (those values clip to 6), "bits_per_value": {rule: bits}}`` for
    :data:`COST_RULES`: ggml's MXFP4 (floor exponent, ties to the smaller magnitude), fp4sim's MXFP4 with the
    floor and the round-up (rceil, TE's and cuBLAS's) scale modes, NVFP4's scales at MXFP4's 4.25 bits per value
    (TE's rule with one E4M3 scale per 32 elements, :func:`te_nvfp4_blocks`), ggml's NVFP4 (no tensor scale),
    and NVFP4 as TransformerEngine quantizes it (E4M3 scales per 16 under an FP32 tensor scale)."""
    from .formats import E2M1
    from .layout import unpack_fp4
    from .quantize import fake_quantize
    a = np.asarray(x, np.float32)
    if a.ndim != 2 or a.shape[1] % 64:
        raise ValueError(f"x: a 2-D weight (rows, K) with K a multiple of 64 is needed, not shape {a.shape}")
    R, K = a.shape
    a64 = a.astype(np.float64)
    ref = float((a64 * a64).sum())
    ys = {}
    c, e8 = ggml_mxfp4_quantize(a)
    f = np.repeat(np.ldexp(np.float64(1), e8.astype(np.int64) - 127), 32, axis=1)
    ys["ggml MXFP4"] = E2M1.values[unpack_fp4(c)].astype(np.float64) * f
    ys["MXFP4 floor"] = fake_quantize(a, "mxfp4", scale_mode="floor")
    ys["MXFP4 rceil"] = fake_quantize(a, "mxfp4", scale_mode="rceil")
    from .formats import E4M3
    c, s = ggml_nvfp4_quantize(a)
    ys["ggml NVFP4"] = E2M1.values[unpack_fp4(c)].astype(np.float64) * np.repeat(E4M3.values[s], 16, axis=1)
    ys["NVFP4 (TE, tensor scale)"] = fake_quantize(a, "nvfp4")
    c, s, s_dec = te_nvfp4_blocks(a, 32)
    ys["NVFP4/32 (TE)"] = (E2M1.values[c].astype(np.float64) * np.repeat(E4M3.values[s], 32, axis=1)
                           * np.float64(s_dec))
    rel = {k: float(((np.asarray(v, np.float64) - a64) ** 2).sum() / ref) if ref else 0.0 for k, v in ys.items()}
    blk = np.abs(a).reshape(R, K // 32, 32).max(-1).astype(np.float64)
    clipped = float((blk > 6 * np.ldexp(1.0, e8.astype(np.int64) - 127)).mean())
    return {"rel_mse": rel, "clipped_blocks": clipped, "bits_per_value": dict(BITS_PER_VALUE)}
