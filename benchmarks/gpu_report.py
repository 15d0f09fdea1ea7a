"""The results of one ``benchmarks/gpu_check.sh OUTDIR`` run as Markdown tables, each measured figure beside its
target and a verdict (met / missed / not measured), for docs/gpu.md and docs/performance.md.

    python benchmarks/gpu_report.py OUTDIR [--json verdicts.json]

Reads what gpu_check.sh writes: ``steps.txt``, ``bench_gpu.json``, ``bench_training.json``,
``bench_training_exact.json`` and ``bench_analyze.json`` (a missing file or row is reported as not measured, not
skipped). The targets are issue 57's: on the device, at 8192x8192, as a share of the copy bandwidth measured in the
same run, >= 70% for the round-to-nearest quantizes (NVFP4 1x16 and 16x16, MXFP4, MXFP8, FP8, from float32 and from
16-bit input), >= 50% for stochastic rounding from a seed and for the fused RHT + quantize, >= 60% for fake_quantize
and dequantize; the emulated GPT-2-small step <= 1.5x the BF16 autocast step under nvfp4_paper and <= 1.3x under
fp8_blockwise, peak memory <= 1.5x BF16's; a 1e9-element BF16 checkpoint analysed on the device in <= 30 s. The
training shapes are reported beside 8192^2 without a target (launch overhead shows there).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KERNEL_TARGETS = {
    "quantize nvfp4 (f32)": 0.70, "quantize nvfp4_2d (f32)": 0.70, "quantize mxfp4 (f32)": 0.70,
    "quantize mxfp8_e4m3 (f32)": 0.70, "quantize fp8_e4m3 (f32)": 0.70, "quantize fp8_blockwise (f32)": 0.70,
    "quantize nvfp4 (f16 input)": 0.70, "quantize mxfp4 (f16 input)": 0.70,
    "quantize nvfp4 sr seed (f32)": 0.50, "quantize mxfp4 sr seed (f32)": 0.50,
    "rht+quantize nvfp4 fused (f32)": 0.50,
    "fake_quantize nvfp4 (f32)": 0.60, "fake_quantize mxfp4 (f32)": 0.60,
    "dequantize nvfp4": 0.60, "dequantize mxfp4": 0.60,
}
TARGET_SHAPE = [8192, 8192]
STEP_TARGETS = {"nvfp4_paper_fast": 1.5, "fp8_blockwise_fast": 1.3}
PEAK_TARGET = 1.5
ANALYZE_TARGET_S = 30.0


def _load(out: Path, name: str):
    f = out / name
    if not f.exists():
        return None
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise SystemExit(f"gpu_report: {f} is not JSON ({e}); was the step cut short? (see steps.txt)") from None


def verdict(value, target, higher_is_better: bool) -> str:
    if value is None:
        return "not measured"
    ok = value >= target if higher_is_better else value <= target
    return "met" if ok else "missed"


def kernels(res) -> tuple[list[str], dict]:
    """The kernel table (ops x shapes, share of copy) and the verdicts at TARGET_SHAPE."""
    verdicts = {}
    if res is None:
        return ["bench_gpu.json: not measured"], {op: "not measured" for op in KERNEL_TARGETS}
    shapes = res.get("shapes", [res]) if "shapes" in res else [res]
    by_shape = {tuple(s["shape"]): {r["op"]: r for r in s["rows"]} for s in shapes}
    names = [f"{a}x{b}" for a, b in by_shape]
    ops = list(dict.fromkeys(op for rows in by_shape.values() for op in rows))
    ops += [op for op in KERNEL_TARGETS if op not in ops]
    lines = [f"Device {res.get('device', '?')}; copy bandwidth "
             + ", ".join(f"{n} {s['copy_GBps']:.0f} GB/s" for n, s in zip(names, shapes)), "",
             "| operation | " + " | ".join(names) + " | target at 8192x8192 | verdict |",
             "|---" * (len(names) + 3) + "|"]
    for op in ops:
        cells = []
        for shape in by_shape:
            r = by_shape[shape].get(op)
            cells.append("-" if r is None else f"{100 * r['of_copy']:.1f}% ({r.get('us', r.get('ms', 0) * 1e3):.0f} us)")
        t = KERNEL_TARGETS.get(op)
        at = by_shape.get(tuple(TARGET_SHAPE), {}).get(op)
        v = "" if t is None else verdict(None if at is None else at["of_copy"], t, True)
        if t is not None:
            verdicts[op] = v
        lines.append(f"| {op} | " + " | ".join(cells) + f" | {'' if t is None else f'>= {t:.0%}'} | {v} |")
    return lines, verdicts


def training(res, exact) -> tuple[list[str], dict]:
    verdicts = {}
    if res is None:
        return ["bench_training.json: not measured"], {k: "not measured" for k in STEP_TARGETS} | {
            "peak_memory": "not measured"}
    c = res.get("config", {})
    rows = res.get("rows", {})
    lines = [f"Device {res.get('device', '?')}, torch {res.get('torch', '?')}: GPT d_model {c.get('d_model')}, "
             f"{c.get('layers')} layers, {c.get('batch')} x {c.get('seq')} tokens per step, AdamW", "",
             "| step | ms | tokens/s | vs BF16 | vs float32 | peak memory vs BF16 | target | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for key, r in rows.items():
        if "error" in r:
            lines.append(f"| {key} | failed: {r['error'][:80]} | | | | | | |")
            continue
        t = STEP_TARGETS.get(key)
        v = "" if t is None else verdict(r.get("vs_bf16"), t, False)
        if t is not None:
            verdicts[key] = v
        peak = r.get("peak_vs_bf16")
        lines.append(f"| {key} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{'' if 'vs_bf16' not in r else format(r['vs_bf16'], '.2f') + 'x'} | "
                     f"{'' if 'vs_float32' not in r else format(r['vs_float32'], '.2f') + 'x'} | "
                     f"{'' if peak is None else format(peak, '.2f') + 'x'} | {'' if t is None else f'<= {t}x'} | {v} |")
    for key in STEP_TARGETS:
        verdicts.setdefault(key, "not measured")
    peak = rows.get("nvfp4_paper_fast", {}).get("peak_vs_bf16")
    verdicts["peak_memory"] = verdict(peak, PEAK_TARGET, False)
    lines += ["", f"Peak memory of the nvfp4_paper step (torch + CuPy pool) <= {PEAK_TARGET}x BF16's: "
              f"{verdicts['peak_memory']}"]
    if exact is not None:
        lines += ["", "Exact rules (" + ", ".join(f"{k}: {v}" for k, v in exact.get("config", {}).items()) + "):", "",
                  "| rule | ms | ns per quantized product | vs BF16 |", "|---|---|---|---|"]
        for key, r in exact.get("rows", {}).items():
            if "error" in r or "ns_per_product" not in r:
                continue
            lines.append(f"| {key} | {r['ms']:.1f} | {r['ns_per_product']:.3g} | {r['vs_bf16']:.2f}x |")
    return lines, verdicts


def analysis(res) -> tuple[list[str], dict]:
    if res is None or "checkpoint" not in res:
        return ["bench_analyze.json: not measured"], {"analyze_1e9": "not measured"}
    ck = res["checkpoint"]
    loc = ck.get("local", {})
    v = verdict(loc.get("s"), ANALYZE_TARGET_S, False)
    lines = [f"{ck['elements']:.3g}-element BF16 checkpoint on {ck.get('device', '?')}: {loc.get('s', float('nan')):.1f} s "
             f"({loc.get('elems_per_s', float('nan')):.3g} elements/s; target <= {ANALYZE_TARGET_S:.0f} s: {v})"]
    if "cpu_first_shard" in ck:
        c = ck["cpu_first_shard"]
        lines.append(f"CPU path on its first shard in the same run: {c['s']:.1f} s ({c['elems_per_s']:.3g} elements/s); "
                     f"the device {ck.get('speedup_vs_cpu', float('nan')):.1f}x that rate")
    return lines, {"analyze_1e9": v}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir", help="the folder gpu_check.sh wrote")
    ap.add_argument("--json", help="write the verdicts here")
    a = ap.parse_args(argv)
    out = Path(a.outdir)
    if not out.is_dir():
        raise SystemExit(f"gpu_report: {out} is not a folder (give gpu_check.sh's OUTDIR)")
    steps = (out / "steps.txt").read_text().strip() if (out / "steps.txt").exists() else "steps.txt: missing"
    k_lines, k_v = kernels(_load(out, "bench_gpu.json"))
    t_lines, t_v = training(_load(out, "bench_training.json"), _load(out, "bench_training_exact.json"))
    a_lines, a_v = analysis(_load(out, "bench_analyze.json"))
    print("\n".join(["## Steps", "", "```", steps, "```", "", "## Kernels (share of the copy bandwidth)", "",
                     *k_lines, "", "## Training step", "", *t_lines, "", "## Analysis on the device", "", *a_lines]))
    verdicts = {"kernels": k_v, "training": t_v, "analysis": a_v}
    if a.json:
        Path(a.json).write_text(json.dumps(verdicts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
