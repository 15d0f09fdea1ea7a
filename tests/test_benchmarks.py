"""The benchmark scripts that a GPU run (benchmarks/gpu_check.sh) depends on, run small on the CPU so that a lent
device's minutes are not spent finding their bugs."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).parents[1]


def test_gpt2_step_benchmark_runs_small_on_the_cpu(tmp_path):
    """bench_training --model gpt2-124m with the shape options: every variant runs a whole AdamW step; the
    quantized products per step are 3 GEMMs x tokens x 12 d^2 per block (q, k, v, o and the 4x MLP; the head is
    kept), and the first losses are those of a 50304-way model at initialisation (about ln 50304)."""
    out = tmp_path / "g.json"
    d, L, T, B = 64, 2, 32, 2
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_training.py"), "--model", "gpt2-124m",
                    "--device", "cpu", "--width", str(d), "--layers", str(L), "--heads", "2", "--seq", str(T),
                    "--batch", str(B), "--repeat", "1", "--presets", "nvfp4_paper,fp8_blockwise", "--exact-rules",
                    "--json", str(out)], check=True, capture_output=True, text=True, timeout=600)
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert set(rows) == {"float32", "bf16_autocast", "nvfp4_paper_fast", "fp8_blockwise_fast",
                         "nvfp4_paper:accumulate=tcgen05", "fp8_blockwise:accumulate=hopper",
                         "nvfp4_paper:accumulate=te_reference"}, rows
    for key, r in rows.items():
        assert "error" not in r, (key, r)
        assert abs(r["loss"] - math.log(50304)) < 0.5, (key, r["loss"])
        if key not in ("float32", "bf16_autocast"):
            assert r["quantized_products"] == 3 * B * T * 12 * d * d * L, key
            assert r["vs_bf16"] == pytest.approx(r["ms"] / rows["bf16_autocast"]["ms"])
    assert rows["float32"]["quantized_products"] == 0
    _report_checks(tmp_path, res)


def _report_checks(tmp_path, training):
    """gpu_report.py on a gpu_check.sh folder: the H200's recorded kernel JSON, this training JSON and a stand-in
    analysis JSON; each verdict follows from its figure and the issue's target, and what is missing is reported as
    not measured."""
    import shutil
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_report
    out = tmp_path / "gpu_check"
    out.mkdir()
    shutil.copy(ROOT / "benchmarks" / "results" / "h200-2026-12-04" / "bench_gpu.json", out)
    (out / "bench_training.json").write_text(json.dumps(training))
    (out / "bench_analyze.json").write_text(json.dumps({"checkpoint": {"elements": 1.0e9, "device": "cuda",
                                                                       "local": {"s": 31.0, "elems_per_s": 3.2e7}}}))
    assert gpu_report.main([str(out), "--json", str(out / "v.json")]) == 0
    v = json.loads((out / "v.json").read_text())
    rec = json.loads((out / "bench_gpu.json").read_text())
    for r in rec["rows"]:
        t = gpu_report.KERNEL_TARGETS.get(r["op"])
        if t is not None:
            assert v["kernels"][r["op"]] == ("met" if r["of_copy"] >= t else "missed"), r["op"]
    assert v["kernels"]["quantize nvfp4 (f32)"] == "missed"              # 12.4% of the copy bandwidth
    assert v["kernels"]["rht+quantize nvfp4 fused (f32)"] == "not measured"  # not in that run
    rows = training["rows"]
    assert v["training"]["nvfp4_paper_fast"] == ("met" if rows["nvfp4_paper_fast"]["vs_bf16"] <= 1.5 else "missed")
    assert v["training"]["fp8_blockwise_fast"] == ("met" if rows["fp8_blockwise_fast"]["vs_bf16"] <= 1.3
                                                   else "missed")
    assert v["training"]["peak_memory"] == "not measured"                 # a CPU run has no device peak
    assert v["analysis"]["analyze_1e9"] == "missed"                        # 31 s against 30 s


def test_planning_benchmark_runs_without_a_gpu(tmp_path):
    """bench_planning.py times the host's share of a GPU quantize with launches that do nothing: every call and
    shape is timed, and the calls really plan (a bad scheme name in a case would raise)."""
    out = tmp_path / "p.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_planning.py"), "--calls", "3", "--json",
                    str(out)], check=True, capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 * 6 and all(r["us"] > 0 for r in rows)
    assert {tuple(r["shape"]) for r in rows} == {(2048, 768), (8192, 3072), (3072, 8192), (8192, 8192)}


def test_inspect_benchmark_runs_small(tmp_path):
    """bench_inspect.py on a two-block model of 64 features: it builds the model, runs inspect and plain torch in a
    fresh process, and reports memory against the stored size and the time ratio; the peak holds at least the
    weights, the estimate made before loading lies above the peak (it is meant to be an upper bound)."""
    pytest.importorskip("transformers")
    out = tmp_path / "b.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_inspect.py"), "--sizes", "64x2", "--batches",
                    "1", "--batch-size", "1", "--seq-len", "32", "--vocab", "300", "--json", str(out)], check=True,
                   capture_output=True, timeout=600)
    rec = json.loads(out.read_text())
    (row,) = rec["rows"]
    assert row["size"] == "64x2" and row["tokens"] == 32 and row["params"] > 0
    assert row["peak_gb"] >= row["base_gb"] + 0.0 and row["peak_gb"] > row["stored_gb"]
    assert row["estimate_gb"] >= row["peak_gb"]
    assert row["inspect_s"] > 0 and row["torch_s"] > 0 and math.isclose(row["ratio"], row["inspect_s"] / row["torch_s"])


def test_the_checkpoint_benchmark_runs_each_tool_on_a_small_gpt_oss_folder(tmp_path):
    """bench_analyze.py's part 3 with one expert per weight: validate, analyze and analyze --requantize each run in
    a fresh process on the folder it writes, and each peak is measured and within the bound it states."""
    js = tmp_path / "b.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_analyze.py"), "--checkpoint-elems", "1",
                        "--layout", "gpt-oss", "--experts", "1", "--tools", "validate,analyze,requantize",
                        "--threads", "1", "--tmp", str(tmp_path), "--json", str(js)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(js.read_text())["checkpoint"]
    assert res["elements"] == 5760 * 2880 and res["bound_gb"] == pytest.approx(2 + 3 * res["largest_gb"])
    for tool in ("validate", "analyze", "requantize"):
        t = res[tool]
        assert t["rc"] == 0 and 0.1 < t["peak_gb"] < res["bound_gb"] and t["within_bound"], (tool, t)
        assert t["elems_per_s"] == pytest.approx(res["elements"] / t["s"])
    assert res["requantize"]["compared"] == 1 and res["analyze"]["analysed"] == 1
