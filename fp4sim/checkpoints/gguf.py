"""FP4 tensors of llama.cpp's GGUF files — ggml's block types MXFP4 (type 39) and NVFP4 (type 40) — read through
gguf-py's reader into fp4sim's conventions.

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

The quantizers that write these bytes (ggml's MXFP4 and NVFP4 rules) are in :mod:`fp4sim.checkpoints.rules`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["read_gguf", "GGUFFile", "GGUFTensor", "block_layout", "other_fp4_bytes", "to_ggml_order",
           "from_ggml_order", "to_gguf_blocks", "FP4_TYPES"]

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

    tensor_scale = None                     # ggml's FP4 types store no tensor scale

    @property
    def layout(self):
        """The :class:`~fp4sim.checkpoints.records.Layout` of an FP4 tensor's type (ValueError for another type)."""
        from .records import LAYOUTS
        if not self.fp4:
            raise ValueError(f"{self.name}: a {self.type} tensor, not one of ggml's FP4 types (MXFP4, NVFP4)")
        return LAYOUTS[f"gguf {self.type}"]

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
        from ..layout import pack_fp4
        b, ns, rows, K = self._blocks()
        q = np.ascontiguousarray(b[:, :, ns:]).reshape(rows, -1)
        return pack_fp4(from_ggml_order(q, _SUB[self.type]))

    def rows(self, r0: int, r1: int) -> np.ndarray:
        """float32 (r1 - r0, K): rows ``r0`` to ``r1`` of :meth:`values`, converting only their bytes (the file is
        memory-mapped: a tensor of any size in pieces)."""
        from ..layout import pack_fp4
        b, ns, rows, K = self._blocks()
        part = b[r0:r1]
        s = np.ascontiguousarray(part[:, :, :ns]).reshape(part.shape[0], -1)
        q = np.ascontiguousarray(part[:, :, ns:]).reshape(part.shape[0], -1)
        return self.decode(pack_fp4(from_ggml_order(q, _SUB[self.type])), s)

    def quantized(self):
        """The tensor as an fp4sim :class:`~fp4sim.QuantizedTensor` (rows, K) along K, for ``fs.dequantize``,
        ``fs.gemm`` and the validators: MXFP4 as fp4sim's ``mxfp4``; NVFP4 as ``nvfp4`` without a tensor scale
        (the ``torchao`` flavour's ``per_tensor_scale=False``: E2M1 x E4M3(s), ggml's 0.5 factor folded into the
        scale byte's meaning). An NVFP4 scale byte's sign bit is dropped, as ggml reads the byte (ggml's UE4M3 is
        unsigned; :attr:`scales` keeps the stored bytes, and ``validate checkpoint`` names a set sign bit as a
        fault), so ``fs.dequantize`` of this tensor equals :meth:`values` except where the two readings differ: a
        scale byte 0x7F (or 0xFF) is E4M3's NaN for fp4sim and zero for ggml (its quantizer never writes it), and
        code 8 decodes to -0 in fp4sim, +0 in ggml."""
        from ..qtensor import QuantizedTensor
        from ..schemes import get_scheme
        b, ns, rows, K = self._blocks()
        sch = (get_scheme("mxfp4") if self.type == "MXFP4" else
               get_scheme("nvfp4", flavor="torchao", per_tensor_scale=False))
        s = self.scales if self.type == "MXFP4" else self.scales & np.uint8(0x7F)
        return QuantizedTensor(codes=self.codes, scales=s, global_amax=None, scheme=sch, axis=1, shape=(rows, K))

    def values(self) -> np.ndarray:
        """The stored values as ggml reads them, float32 (rows, K): E2M1 x 2^(e - 127) (MXFP4; E8M0 255 is NaN,
        as OCP defines it) or E2M1 x E4M3(s) (NVFP4; byte 0x7F reads as zero and the scale's sign bit is not
        read); code 8 (E2M1's -0) reads as +0, as ggml's integer table has it."""
        return self.decode(self.codes, self.scales)

    def decode(self, codes, s) -> np.ndarray:
        """float32 (rows, K) of ``codes`` and scales ``s``: rows of :attr:`codes` and :attr:`scales` (a piece of the
        tensor) as :meth:`values` reads them."""
        from ..formats import E2M1, E4M3
        from ..layout import unpack_fp4
        c = unpack_fp4(codes)
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


def to_gguf_blocks(codes, scales, kind: str) -> np.ndarray:
    """The GGUF rows (uint8 (rows, K / block x bytes per block)) of codes in fp4sim's packing and their scale
    bytes: ``kind`` "MXFP4" (17-byte blocks of 32) or "NVFP4" (36-byte blocks of 64: four scale bytes, then the
    four sub-blocks' codes)."""
    from ..layout import unpack_fp4
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
