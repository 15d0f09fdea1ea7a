"""One rule for every command line, tested on the real entry points in fresh processes: a reader that closes the
pipe early (``| head``) loses no result file and gets no traceback, and the command keeps its exit status;
Ctrl-C prints one line and exits 130; an output folder that cannot be written is bad input (exit 2) before any
work starts."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fp4sim._tool import run_tool
from test_checkpoint import ckpt, weights, write_modelopt  # noqa: F401  (the fixtures)

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "fp4sim" / "data" / "sample_dump.npz"


def _closed_pipe(args, cwd=ROOT):
    """Run ``python -m ARGS`` with its stdout a pipe whose reader has gone: every write to it fails (EPIPE)."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", *map(str, args)], stdout=w, stderr=subprocess.PIPE, text=True,
                           cwd=cwd, timeout=600)
    finally:
        os.close(w)
    return p


def test_validate_checkpoint_into_a_closed_pipe_writes_its_json(ckpt, tmp_path):  # noqa: F811
    base, ref, mo = ckpt
    d = write_modelopt(tmp_path / "mo", mo)
    p = _closed_pipe(["fp4sim.validate", "checkpoint", d, "--reference", ref, "--json", tmp_path / "r.json"])
    assert p.returncode == 0 and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True


def test_every_command_into_a_closed_pipe(tmp_path):
    """analyze, validate (a kernel's codes; a GEMM), paper_repro's list, fp4sim's format table: the exit status
    each reaches with a reader, no traceback, the JSON written."""
    import fp4sim as fs
    x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    q = fs.quantize(x, "nvfp4")
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "c.npy", np.asarray(q.codes))
    np.save(tmp_path / "s.npy", np.asarray(q.scales))
    y = np.asarray(fs.gemm(q, q, accumulate="te_reference"))
    np.save(tmp_path / "y.npy", y)
    runs = {
        "analyze": (["fp4sim.analyze", tmp_path / "x.npy", "--quiet", "--json", tmp_path / "a.json"], 0, "a.json"),
        "validate": (["fp4sim.validate", "--scheme", "nvfp4", "--input", tmp_path / "x.npy", "--codes",
                      tmp_path / "c.npy", "--scales", tmp_path / "s.npy", "--json", tmp_path / "v.json"], 0, "v.json"),
        "gemm": (["fp4sim.validate", "gemm", "--a", tmp_path / "x.npy", "--b", tmp_path / "x.npy", "--out",
                  tmp_path / "y.npy", "--expect", "te_reference", "--json", tmp_path / "g.json"], 0, "g.json"),
        "paper_repro list": (["paper_repro", "list"], 0, None),
        "fp4sim spec": (["fp4sim.cli", "spec"], 0, None),
    }
    for name, (args, rc, out) in runs.items():
        p = _closed_pipe(args)
        assert p.returncode == rc and "Traceback" not in p.stderr, (name, p.returncode, p.stderr)
        if out:
            assert json.loads((tmp_path / out).read_text()), name


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _interrupt(args, fifo: Path, cwd):
    """Start ``python -m ARGS``, wait until it blocks reading ``fifo`` (inside the command, past its imports),
    send SIGINT, and return the finished process's (exit status, stderr)."""
    # SIGINT's default action in the command, as a terminal's Ctrl-C finds it: a suite started in the background
    # of a shell (nohup ... &) ignores SIGINT, and an ignored signal stays ignored in every process it starts
    p = subprocess.Popen([sys.executable, "-m", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=cwd, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    t0 = time.monotonic()
    fd = None
    while fd is None:                      # a writer can open the FIFO once the command has opened it to read
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            assert p.poll() is None, p.communicate()
            assert time.monotonic() - t0 < 300, "the command never opened its input"
            time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    os.close(fd)
    return p.returncode, err


@pytest.mark.parametrize("cmd", ["analyze", "validate checkpoint", "inspect"])
def test_ctrl_c_is_one_line_and_exit_130(tmp_path, cmd):
    if cmd == "analyze":
        f = _fifo(tmp_path / "x.npy")
        args = ["fp4sim.analyze", f, "--quiet"]
    elif cmd == "validate checkpoint":
        d = tmp_path / "ck"
        d.mkdir()
        (d / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "NVFP4"}}')
        f = _fifo(d / "model.safetensors")
        args = ["fp4sim.validate", "checkpoint", d]
    else:
        f = _fifo(tmp_path / "text.txt")
        args = ["fp4sim.inspect_model", tmp_path, "--text", f, "--out", tmp_path / "out", "--quiet"]
    rc, err = _interrupt(args, f, tmp_path)
    assert rc == 130, (rc, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert [ln for ln in err.splitlines() if ln.strip()][-1].endswith(": interrupted"), err


def test_run_tool_maps_interrupts_and_closed_pipes(capsys):
    def boom(argv):
        raise KeyboardInterrupt

    assert run_tool(boom, "prog") == 130
    assert capsys.readouterr().err.strip() == "prog: interrupted"
    assert run_tool(lambda argv: 3, "prog") == 3


def test_paper_repro_out_that_cannot_be_written(tmp_path):
    (tmp_path / "afile").write_text("x")
    for out, phrase in ((tmp_path / "afile", "is a file, not a directory"),
                        (tmp_path / "afile" / "sub", "cannot create it"),
                        ("/proc/fp4sim-out", "cannot create it")):
        p = subprocess.run([sys.executable, "-m", "paper_repro", "fig1", "--quick", "--out", str(out)],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert p.returncode == 2 and phrase in p.stderr and "Traceback" not in p.stderr, (out, p.stderr)
    if os.geteuid() != 0:                  # a read-only folder (root writes into it whatever its mode says)
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        p = subprocess.run([sys.executable, "-m", "paper_repro", "fig1", "--quick", "--out", str(ro / "figs")],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert p.returncode == 2 and "cannot create it" in p.stderr, p.stderr
