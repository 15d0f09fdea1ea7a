"""The host's share of a GPU quantize call: fp4sim's planning and argument packing per call, measured on the CPU
with a backend whose launches do nothing (so no GPU is needed), at the GPT-2-small training shapes and 8192^2.

    python benchmarks/bench_planning.py [--calls 2000] [--json out.json]

On a GPU a call is asynchronous, so when the device's work for a tensor takes less time than this, the host is
what bounds a training step: compare these microseconds with bench_gpu.py's times for the same shapes. The
backend's arrays are NumPy's here (allocation is nearly free), so CuPy's own per-call costs (allocations,
launches) come on top on a GPU.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

SHAPES = ((2048, 768), (8192, 3072), (3072, 8192), (8192, 8192))
CASES = (("quantize nvfp4", "nvfp4", {}), ("quantize nvfp4 sr seed", "nvfp4", {"rounding": "sr", "seed": 1}),
         ("quantize nvfp4_2d", "nvfp4_2d", {}), ("quantize mxfp4", "mxfp4", {}),
         ("quantize fp8_blockwise", "fp8_blockwise", {}), ("quantize nvfp4 along axis 0", "nvfp4", {"axis": 0}))


class NoLaunch:
    """A CUDA backend whose kernels are not run: what remains of a call is the host's work."""
    xp = np

    def launch(self, name, threads, *args):
        pass


def main():
    from fp4sim.gpu import ops
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json")
    a = ap.parse_args()
    be = NoLaunch()
    out = {"calls": a.calls, "rows": []}
    print(f"{'call':30} {'shape':>11} {'us per call':>12}")
    for R, K in SHAPES:
        x = np.ones((R, K), np.float32)
        for name, scheme, kw in CASES:
            ops.quantize(be, x, scheme, **kw)
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                for _ in range(a.calls):
                    ops.quantize(be, x, scheme, **kw)
                best = min(best, (time.perf_counter() - t) / a.calls)
            ops.flush_warnings()
            out["rows"].append({"call": name, "shape": [R, K], "us": best * 1e6})
            print(f"{name:30} {R:>5}x{K:<5} {best * 1e6:12.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
