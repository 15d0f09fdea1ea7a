"""Emulated training cost, as ratios measured in one run (CPU).

    python benchmarks/bench_training.py [--repeat 3] [--d-model 256] [--json out.json]

1. fp4sim.gemm (exact and fast) for M = N = K = 1024 NVFP4 / MXFP4 operands, against a float32 BLAS matmul of
   the same shape (the quantization of the operands is not included).
2. One training step (forward + backward) of a small transformer (d_model, 2 blocks, 128 tokens x 4 sequences)
   under each preset, against the same model in plain torch float32.
Each ratio's two sides are timed in three alternating rounds (best of --repeat calls each), so a load spike
on a shared machine does not fall on one side only.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import best_alternating  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--json")
    a = ap.parse_args()
    import fp4sim as fs  # before torch: fp4sim sets OMP_WAIT_POLICY=PASSIVE for both OpenMP pools
    import torch
    from fp4sim.torch import convert
    from fp4sim.training import Recipe
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from test_training import TinyGPT

    out = {"gemm": {}, "step": {}}
    rng = np.random.default_rng(0)
    A = rng.standard_normal((1024, 1024)).astype(np.float32)
    B = rng.standard_normal((1024, 1024)).astype(np.float32)
    for scheme in ("nvfp4", "mxfp4"):
        qa, qb = fs.quantize(A, scheme), fs.quantize(B, scheme)
        for acc in ("exact", "fast"):
            t_blas, t = best_alternating([lambda: A @ B.T, lambda: fs.gemm(qa, qb, accumulate=acc)], a.repeat)
            out["gemm"][f"{scheme}_{acc}"] = t / t_blas
            print(f"gemm {scheme:6} {acc:5}: {t * 1e3:8.1f} ms = {t / t_blas:5.2f}x BLAS (float32 BLAS matmul "
                  f"1024^3 in alternating rounds: {t_blas * 1e3:.1f} ms)")

    d = a.d_model
    idx = torch.randint(0, 32, (4, 129), generator=torch.Generator().manual_seed(0))

    def step_fn(model):
        def f():
            logits = model(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), idx[:, 1:].reshape(-1))
            model.zero_grad(set_to_none=True)
            loss.backward()
        return f

    torch.manual_seed(0)
    base = step_fn(TinyGPT(d=d, heads=4))
    for preset in ("none", "bf16", "nvfp4_paper", "mxfp4_paper", "mxfp8", "fp8_blockwise"):
        for acc in ("exact", "fast"):
            if preset == "none" and acc == "fast":
                continue
            torch.manual_seed(0)
            rec = "none" if preset == "none" else Recipe.preset(preset, accumulate=acc)
            m = convert(TinyGPT(d=d, heads=4), rec)
            t0, t = best_alternating([base, step_fn(m)], a.repeat)
            key = preset if preset == "none" else f"{preset}_{acc}"
            out["step"][key] = t / t0
            print(f"step {key:22}: {t * 1e3:8.1f} ms = {t / t0:5.2f}x plain torch (its float32 step in "
                  f"alternating rounds, d_model {d}: {t0 * 1e3:.1f} ms)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
