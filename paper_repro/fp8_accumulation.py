"""fp8_accumulation: DeepSeek-V3's accumulation claim measured on the Hopper tensor-core model.

DeepSeek-V3's report (Sec. 3.3.2) found the FP8 GEMMs of H800 tensor cores to keep about 14 bits of the running
sum, a maximum relative error near 2% at K = 4096 on random inputs, and promoted the partial sums to float32 CUDA
cores every 128 elements. Here: per-tensor E4M3 operands (``fs.quantize(x, "fp8_e4m3")``), their GEMM under
fp4sim's Hopper model with fast accumulation (one block-FMA chain over K: 32 products per step, 13 fraction
bits) and with the promotion every 128 elements (cuBLAS's slow accumulation: the chain restarts every 128 and
the restarts are added in float32), and under the exact rule (each 128-block rounded once to float32), against
the float64 product of the same quantized values, for K = 256 ... 16,384. Two operand families: zero-mean
(standard normal) and positive (|standard normal|, where the running sum grows with K: the case truncation
hurts most). Errors: the largest relative error of an output, |y - y*| / |y*| (positive operands only: zero-mean
outputs near 0 make it meaningless), and the norm-wise ||Y - Y*|| / ||Y*||.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import plotting

KS = (256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_KS = (256, 1024)
MODELS = {"hopper_fast_accum": "Hopper, fast accumulation (one chain over K)",
          "hopper": "Hopper, promotion every 128 (slow accumulation)",
          "exact": "exact rule (each 128-block rounded once)"}
COLORS = {"hopper_fast_accum": "tab:red", "hopper": "tab:blue", "exact": "0.4"}


def _errors(y, ref, positive):
    d = np.abs(y.astype(np.float64) - ref)
    out = {"rel_norm": float(np.linalg.norm(d) / np.linalg.norm(ref))}
    if positive:
        r = d / np.abs(ref)
        out.update(rel_max=float(r.max()), rel_median=float(np.median(r)))
    return out


def make(out: Path, quick: bool = False) -> dict:
    import fp4sim as fs
    out = Path(out)
    ks = QUICK_KS if quick else KS
    M = N = 16 if quick else 64
    rows = []
    for fam in ("zero_mean", "positive"):
        rng = np.random.default_rng(20261204)
        for K in ks:
            x = rng.standard_normal((M, K)).astype(np.float32)
            w = rng.standard_normal((N, K)).astype(np.float32)
            if fam == "positive":
                x, w = np.abs(x), np.abs(w)
            qa, qb = fs.quantize(x, "fp8_e4m3"), fs.quantize(w, "fp8_e4m3")
            ref = fs.dequantize(qa).astype(np.float64) @ fs.dequantize(qb).astype(np.float64).T
            for m in MODELS:
                y = fs.gemm(qa, qb, accumulate=m)
                rows.append({"figure": "fp8_accumulation", "operands": fam, "K": K, "model": m, "M": M, "N": N,
                             **_errors(y, ref, fam == "positive")})
    cols = ["figure", "operands", "K", "model", "M", "N", "rel_norm", "rel_max", "rel_median"]
    plotting.write_csv(out / "fp8_accumulation.csv", cols, [{c: r.get(c, "") for c in cols} for r in rows])
    plt = plotting.pyplot()
    f, axs = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (fam, key, lab) in zip(axs, (("positive", "rel_max", "largest relative error of an output"),
                                         ("zero_mean", "rel_norm", "norm-wise relative error"))):
        for m, name in MODELS.items():
            rr = [r for r in rows if r["operands"] == fam and r["model"] == m]
            ax.plot([r["K"] for r in rr], [r[key] for r in rr], "o-", color=COLORS[m], label=name)
        if fam == "positive":
            ax.axhline(0.02, color="k", ls=":", lw=1)
            ax.text(ks[0], 0.022, "DeepSeek-V3: ~2% at K = 4096 (H800)", fontsize=7)
        ax.set(xscale="log", yscale="log", xlabel="K", ylabel=lab)
        plotting.title(ax, f"per-tensor E4M3 GEMM, {'|N(0,1)|' if fam == 'positive' else 'N(0,1)'} operands, "
                           f"{M}x{N} outputs", width=60)
        ax.legend(fontsize=7)
    f.tight_layout()
    f.savefig(out / "fp8_accumulation.png", dpi=130)
    plt.close(f)
    at = {r["model"]: r for r in rows if r["operands"] == "positive" and r["K"] == (4096 if not quick else ks[-1])}
    summary = {"K_range": [ks[0], ks[-1]], "outputs": [M, N],
               "positive_rel_max_at_K": {m: at[m]["rel_max"] for m in MODELS}, "K_quoted": at["hopper"]["K"],
               "rows": rows}
    plotting.write_json(out / "fp8_accumulation.json", summary)
    return summary
