"""A short training run of a tiny GPT under several recipes: loss curves and step-time ratios in one run.

    python benchmarks/train_tiny.py [--steps 60] [--presets none,nvfp4_paper,mxfp4_paper]

The task: sequences that count modulo the vocabulary with a per-sequence stride of 1, 2 or 3, so the model
must read the stride from the context. Same initial weights, data and order for every recipe.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from test_training import TinyGPT  # noqa: E402

from fp4sim.torch import convert  # noqa: E402
from fp4sim.training import Recipe  # noqa: E402


def batches(n_steps, batch=8, T=64, vocab=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        yield (start + stride * torch.arange(T + 1)) % vocab


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--presets", default="none,nvfp4_paper,mxfp4_paper")
    ap.add_argument("--d-model", type=int, default=128)
    a = ap.parse_args()
    base_t = None
    for preset in a.presets.split(","):
        torch.manual_seed(0)
        model = TinyGPT(vocab=32, d=a.d_model, heads=4, blocks=2)
        rec = "none" if preset == "none" else Recipe.preset(preset, keep=("head",), seed=1)
        convert(model, rec)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
        losses, t0 = [], None
        for i, idx in enumerate(batches(a.steps)):
            if i == 1:
                t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(idx[:, :-1]).reshape(-1, 32), idx[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        step = (time.perf_counter() - t0) / (a.steps - 1)
        base_t = base_t or step
        marks = " ".join(f"{losses[k]:.3f}" for k in range(0, a.steps, max(1, a.steps // 6))) + f" {losses[-1]:.3f}"
        print(f"{preset:14} loss every {max(1, a.steps // 6)} steps: {marks} | step {step * 1e3:6.1f} ms = "
              f"{step / base_t:5.2f}x {a.presets.split(',')[0]}")


if __name__ == "__main__":
    main()
