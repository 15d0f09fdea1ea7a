"""Arrays between torch and the emulator: float32 NumPy (CPU) or CuPy (CUDA) views of a tensor, and tensors of the
emulator's results, with no host round trip on a device."""
from __future__ import annotations

import numpy as np
import torch


def _to_array(t: torch.Tensor):
    """A float32 NumPy (CPU) or CuPy (CUDA) view of ``t`` (a copy where it is not float32 and contiguous). On the
    CPU the view goes through DLPack, not ``Tensor.numpy()``, which would mark the storage as not resizable: FSDP2
    frees a gathered weight after the forward by resizing its storage to zero."""
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.float()
    t = t.contiguous()
    if t.is_cuda:
        import cupy
        return cupy.from_dlpack(t)
    return np.from_dlpack(t)


def _to_tensor(a, like: torch.Tensor, dtype):
    t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else torch.from_dlpack(a)
    return t.to(device=like.device, dtype=dtype)
