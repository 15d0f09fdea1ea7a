"""Where GPU quantize time goes: the whole call vs its kernels alone (CUDA events), 8192x8192 float32.

    python benchmarks/gpu_profile.py
"""
from __future__ import annotations

import numpy as np


def main():
    import cupy as cp

    import fp4sim as fs
    from fp4sim.formats import E4M3
    from fp4sim.gpu import ops
    from fp4sim.gpu.backend import default_backend
    from fp4sim.planning import nvfp4_constants
    be = default_backend()
    x = cp.random.default_rng(0).standard_normal((8192, 8192), dtype=cp.float32)
    R, K = x.shape

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

    acc = cp.zeros(2, np.uint32)
    codes = cp.empty((R, K // 2), np.uint8)
    scales = cp.empty((R, K // 16), np.uint8)
    fake = cp.empty(1, np.uint32)
    (c0, c1), dq = nvfp4_constants("te", np.float32(5.0))
    e4 = cp.asarray(E4M3.values.astype(np.float64))
    rb = cp.zeros(1, np.uint8)
    i64, i32, f64 = np.int64, np.int32, np.float64
    rows = {
        "copy (read+write 256 MiB)": t(lambda: cp.copyto(cp.empty_like(x), x)),
        "absmax kernel": t(lambda: be.launch("absmax_bits", min(x.size // 8, 1 << 20), x, i64(x.size), acc[0:1],
                                             acc[1:2])),
        "nvfp4 kernel (1x16)": t(lambda: be.launch("nvfp4_quantize", scales.size, x, i64(R), i64(K), rb, i32(0),
                                                   i32(0), i32(8), i32(0), i32(1), f64(c0), f64(c1), f64(dq[0]),
                                                   f64(dq[1]), e4, codes, scales, fake, i32(0))),
        "fs.quantize nvfp4 (whole call)": t(lambda: fs.quantize(x, "nvfp4")),
        "absmax (kernel + host read)": t(lambda: ops.kernels(be).absmax(x)),
    }
    for k, v in rows.items():
        print(f"{k:36} {v * 1e3:9.1f} us")


if __name__ == "__main__":
    main()
