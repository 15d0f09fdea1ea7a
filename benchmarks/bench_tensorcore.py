"""The tensor-core models' cost against fp4sim's exact rule and a float32 BLAS matmul, in one run.

    python benchmarks/bench_tensorcore.py [--size 256x1024x256] [--repeat 3]

torch is imported first, as a user's script does. For FP8 per-tensor operands (M x K, N x K): fs.gemm with
accumulate="exact", "hopper" (slow accumulation), "hopper_fast_accum", "ada"; for NVFP4: "te_reference",
"k64_rtz", "tcgen05"; each reported as ns per product and as a ratio to the float32 matmul of the dequantized
operands (the baseline, timed in the same run by best_alternating)."""
from __future__ import annotations

import argparse
import json

import torch  # noqa: F401  (first, as users' scripts start)

import numpy as np

import fp4sim as fs
from _common import best_alternating


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256x1024x256", help="MxKxN")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    M, K, N = map(int, a.size.split("x"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    rows = []
    for sch, models in (("fp8_e4m3", ("exact", "hopper", "hopper_fast_accum", "ada")),
                        ("nvfp4", ("te_reference", "k64_rtz", "tcgen05"))):
        qa, qb = fs.quantize(x, sch), fs.quantize(w, sch)
        da, db = fs.dequantize(qa), fs.dequantize(qb)
        fns = [lambda: da @ db.T] + [lambda m=m: fs.gemm(qa, qb, accumulate=m) for m in models]
        ts = best_alternating(fns, a.repeat)
        for m, t in zip(models, ts[1:]):
            rows.append({"scheme": sch, "model": m, "seconds": t, "ns_per_product": 1e9 * t / (M * K * N),
                         "ratio_to_f32_matmul": t / ts[0]})
            print(f"{sch:9s} {m:18s} {1e9 * t / (M * K * N):7.2f} ns/product  {t / ts[0]:8.1f}x the float32 matmul")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"size": [M, K, N], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
