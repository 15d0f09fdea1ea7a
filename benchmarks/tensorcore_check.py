"""The tensor-core models against the device: run ``torch._scaled_mm`` (FP8, per-tensor scales) and BF16 / FP16
matmuls on the GPU, save every output, and name the fp4sim.tensorcore model that reproduces it bit for bit (or
how far the closest one is).

    python benchmarks/tensorcore_check.py --out DIR [--quick]
    python benchmarks/tensorcore_check.py --out DIR --emulate   # no GPU: mmaemu's H100 stands in for the device

Each case runs a full-size GEMM on the device (large enough that cuBLAS has no reason to split K: more output
tiles than the GPU has SMs) and compares a 96 x 96 corner of its output with the models computed on the CPU for
those rows and columns (an output depends only on its row of A and column of B, whatever the tiling). An FP8
output that no unsplit model reproduces is retried against the split-K layouts of the model's library. Writes
DIR/tensorcore_check.json (every case: its operands' seed, the device's verdict, the match fraction of every
candidate), DIR/outputs/*.npy (the device's outputs, the corner) and prints one line per case.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

CORNER = 96


def _operands(torch, kind, M, K, N, dta, dtb, seed, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "random":
        a = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-8, 6, (M, K), generator=g).float())
        w = torch.randn(N, K, generator=g) * torch.exp2(torch.randint(-8, 6, (N, K), generator=g).float())
    elif kind == "positive":                                     # running sums that grow: truncation shows
        a = torch.randn(M, K, generator=g).abs()
        w = torch.randn(N, K, generator=g).abs()
    else:                                                        # exponents over the formats' whole range
        a = torch.exp2(torch.randint(-9, 9, (M, K), generator=g).float()) * (torch.randint(0, 2, (M, K), generator=g) * 2 - 1)
        w = torch.exp2(torch.randint(-9, 9, (N, K), generator=g).float()) * (torch.randint(0, 2, (N, K), generator=g) * 2 - 1)
    return a.to(dta).to(device), w.to(dtb).to(device)


def fp8_cases(quick):
    import torch
    E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
    shapes = [(2048, 1024, 2048), (2048, 4096, 2048)] if not quick else [(2048, 1024, 2048)]
    out = []
    for M, K, N in shapes:
        for kind in ("random", "positive", "spread"):
            for dta, dtb in ((E4, E4), (E4, E5), (E5, E4)):
                for fast in (False, True):
                    for od in (torch.float32, torch.bfloat16):
                        out.append((M, K, N, kind, dta, dtb, fast, od))
    return out


def _emulated_scaled_mm(a, w, sa, sb, od, fast):
    import warnings

    import mmaemu
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mmaemu.scaled_mm(a, w.t(), sa, sb, out_dtype=od, use_fast_accum=fast, profile="hopper", splitk=1)


def run_fp8(torch, out: Path, quick: bool, device, emulate=False, limit=None) -> list:
    from fp4sim.validate import compare_scaled_mm
    sa = torch.tensor(0.37, dtype=torch.float32)
    sb = torch.tensor(1.9, dtype=torch.float32)
    results = []
    for i, (M, K, N, kind, dta, dtb, fast, od) in enumerate(fp8_cases(quick)[:limit]):
        if emulate:
            M = N = CORNER
        a, w = _operands(torch, kind, M, K, N, dta, dtb, 1000 + i, device)
        t0 = time.perf_counter()
        if emulate:
            y = _emulated_scaled_mm(a, w, sa, sb, od, fast)
        else:
            y = torch._scaled_mm(a, w.t(), sa.to(device), sb.to(device), out_dtype=od, use_fast_accum=fast)
            torch.cuda.synchronize()
        ac, wc, yc = a[:CORNER].cpu(), w[:CORNER].cpu(), y[:CORNER, :CORNER].cpu()
        name = f"fp8_{i:02d}"
        np.save(out / "outputs" / f"{name}.npy", yc.view({4: torch.int32, 2: torch.int16}[yc.element_size()]).numpy())
        rep = compare_scaled_mm(ac, wc.t(), sa, sb, yc)
        split = None
        if rep.best is None:                                     # a split-K layout of the model's library?
            for S in (2, 3, 4, 6, 8):
                r2 = compare_scaled_mm(ac, wc.t(), sa, sb, yc, candidates=["hopper", "hopper_fast_accum"],
                                       split_k=(S, "contiguous"))
                if r2.best:
                    split, rep = (S, "contiguous"), r2
                    break
        res = {"case": name, "M": M, "K": K, "N": N, "operands": kind, "a": str(dta), "b": str(dtb),
               "use_fast_accum": fast, "out_dtype": str(od), "device_ms": 1e3 * (time.perf_counter() - t0),
               "best": rep.best, "matches": rep.matches, "split_k": split, "match_fraction": rep.match_fraction,
               "closest": rep.closest, "worst": rep.mismatches[:3]}
        results.append(res)
        fmt = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
        print(f"{name} {kind:8s} {fmt[dta]} x {fmt[dtb]} K={K} fast={fast!s:5} -> {str(od)[6:]:8s}: "
              + (f"MATCHES {rep.best}" + (f" (split {split})" if split else "") if rep.best else
                 f"no model (closest {rep.closest}: {100 * rep.match_fraction[rep.closest]:.2f}%)"), flush=True)
    return results


def run_16bit(torch, out: Path, quick: bool, device, emulate=False) -> list:
    """BF16 / FP16 matmuls: the device's output against the chip models' one chain over K, rounded to the
    output dtype, and the exact rule (float64 sum rounded once)."""
    import ml_dtypes

    from fp4sim import tensorcore as tc
    results = []
    shapes = [(2048, 1024, 2048), (2048, 4096, 2048)] if not quick else [(2048, 1024, 2048)]
    i = 0
    for M, K, N in shapes:
        if emulate:
            M = N = CORNER
        for dt, fam, npdt in ((torch.bfloat16, "bf16", ml_dtypes.bfloat16), (torch.float16, "fp16", np.float16)):
            for kind in ("random", "positive"):
                g = torch.Generator().manual_seed(2000 + i)
                a = torch.randn(M, K, generator=g)
                w = torch.randn(N, K, generator=g)
                if kind == "positive":
                    a, w = a.abs(), w.abs()
                a, w = a.to(dt).to(device), w.to(dt).to(device)
                y = (a @ w.t())
                if not emulate:
                    torch.cuda.synchronize()
                A, W = a[:CORNER].float().cpu().numpy(), w[:CORNER].float().cpu().numpy()
                yc = y[:CORNER, :CORNER].cpu().view(torch.int16).numpy()
                name = f"{fam}_{i:02d}"
                np.save(out / "outputs" / f"{name}.npy", yc)
                frac = {}
                for m in ("hopper", "ada", "ampere", "b200_mma"):
                    acc = tc.accumulate(A, W, fam, fam, m, fam, fast=True)
                    frac[m] = float((acc.astype(npdt).view(np.int16) == yc).mean())
                exact = (A.astype(np.float64) @ W.astype(np.float64).T).astype(np.float32)
                frac["exact"] = float((exact.astype(npdt).view(np.int16) == yc).mean())
                best = [m for m, f in frac.items() if f == 1.0]
                results.append({"case": name, "M": M, "K": K, "N": N, "dtype": fam, "operands": kind,
                                "matches": best, "match_fraction": frac})
                print(f"{name} {kind:8s} {fam} K={K}: " + (f"MATCHES {', '.join(best)}" if best else
                      "no model: " + ", ".join(f"{m} {100 * f:.2f}%" for m, f in frac.items())), flush=True)
                i += 1
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="one shape per family")
    ap.add_argument("--limit", type=int, help="run only the first N FP8 cases")
    ap.add_argument("--emulate", action="store_true",
                    help="no GPU: mmaemu's H100 model stands in for torch._scaled_mm and the CPU's matmul for the "
                         "16-bit GEMMs, on 96 x 96 outputs (checks this script, not a device)")
    a = ap.parse_args(argv)
    import torch
    if not (a.emulate or torch.cuda.is_available()):
        print("tensorcore_check: no CUDA device (--emulate runs the pipeline without one)", file=sys.stderr)
        return 2
    (a.out / "outputs").mkdir(parents=True, exist_ok=True)
    if a.emulate:
        dev = torch.device("cpu")
        info = {"device": "emulated: mmaemu's H100 profile (FP8), the CPU's matmul (16-bit)", "torch": torch.__version__}
    else:
        dev = torch.device("cuda")
        info = {"device": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
                "sms": torch.cuda.get_device_properties(0).multi_processor_count, "torch": torch.__version__,
                "cuda": torch.version.cuda}
    print(json.dumps(info))
    t0 = time.perf_counter()
    fp8 = run_fp8(torch, a.out, a.quick, dev, a.emulate, a.limit)
    b16 = run_16bit(torch, a.out, a.quick, dev, a.emulate)
    summary = {"device": info, "fp8": fp8, "16bit": b16, "seconds": time.perf_counter() - t0,
               "fp8_best": sorted({r["best"] or "none" for r in fp8})}
    (a.out / "tensorcore_check.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(f"tensorcore_check: {len(fp8)} FP8 cases (models matched: {', '.join(summary['fp8_best'])}), "
          f"{len(b16)} 16-bit cases, {summary['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
