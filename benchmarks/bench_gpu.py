"""GPU quantize / dequantize / fake-quantize throughput at 8192^2 and at the training shapes of a GPT-2-small
layer, as a fraction of the device's copy bandwidth measured in the same run (a device-to-device copy of the same
tensor; bytes read + written). Each call is timed whole (CUDA events around it), host planning included.

    python benchmarks/bench_gpu.py [--shapes 8192x8192,2048x768,...] [--repeat 10] [--json out.json]

Effective bandwidth of an operation = (bytes of its input + bytes of its outputs) / time, so 100% means the
operation ran as fast as copying its data once.
"""
from __future__ import annotations

import argparse
import json

import numpy as np


def timeit(cp, fn, repeat):
    fn()
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return min(times), float(np.median(times))


SHAPES = "8192x8192,2048x768,8192x3072,3072x8192"


def main():
    import cupy as cp

    import fp4sim as fs
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES,
                    help="comma-separated ROWSxCOLS float32 inputs (default: %(default)s: 8192^2 and the training "
                         "shapes of a GPT-2-small layer, where launch overhead shows)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    res = {"device": dev, "cupy": cp.__version__, "shapes": []}
    for shape in a.shapes.split(","):
        rows, cols = (int(v) for v in shape.split("x"))
        res["shapes"].append(bench_shape(cp, fs, rows, cols, a.repeat, dev))
        fs.gpu.flush_warnings()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


def bench_shape(cp, fs, rows, cols, repeat, dev):
    """Every operation on one (rows, cols) float32 input (and its float16 copy), as a share of the copy bandwidth
    measured on the same input."""
    rng = cp.random.default_rng(0)
    x = (rng.standard_normal((rows, cols), dtype=cp.float32)
         * cp.exp(rng.standard_normal((rows, 1), dtype=cp.float32)))
    n = x.size
    dst = cp.empty_like(x)
    t_copy, _ = timeit(cp, lambda: cp.copyto(dst, x), repeat)
    copy_bw = 2 * x.nbytes / t_copy
    res = {"shape": [rows, cols], "input_mib": x.nbytes / 2**20, "copy_GBps": copy_bw / 1e9, "rows": []}
    print(f"{dev}: {rows}x{cols} float32 ({x.nbytes / 2**20:.0f} MiB); device copy {copy_bw / 1e9:.0f} GB/s "
          f"({t_copy * 1e6:.1f} us)")
    print(f"{'op':34} {'us':>9} {'GB/s':>8} {'of copy':>8}")
    from fp4sim.quantize import rht_quantize
    q4 = fs.quantize(x, "nvfp4")
    qm = fs.quantize(x, "mxfp4")
    xh = x.astype(cp.float16)
    fp4_out = n // 2 + n // 16
    ops = [
        ("quantize nvfp4 (f32)", lambda: fs.quantize(x, "nvfp4"), 4 * n + fp4_out),
        ("quantize nvfp4 sr seed (f32)", lambda: fs.quantize(x, "nvfp4", rounding="sr", seed=1), 4 * n + fp4_out),
        ("quantize nvfp4 given amax (f32)", lambda: fs.quantize(x, "nvfp4", global_amax=4.0), 4 * n + fp4_out),
        ("quantize nvfp4 axis 0 (f32)", lambda: fs.quantize(x, "nvfp4", axis=0), 4 * n + fp4_out),
        ("rht+quantize nvfp4 fused (f32)", lambda: rht_quantize(x, 16, "te", "bf16", "nvfp4"), 4 * n + fp4_out),
        ("quantize nvfp4_2d (f32)", lambda: fs.quantize(x, "nvfp4_2d"), 4 * n + n // 2 + n // 256),
        ("quantize mxfp4 (f32)", lambda: fs.quantize(x, "mxfp4"), 4 * n + n // 2 + n // 32),
        ("quantize mxfp4 sr seed (f32)", lambda: fs.quantize(x, "mxfp4", rounding="sr", seed=1),
         4 * n + n // 2 + n // 32),
        ("quantize mxfp8_e4m3 (f32)", lambda: fs.quantize(x, "mxfp8_e4m3"), 4 * n + n + n // 32),
        ("quantize fp8_e4m3 (f32)", lambda: fs.quantize(x, "fp8_e4m3"), 4 * n + n),
        ("quantize fp8_blockwise (f32)", lambda: fs.quantize(x, "fp8_blockwise"), 4 * n + n + n // 32),
        ("quantize nvfp4 (f16 input)", lambda: fs.quantize(xh, "nvfp4"), 2 * n + fp4_out),
        ("quantize mxfp4 (f16 input)", lambda: fs.quantize(xh, "mxfp4"), 2 * n + n // 2 + n // 32),
        ("fake_quantize nvfp4 (f32)", lambda: fs.fake_quantize(x, "nvfp4"), 8 * n),
        ("fake_quantize mxfp4 (f32)", lambda: fs.fake_quantize(x, "mxfp4"), 8 * n),
        ("dequantize nvfp4", lambda: fs.dequantize(q4), fp4_out + 4 * n),
        ("dequantize mxfp4", lambda: fs.dequantize(qm), n // 2 + n // 32 + 4 * n),
        ("encode e2m1 (elements)", lambda: fs.encode(x, fs.E2M1), 5 * n),
        ("rht d=16 bf16 out", lambda: fs.rht(x, 16), 8 * n),
    ]
    for name, fn, nbytes in ops:
        tmin, tmed = timeit(cp, fn, repeat)
        bw = nbytes / tmin
        res["rows"].append(dict(op=name, us=tmin * 1e6, median_us=tmed * 1e6, GBps=bw / 1e9, of_copy=bw / copy_bw))
        print(f"{name:34} {tmin * 1e6:9.1f} {bw / 1e9:8.0f} {100 * bw / copy_bw:7.1f}%")
    return res


if __name__ == "__main__":
    main()
