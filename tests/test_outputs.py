"""Every command that writes files refuses, before anything runs, an output path that names one of its inputs
(or a file of a kind it reads inside an input folder): exit 2, one line, the input untouched — rather than
finishing its work and overwriting the file it read."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.fixture()
def files(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", x * 2)
    import fp4sim as fs
    q = fs.quantize(x, "nvfp4")
    np.save(tmp_path / "codes.npy", np.asarray(q.codes))
    np.save(tmp_path / "scales.npy", np.asarray(q.scales))
    return tmp_path


CASES = {
    "analyze --out": ["fp4sim.analyze", "x.npy", "--out", "x.npy", "--quiet"],
    "analyze --json": ["fp4sim.analyze", "x.npy", "--json", "x.npy", "--quiet"],
    "analyze --blocks": ["fp4sim.analyze", "x.npy", "--blocks", "x.npy", "--quiet"],
    "analyze, a file of an input folder": ["fp4sim.analyze", ".", "--json", "y.npy", "--quiet"],
    "analyze --requantize's reference": ["fp4sim.analyze", "x.npy", "--requantize", "y.npy", "--json", "y.npy"],
    "validate --json": ["fp4sim.validate", "--scheme", "nvfp4", "--input", "x.npy", "--codes", "codes.npy",
                        "--scales", "scales.npy", "--json", "scales.npy"],
    "validate checkpoint --json": ["fp4sim.validate", "checkpoint", ".", "--json", "x.npy"],
    "validate gemm --json": ["fp4sim.validate", "gemm", "--out", "y.npy", "--json", "y.npy"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_output_naming_an_input_is_refused_before_anything_runs(files, case):
    before = {p.name: p.read_bytes() for p in files.iterdir()}
    r = _cli(*CASES[case], cwd=files)
    assert r.returncode == 2, (case, r.stdout, r.stderr)
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "is an input of this command" in err[0] and "Traceback" not in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in files.iterdir()} == before          # nothing written, nothing lost


def test_two_outputs_naming_one_file_are_refused(files):
    r = _cli("fp4sim.analyze", "x.npy", "--out", "s.nc", "--json", "s.nc", "--quiet", cwd=files)
    assert r.returncode == 2 and "--out names the same path" in r.stderr and not (files / "s.nc").exists(), r.stderr


def test_outputs_beside_the_inputs_are_still_written(files):
    """A new file in an input folder, and a rerun's own summary there, are no inputs: written as asked."""
    for _ in range(2):
        r = _cli("fp4sim.analyze", ".", "--json", "summary.json", "--quiet", "--schemes", "nvfp4", "--no-hadamard",
                 cwd=files)
        assert r.returncode == 0 and (files / "summary.json").stat().st_size > 0, r.stderr
