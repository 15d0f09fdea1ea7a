"""Element encode/decode throughput on a 4096x4096 float32 tensor, as ratios to baselines from the same run.

Baselines: a Numba streaming kernel (read float32, write uint8: the memory-bound floor for an encoder) and
ml_dtypes' ``astype`` cast. Reports best-of-N wall times; the machine is shared, so read ratios, not seconds.

    python benchmarks/bench_elements.py [--n 4096] [--repeat 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import ml_dtypes
import numba as nb
import numpy as np

import fp4sim as fs
from _common import best, stream_f32_to_u8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    x = np.random.default_rng(0).standard_normal((a.n, a.n)).astype(np.float32)
    flat = x.reshape(-1)
    out = np.empty(flat.size, np.uint8)
    gb = flat.nbytes * 1.25 / 1e9  # bytes read + written by an encoder (float32 in, uint8 out)
    t_stream = best(lambda: stream_f32_to_u8(flat, out), a.repeat)
    print(f"numba threads: {nb.get_num_threads()}; tensor {a.n}x{a.n} float32")
    print(f"baseline stream (f32 -> u8): {t_stream * 1e3:8.2f} ms  {gb / t_stream:6.2f} GB/s")
    rows = []
    casts = {"e2m1": ml_dtypes.float4_e2m1fn, "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
             "bf16": ml_dtypes.bfloat16, "ue8m0": ml_dtypes.float8_e8m0fnu}
    print(f"{'op':26} {'ms':>8} {'GB/s':>7} {'vs stream':>10} {'vs ml_dtypes':>13}")
    for fmt in (fs.E2M1, fs.E4M3, fs.E5M2, fs.UE8M0, fs.BF16):
        t_ml = best(lambda: x.astype(casts[fmt.name]), a.repeat)
        modes = ["rne", "rz", "ru", "sr"] if fmt is not fs.UE8M0 else ["rz", "rp", "rne"]
        for mode in modes:
            kw = {"seed": 1} if mode == "sr" else {}
            t = best(lambda: fs.encode(x, fmt, rounding=mode, **kw), a.repeat)
            rows.append(dict(op=f"encode {fmt.name} {mode}", ms=t * 1e3, vs_stream=t_stream / t, vs_ml=t_ml / t))
        codes = fs.encode(x, fmt)
        t = best(lambda: fs.decode(codes, fmt), a.repeat)
        rows.append(dict(op=f"decode {fmt.name}", ms=t * 1e3, vs_stream=t_stream / t, vs_ml=None))
    for r in rows:
        ml = f"{r['vs_ml']:13.2f}" if r["vs_ml"] is not None else f"{'':13}"
        print(f"{r['op']:26} {r['ms']:8.2f} {gb / (r['ms'] / 1e3):7.2f} {r['vs_stream']:10.2f} {ml}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"stream_ms": t_stream * 1e3, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
