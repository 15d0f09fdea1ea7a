"""QuantizedTensor: the stored form of a block-scaled tensor, as a kernel would write it."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._xp import xp_of
from .layout import unswizzle_scales

__all__ = ["QuantizedTensor"]


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """Codes, scales and metadata of one quantized tensor.

    Attributes
    ----------
    codes : uint8. FP4 schemes: packed two per byte (element 2i in the low nibble), shape
        ``(*lead, Kp // 2)``; FP8 schemes: one per byte ``(*lead, Kp)`` (unpadded ``K`` for per-tensor and
        blockwise FP8); BF16: uint16 bf16 codes with the original layout ``(*lead, K)``. ``lead`` is the input
        shape without ``axis``, in order; ``K`` the length of ``axis``, ``Kp`` it padded to the block.
    scales : scale bytes (uint8: E4M3 for NVFP4, UE8M0 for MX) shaped ``(*lead, Kp // block)`` in the
        ``"linear"`` layout — for 16x16 NVFP4 ``(ceil(R/16), Kp // 16)`` with ``R = prod(lead)`` — or the
        1-D ``"swizzled"`` 128x4 layout; float32 decode scales for FP8 blockwise; for FP8 per-tensor one
        float32 ``fl(1/scale)``; None for BF16.
    global_amax : float32 tensor amax used for NVFP4's second-level scale (a float32 vector, one per row, for
        row-scaled NVFP4; None for other schemes and for NVFP4 without a tensor scale). On the GPU, a tensor amax
        the quantize reduced itself is a 0-d CuPy float32 array, left on the device (``float()`` reads it).
    scheme : the scheme object; axis : the quantized axis of the original input; shape : original shape.
    scale_layout : ``"linear"`` or ``"swizzled"``.
    extras : intermediates for analysis (``block_amax`` etc.) when asked for with ``return_intermediates``.
    """
    codes: np.ndarray
    scales: np.ndarray | None
    global_amax: np.float32 | None
    scheme: object
    axis: int
    shape: tuple
    scale_layout: str = "linear"
    extras: dict = field(default_factory=dict)

    @property
    def lead(self) -> tuple:
        return tuple(s for i, s in enumerate(self.shape) if i != self.axis)

    @property
    def K(self) -> int:
        return self.shape[self.axis]

    @property
    def scale_rows_cols(self) -> tuple[int, int]:
        """(rows, columns) of the logical scale matrix."""
        R = int(np.prod(self.lead, dtype=np.int64))
        bk = self.scheme.block[1]
        C = -(-self.K // bk)
        if self.scheme.block[0] > 1:
            R = -(-R // self.scheme.block[0])
        return R, C

    def linear_scales(self) -> np.ndarray:
        """The scales as a 2-D (rows, blocks) matrix in the linear layout, whatever ``scale_layout`` is."""
        R, C = self.scale_rows_cols
        if self.scale_layout == "swizzled":
            if self.scheme.block[0] > 1:
                rows = int(np.prod(self.lead, dtype=np.int64))
                per_row = unswizzle_scales(self.scales, rows, C)
                return per_row[:: self.scheme.block[0]].copy()
            return unswizzle_scales(self.scales, R, C)
        return self.scales.reshape(R, C)

    def scales_per_row(self) -> np.ndarray:
        """Scales expanded to one row per tensor row, (prod(lead), blocks): for 16x16 tiles each tile's byte
        repeats for its 16 rows, the layout tensor cores consume."""
        s = self.linear_scales()
        if self.scheme.block[0] > 1:
            rows = int(np.prod(self.lead, dtype=np.int64))
            s = xp_of(s).repeat(s, self.scheme.block[0], axis=0)[:rows]
        return s

    def __repr__(self) -> str:
        g = self.global_amax
        ga = "" if g is None else (f", global_amax={float(g)!r}" if np.ndim(g) == 0 else
                                   f", global_amax=<one per row, {np.size(g)}>")
        return (f"QuantizedTensor({self.scheme.name}, shape={self.shape}, axis={self.axis}, "
                f"codes={self.codes.shape}, scales={None if self.scales is None else self.scales.shape}, "
                f"scale_layout={self.scale_layout!r}{ga})")
