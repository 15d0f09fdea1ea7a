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


def test_planning_benchmark_runs_without_a_gpu(tmp_path):
    """bench_planning.py times the host's share of a GPU quantize with launches that do nothing: every call and
    shape is timed, and the calls really plan (a bad scheme name in a case would raise)."""
    out = tmp_path / "p.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_planning.py"), "--calls", "3", "--json",
                    str(out)], check=True, capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 * 6 and all(r["us"] > 0 for r in rows)
    assert {tuple(r["shape"]) for r in rows} == {(2048, 768), (8192, 3072), (3072, 8192), (8192, 8192)}
