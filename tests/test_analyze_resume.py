"""python -m fp4sim.analyze over an interruption: the process killed mid-run and rerun with the same arguments
resumes from the per-tensor results kept beside --out and writes the Dataset an uninterrupted run writes; a Dask
worker killed mid-tensor has its tensor retried; a tensor that keeps killing workers (out of memory) is skipped
with that reason, the rest analysed."""
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
import xarray as xr

from fp4sim.analyze import analyze

ROOT = Path(__file__).resolve().parents[1]


def _dump(d: Path, n=6, shape=(256, 512)):
    rng = np.random.default_rng(3)
    d.mkdir()
    for i in range(n):
        np.save(d / f"layer{i}.weight.npy", (rng.standard_normal(shape) * (i + 1)).astype(np.float32))
    return d


def _same(a: xr.Dataset, b: xr.Dataset):
    assert a.attrs == b.attrs
    xr.testing.assert_identical(a, b)


def test_a_killed_process_resumes_and_gives_the_same_dataset(tmp_path):
    d = _dump(tmp_path / "dump")
    ref = tmp_path / "ref.nc"
    args = [sys.executable, "-m", "fp4sim.analyze", str(d), "--quiet", "--schemes", "nvfp4,mxfp4_rceil,bf16"]
    r = subprocess.run(args + ["--out", str(ref)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    assert not Path(str(ref) + ".parts").exists()                  # removed once the Dataset is written
    out = tmp_path / "run.nc"
    parts = Path(str(out) + ".parts")
    p = subprocess.Popen(args + ["--out", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while len(list(parts.glob("*.pkl"))) < 2 and p.poll() is None and time.time() - t0 < 300:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    kept = len(list(parts.glob("*.pkl")))
    assert 2 <= kept < 6 and not out.exists(), kept
    r = subprocess.run(args + ["--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    _same(xr.open_dataset(out), xr.open_dataset(ref))
    assert not parts.exists()


def test_resume_reuses_kept_results_only_for_the_same_arguments(tmp_path):
    d = _dump(tmp_path / "dump", n=3, shape=(64, 128))
    keep = tmp_path / "parts"
    a = analyze([str(d)], schemes=["nvfp4"], hadamard=False, quiet=True, resume=keep)
    files = sorted(keep.glob("*.pkl"))
    assert len(files) == 3
    before = {f: f.stat().st_mtime_ns for f in files}
    b = analyze([str(d)], schemes=["nvfp4"], hadamard=False, quiet=True, resume=keep)
    _same(a, b)
    assert {f: f.stat().st_mtime_ns for f in files} == before             # read back, not recomputed
    c = analyze([str(d)], schemes=["nvfp4"], hadamard=False, quiet=True, resume=keep, seed=5)
    assert {f: f.stat().st_mtime_ns for f in files} != before             # another seed: recomputed
    _same(c, analyze([str(d)], schemes=["nvfp4"], hadamard=False, quiet=True, seed=5))
    np.save(d / "layer0.weight.npy", np.ones((64, 128), np.float32))      # a changed file is analysed again
    e = analyze([str(d)], schemes=["nvfp4"], hadamard=False, quiet=True, resume=keep, seed=5)
    assert float(e["rel_mse"].sel(tensor="layer0.weight", scheme="nvfp4")) == 0.0


@pytest.mark.slow
def test_dask_worker_killed_mid_tensor_and_an_out_of_memory_tensor(tmp_path):
    pytest.importorskip("dask.distributed")
    import dask
    from dask.distributed import Client, LocalCluster
    d = _dump(tmp_path / "dump", n=4, shape=(512, 1024))
    kw = dict(schemes=["nvfp4", "bf16"], quiet=True)

    def cluster():                                        # single-threaded workers: the numbers of a local run
        return LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    with cluster() as c, Client(c) as client:
        ref = analyze([str(d)], client=client, **kw)
    with cluster() as c, Client(c) as client:
        pids = client.run(os.getpid)

        def kill_one():                                   # SIGKILL a worker process while it analyses a tensor
            time.sleep(1.0)
            busy = [w for w, ts in client.processing().items() if ts] or list(pids)
            os.kill(pids[busy[0]], signal.SIGKILL)
        import threading
        t = threading.Thread(target=kill_one, daemon=True)
        t.start()
        got = analyze([str(d)], client=client, **kw)
        t.join()
    _same(got, ref)
    big = tmp_path / "big"
    big.mkdir()
    np.save(big / "small.weight.npy", np.ones((64, 64), np.float32))
    np.save(big / "huge.weight.npy", np.ones((12000, 12000), np.float32))         # 576 MB: its analysis needs more
    with dask.config.set({"distributed.scheduler.allowed-failures": 2}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit="700MiB",
                         dashboard_address=None) as cluster, Client(cluster) as client:
        got = analyze([str(big)], client=client, schemes=["nvfp4"], quiet=True, hadamard=False,
                      resume=tmp_path / "parts")
    assert list(got.tensor.values) == ["small.weight"]
    sk = json.loads(got.attrs["skipped"])
    assert sk[0]["tensor"] == "huge.weight" and "killed every Dask worker" in sk[0]["reason"]
    # the kill is not kept as the tensor's outcome: a resumed run (with more memory) analyses it again, where a
    # kept skip would be read back; only small.weight's result is in the resume folder
    import pickle
    kept = []
    for f in sorted((tmp_path / "parts").glob("*.pkl")):
        with open(f, "rb") as fh:
            stamp, (kind, _) = pickle.load(fh)
        kept.append((stamp["name"], kind))
    assert kept == [("small.weight", "result")]


def _sharded(d: Path, n: int, shape=(256, 1024), per_shard=2):
    import ml_dtypes
    from safetensors.numpy import save_file
    rng = np.random.default_rng(9)
    d.mkdir()
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(n)]
    shards = -(-n // per_shard)
    wmap = {}
    for s in range(shards):
        fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s * per_shard:(s + 1) * per_shard]
        save_file({k: rng.standard_normal(shape).astype(ml_dtypes.bfloat16) for k in part}, str(d / fn))
        wmap.update({k: fn for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return d, names


def test_a_sharded_checkpoint_is_analysed_entry_by_entry(tmp_path):
    """A sharded Hugging Face folder (BF16 entries, its index): every entry under its own name, the numbers of
    the same tensors in one file, and the peak memory of 16 tensors that of 2 plus their small results (one tensor
    at a time)."""
    import tracemalloc

    from safetensors.numpy import load_file, save_file
    d, names = _sharded(tmp_path / "sharded", 16)
    kw = dict(schemes=["nvfp4"], hadamard=False, quiet=True)
    one = tmp_path / "one"
    one.mkdir()
    save_file({k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()},
              str(one / "model.safetensors"))
    a = analyze([str(d)], **kw)
    assert list(a.tensor.values) == names and json.loads(a.attrs["skipped"]) == []
    b = analyze([str(one)], **kw)
    assert sorted(b.tensor.values) == sorted(names)
    _same(a.drop_attrs().sortby("tensor"), b.drop_attrs().sortby("tensor"))
    d2, _ = _sharded(tmp_path / "two", 2)
    peaks = []
    for path in (d2, d):
        tracemalloc.start()
        analyze([str(path)], **kw)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    # 14 more tensors add their small results (histograms, maps), not themselves: held at once they would add
    # at least 14 float32 copies (1 MiB each)
    assert peaks[1] - peaks[0] < 14 * 256 * 1024 * 4 / 4, peaks


def test_a_scheduler_started_as_its_own_process_gives_the_local_dataset(tmp_path):
    """``dask scheduler`` and two ``dask worker`` processes started from the command line, as on a real cluster;
    ``python -m fp4sim.analyze DIR --scheduler ADDR --out OUT`` writes the Dataset of the local run (every study,
    a sharded checkpoint and a dump), and a scheduler that does not answer is a clear error."""
    pytest.importorskip("dask.distributed")
    d, _ = _sharded(tmp_path / "sharded", 4, shape=(128, 256))
    dump = _dump(tmp_path / "dump", n=2)
    g = np.random.default_rng(5).standard_normal((256, 512)).astype(np.float32)
    np.save(dump / "blk0.mlp.grad_output.npy", g * np.exp(g[:, :1]))          # a gradient: every study
    sfile = tmp_path / "scheduler.json"
    dask = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    procs = [subprocess.Popen(dask + ["--port", "0", "--no-dashboard", "--scheduler-file", str(sfile)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        for _ in range(300):
            if sfile.exists() and sfile.stat().st_size:
                break
            time.sleep(0.1)
        address = json.loads(sfile.read_text())["address"]
        for _ in range(2):
            procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address,
                                           "--nthreads", "1", "--no-dashboard"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        from dask.distributed import Client
        with Client(address, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
        kw = ["--quiet", "--schemes", "nvfp4,mxfp4_rceil,fp8_e4m3"]
        out = tmp_path / "dist.nc"
        r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(d), str(dump), *kw, "--scheduler", address,
                            "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        ref = tmp_path / "local.nc"
        r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(d), str(dump), *kw, "--out", str(ref)],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        with xr.open_dataset(out) as a, xr.open_dataset(ref) as b:
            assert a.sizes["tensor"] == 4 + 3
            _same(a.load().drop_attrs(), b.load().drop_attrs())
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(dump), "--quiet", "--scheduler", address],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode != 0 and "no Dask scheduler answered" in r.stderr


def test_a_dask_workers_kernels_use_its_own_thread_count():
    """Inside a Dask worker of one thread, analysis runs Numba's kernels on one thread (two workers on two
    cores would otherwise each start a pool of every core); outside a worker the count is left alone."""
    pytest.importorskip("dask.distributed")
    import numba
    from dask.distributed import Client, LocalCluster

    from fp4sim.analyze.core import _worker_numba_threads

    def inside():
        before = numba.get_num_threads()
        with _worker_numba_threads():
            n = numba.get_num_threads()
        return before, n, numba.get_num_threads()

    outside = numba.get_num_threads()
    with _worker_numba_threads():
        assert numba.get_num_threads() == outside
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one core: no second thread to hold back")
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cl, \
            Client(cl) as client:
        before, n, after = client.submit(inside, pure=False).result()
    assert before >= 2 and n == 1 and after == before
