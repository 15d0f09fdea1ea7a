"""GPU backend: CUDA kernels (``kernels.cu``) compiled by CuPy's NVRTC, giving the Numba backend's bits.

Importing fp4sim never imports CuPy; passing CuPy arrays to ``fp4sim.encode``, ``decode``, ``quantize``,
``dequantize``, ``fake_quantize`` or ``rht`` runs here and returns CuPy arrays. Install with
``pip install ".[gpu]"`` from the repository root.
"""
from __future__ import annotations


def available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - any failure means no usable GPU
        return False


def flush_warnings() -> None:
    """Emit the warnings about GPU inputs (NaN, Inf, a tensor amax beyond FLT_MAX/448) that are still queued.

    A GPU quantize never waits for the device: it leaves the tensor amax and the NaN / Inf flags there, and their
    warnings are emitted by a later call once the values have reached the host, by this function, or at exit."""
    from .ops import flush_warnings as flush
    flush()
