"""Where GPU quantize time goes: the whole call vs its kernels alone (CUDA events), 8192x8192 float32.

    python benchmarks/gpu_profile.py
"""
from __future__ import annotations

import numpy as np


def main():
    import cupy as cp

    import fp4sim as fs
    from fp4sim import ids
    from fp4sim.gpu import ops
    from fp4sim.gpu.backend import default_backend
    k = ops.kernels(default_backend())
    x = cp.random.default_rng(0).standard_normal((8192, 8192), dtype=cp.float32)
    x16 = x.astype(cp.float16)

    def t(fn, n=20):
        fn()
        cp.cuda.Device().synchronize()
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b) / n

    acc = k.absmax_device(x)
    cst = k.nvfp4_tensor_constants(acc, "te")
    rb = cp.zeros((1, 1), np.uint8)
    rows = {
        "copy (read+write 256 MiB)": t(lambda: cp.copyto(cp.empty_like(x), x)),
        "absmax kernel (device result)": t(lambda: k.absmax_device(x)),
        "tensor constants kernel": t(lambda: k.nvfp4_tensor_constants(acc, "te")),
        "nvfp4 kernel (1x16)": t(lambda: k.nvfp4(x, rb, 0, ids.RNE, 8, ids.TE, 1, None, None, None, False, cst=cst)),
        "nvfp4 kernel (1x16, f16 input)": t(lambda: k.nvfp4(x16, rb, 0, ids.RNE, 8, ids.TE, 1, None, None, None,
                                                            False, cst=cst)),
        "fs.quantize nvfp4 (whole call)": t(lambda: fs.quantize(x, "nvfp4")),
        "absmax (kernel + host read)": t(lambda: k.absmax(x)),
    }
    for name, v in rows.items():
        print(f"{name:36} {v * 1e3:9.1f} us")


if __name__ == "__main__":
    main()
