"""What ``fp4sim.analyze`` costs, as multiples of one NVFP4 ``fs.quantize`` of the same tensor in the same run.

    python benchmarks/bench_analyze.py [--size 4096] [--repeat 2] [--json out.json]
    python benchmarks/bench_analyze.py --checkpoint-elems 1e9 [--workers 1,2] [--json out.json]
    python benchmarks/bench_analyze.py --checkpoint-elems 1e9 --device cuda [--json out.json]
    python benchmarks/bench_analyze.py --checkpoint-elems 4.4e9 --layout gpt-oss [--tools validate,analyze,requantize]

1. One size x size float32 tensor (Gaussian, heavy-tailed rows) analysed as an activation and as a gradient,
   with every default scheme and study and with ``hadamard=False``, each stage timed (the schemes, the outlier
   study, the Hadamard study, the gradient bias), against the best of ``--repeat`` NVFP4 quantizations of it.
2. ``--checkpoint-elems N``: a sharded Hugging Face checkpoint of about N BF16 elements (4096 x 4096 entries,
   two per ``model-0000k-of-0000m.safetensors`` shard, with its index) written to a temporary folder and
   analysed as ``python -m fp4sim.analyze DIR --no-hadamard`` does, locally and on a Dask LocalCluster of 1 and
   2 worker processes (one thread each): elements per second, the peak resident size of the process (and of
   the workers), and the scaling from 1 to 2 workers.
3. ``--checkpoint-elems N --layout gpt-oss``: a gpt-oss MXFP4 folder of about N elements in gpt-oss-20b's shapes
   (32 experts, or ``--experts``; ``gate_up_proj`` 5760 x 2880 and ``down_proj`` 2880 x 2880 per layer, two weights per shard; one
   Gaussian expert in bfloat16 quantized with ``mxfp4``'s floor mode and repeated with each expert's scale bytes
   shifted by -2..2), checked by ``python -m fp4sim.validate checkpoint DIR``, analysed by ``python -m
   fp4sim.analyze DIR --no-hadamard`` and, with ``requantize`` among ``--tools``, costed against a bfloat16
   reference (the Gaussian experts in transformers' [experts, K, rows] order) by ``analyze DIR --requantize REF
   --schemes mxfp4_rceil --no-hadamard``, each in a fresh process: seconds, elements and stored bytes per second,
   the process's peak resident size (VmHWM) beside the bound 2 GB + 3 x the largest tensor's stored size.

``--device cuda``: the same on the current CUDA device (``analyze(..., device="cuda")``). Part 1's baseline is then
one NVFP4 quantize of the tensor on the device; part 2 analyses the checkpoint on the device (the kernels compiled by
a first, untimed analysis of one small tensor) and, as the baseline of the same run, its first shard on the CPU in
this process (no Dask).

torch is imported first, as a user's script does.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401  (first, as a user's script)
import numpy as np

import fp4sim as fs
from fp4sim.analyze import analyze
from fp4sim.analyze.core import analyze_tensor, resolve_device
from fp4sim.analyze.inputs import discover


def _tensor(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, n)).astype(np.float32)
    x *= np.exp(rng.standard_normal((n, 1)).astype(np.float32))          # rows of different scales
    x[:, ::97] *= 20                                                        # outlier channels
    return x


def _sync(device):
    if device == "cuda":
        import cupy
        cupy.cuda.Device().synchronize()


def stages(a, out):
    x = _tensor(a.size)
    xq = x
    if a.device == "cuda":
        import cupy
        xq = cupy.asarray(x)

    def quantize():
        fs.quantize(xq, "nvfp4")
        _sync(a.device)
    quantize()
    tq = min(_timed(quantize) for _ in range(a.repeat))
    out["quantize_s"] = tq
    out["device"] = a.device
    print(f"one NVFP4 fs.quantize of {a.size} x {a.size} ({a.device}): {tq * 1e3:.2f} ms")
    dv = resolve_device(a.device)
    with tempfile.TemporaryDirectory() as d:
        for role in ("activation", "gradient"):
            name = {"activation": "blk.mlp.input", "gradient": "blk.mlp.grad_output"}[role]
            p = Path(d) / f"{name}.npy"
            np.save(p, x)
            src = discover([str(p)])[0][0]
            if role == "activation":                                                                  # compile
                analyze_tensor(src, chunk_elems=1 << 16, hadamard=True, device=dv)
            for hadamard in (True, False):
                best = None
                for _ in range(a.repeat):
                    t = {}
                    last = [None, time.perf_counter()]

                    def stage(s, t=t, last=last):
                        now = time.perf_counter()
                        if last[0] is not None:
                            key = "schemes" if last[0].startswith("scheme") else last[0]
                            t[key] = t.get(key, 0.0) + now - last[1]
                        last[:] = [s, now]
                    t0 = time.perf_counter()
                    analyze_tensor(src, hadamard=hadamard, stage=stage, device=dv)
                    stage("end")
                    t["total"] = time.perf_counter() - t0
                    best = t if best is None or t["total"] < best["total"] else best
                key = f"{role}{'' if hadamard else '_no_hadamard'}"
                out[key] = {k: v / tq for k, v in best.items()}
                parts = ", ".join(f"{k} {v / tq:.0f}x" for k, v in best.items() if k != "total")
                print(f"{key:24}: {best['total']:6.2f} s = {best['total'] / tq:5.0f}x one quantize ({parts})",
                      flush=True)


def _peak_rss_mb() -> float:
    """This process's peak resident size (VmHWM: unlike getrusage's ru_maxrss, not inherited from the process
    that forked it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def checkpoint(a, out):
    import ml_dtypes
    from safetensors.numpy import save_file
    n = int(float(a.checkpoint_elems))
    side = 4096
    entries = max(1, round(n / side / side))
    shards = -(-entries // 2)
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as d:
        wmap = {}
        t = time.perf_counter()
        base = rng.standard_normal((side, side), np.float32)

        def entry(e):          # one Gaussian draw, rolled and scaled per entry (drawing 1e9 values takes ~15 s)
            return (np.roll(base, 97 * e, axis=0) * np.float32(1 + e / 64)).astype(ml_dtypes.bfloat16)
        for s in range(shards):
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {f"model.layers.{2 * s + i}.mlp.up_proj.weight": entry(2 * s + i)
                    for i in range(2) if 2 * s + i < entries}
            save_file(part, str(Path(d) / fn))
            wmap.update({k: fn for k in part})
        (Path(d) / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
        elems = entries * side * side
        print(f"wrote {entries} BF16 entries of {side} x {side} ({elems:.3g} elements, {shards} shards) in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
        res = {"elements": elems, "device": a.device}
        if a.device == "cuda":
            first = Path(d) / wmap[next(iter(wmap))]
            with tempfile.TemporaryDirectory() as d1:                      # the kernels compiled, untimed
                np.save(Path(d1) / "w.npy", rng.standard_normal((256, 256), np.float32))
                analyze([d1], hadamard=False, quiet=True, device="cuda")
            n1 = sum(1 for v in wmap.values() if v == first.name) * side * side
            t = time.perf_counter()
            analyze([str(first)], hadamard=False, quiet=True)
            dt1 = time.perf_counter() - t
            res["cpu_first_shard"] = {"elements": n1, "s": dt1, "elems_per_s": n1 / dt1}
            print(f"CPU, the first shard alone: {dt1:.1f} s, {n1 / dt1:.3g} elements/s", flush=True)
        t = time.perf_counter()
        analyze([d], hadamard=False, quiet=a.device == "cpu", device=a.device)     # on a GPU: progress shown
        _sync(a.device)
        dt = time.perf_counter() - t
        res["local"] = {"s": dt, "elems_per_s": elems / dt,
                        "peak_rss_mb": _peak_rss_mb()}
        print(f"local ({a.device}): {dt:.1f} s, {elems / dt:.3g} elements/s, peak RSS "
              f"{res['local']['peak_rss_mb']:.0f} MB", flush=True)
        if a.device == "cuda":
            res["speedup_vs_cpu"] = res["local"]["elems_per_s"] / res["cpu_first_shard"]["elems_per_s"]
            print(f"the device analyses {res['speedup_vs_cpu']:.1f}x as many elements per second as this machine's "
                  f"CPU path", flush=True)
        from dask.distributed import Client, LocalCluster
        for w in (int(v) for v in a.workers.split(",") if v.strip() and a.device == "cpu"):
            with LocalCluster(n_workers=w, threads_per_worker=1, processes=True, dashboard_address=None) as cl, \
                    Client(cl) as client:
                t = time.perf_counter()
                analyze([d], hadamard=False, quiet=True, client=client)
                dt = time.perf_counter() - t
                peaks = client.run(_peak_rss_mb)
            res[f"dask_{w}"] = {"s": dt, "elems_per_s": elems / dt, "worker_peak_rss_mb": max(peaks.values())}
            print(f"Dask, {w} worker(s): {dt:.0f} s, {elems / dt:.3g} elements/s, worker peak RSS "
                  f"{max(peaks.values()):.0f} MB", flush=True)
        if "dask_1" in res and "dask_2" in res:
            res["scaling_1_to_2"] = res["dask_1"]["s"] / res["dask_2"]["s"]
            print(f"1 -> 2 workers: {res['scaling_1_to_2']:.2f}x faster")
        out["checkpoint"] = res


_WRAP = r"""
import atexit, runpy, sys
out = sys.argv.pop(1)


def hwm():  # this process's peak resident size: VmHWM, which (unlike getrusage's) is not the forking process's
    with open(out, "w") as f:
        f.write(next(v.split()[1] for v in open("/proc/self/status") if v.startswith("VmHWM:")))
atexit.register(hwm)
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def _tool(module, args, d) -> dict:
    """``python -m module args`` in a fresh process: {"s", "peak_gb", "rc"}."""
    import subprocess
    peak = Path(d) / "peak.kb"
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _WRAP, str(peak), module, *map(str, args)], capture_output=True,
                       text=True)
    dt = time.perf_counter() - t
    if p.returncode not in (0, 1):                    # validate exits 1 on a fault it finds: still a full check
        raise SystemExit(f"{module} {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return {"s": dt, "peak_gb": int(peak.read_text()) * 1024 / 1e9, "rc": p.returncode}


GPT_OSS_20B = (("gate_up_proj", 5760), ("down_proj", 2880))     # per layer, 32 experts of (rows, 2880)


def gpt_oss(a, out):
    """Part 3: a gpt-oss MXFP4 folder checked by validate and analysed by analyze, each in its own process."""
    import ml_dtypes
    from safetensors.numpy import save_file
    n = int(float(a.checkpoint_elems))
    E, K = a.experts, 2880
    rng = np.random.default_rng(1)
    first, gauss = {}, {}
    for proj, rows in GPT_OSS_20B:                          # one Gaussian expert per projection, quantized once
        gauss[proj] = (rng.standard_normal((rows, K), np.float32) * np.float32(0.02)).astype(ml_dtypes.bfloat16)
        q = fs.quantize(gauss[proj].astype(np.float32), "mxfp4", scale_mode="floor")
        first[proj] = (np.asarray(q.codes).reshape(1, rows, K // 32, 16), np.asarray(q.scales).reshape(1, rows, -1))
    names, elems = [], 0
    while elems < n or not names:
        proj, rows = GPT_OSS_20B[len(names) % 2]
        names.append((f"model.layers.{len(names) // 2}.mlp.experts.{proj}", proj))
        elems += E * rows * K
    shards = -(-len(names) // 2)
    with tempfile.TemporaryDirectory(dir=a.tmp) as d:
        t = time.perf_counter()
        wmap, largest = {}, 0
        for s in range(shards):
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {}
            for i, (name, proj) in enumerate(names[2 * s: 2 * s + 2]):
                c, sc = first[proj]
                shift = (np.arange(E) + 2 * s + i) % 5 - 2
                part[name + "_blocks"] = np.repeat(c, E, 0)
                part[name + "_scales"] = (np.repeat(sc, E, 0).astype(np.int16) + shift[:, None, None]).astype(np.uint8)
                largest = max(largest, part[name + "_blocks"].nbytes + part[name + "_scales"].nbytes)
            save_file(part, str(Path(d) / fn))
            wmap.update({k: fn for k in part})
            del part
        (Path(d) / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
        (Path(d) / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"],
                                                         "quantization_config": {"quant_method": "mxfp4"}}))
        stored = sum(f.stat().st_size for f in Path(d).glob("*.safetensors"))
        ref = Path(d) / "reference"
        if "requantize" in a.tools.split(","):          # the experts' bfloat16 values, transformers' [E, K, rows]
            ref.mkdir()
            save_file({name: np.ascontiguousarray(np.repeat(gauss[proj].T[None], E, 0)) for name, proj in names},
                      str(ref / "model.safetensors"))
        bound = 2.0 + 3 * largest / 1e9
        print(f"wrote {len(names)} gpt-oss MXFP4 weights ({elems:.3g} elements, {stored / 1e9:.2f} GB in {shards} "
              f"shards; the largest {largest / 1e9:.2f} GB stored) in {time.perf_counter() - t:.0f} s; the memory "
              f"bound 2 GB + 3 x {largest / 1e9:.2f} GB = {bound:.2f} GB", flush=True)
        res = {"layout": "gpt-oss", "elements": elems, "stored_gb": stored / 1e9, "largest_gb": largest / 1e9,
               "bound_gb": bound}
        for tool in a.tools.split(","):
            args = {"validate": ("fp4sim.validate", ["checkpoint", d]),
                    "analyze": ("fp4sim.analyze", [d, "--no-hadamard", "--quiet", "--json", Path(d) / "a.json",
                                                   "--threads", a.threads]),
                    "requantize": ("fp4sim.analyze", [d, "--requantize", ref, "--schemes", "mxfp4_rceil",
                                                      "--no-hadamard", "--quiet", "--json", Path(d) / "r.json",
                                                      "--threads", a.threads])}
            if tool not in args:
                raise SystemExit(f"--tools: {tool!r} is none of validate, analyze, requantize")
            r = _tool(*args[tool], d)
            if tool == "analyze":                              # what the run covered, from its own summary
                r["analysed"] = len(json.loads((Path(d) / "a.json").read_text())["tensors"])
            if tool == "requantize":
                r["compared"] = len(json.loads((Path(d) / "r.json").read_text())["requantize"]["tensors"])
            r.update(elems_per_s=elems / r["s"], gb_per_s=stored / 1e9 / r["s"], within_bound=r["peak_gb"] <= bound)
            res[tool] = r
            print(f"{tool:8}: {r['s']:7.1f} s, {r['elems_per_s'] / 1e6:6.1f} M elements/s, {r['gb_per_s']:.3f} GB/s "
                  f"stored, peak {r['peak_gb']:.2f} GB ({'within' if r['within_bound'] else 'ABOVE'} the bound)",
                  flush=True)
        out["checkpoint"] = res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--checkpoint-elems", default=None, help="run part 2 instead, with about this many elements")
    ap.add_argument("--workers", default="1,2", help="Dask worker counts of part 2 (CPU only; '' for none)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--layout", choices=("bf16", "gpt-oss"), default="bf16", help="part 2 (bf16) or part 3")
    ap.add_argument("--tools", default="validate,analyze", help="part 3's tools, in order")
    ap.add_argument("--experts", type=int, default=32, help="part 3: experts per weight (gpt-oss-20b: 32)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="part 3: analyze's Numba threads (default: every core, not the idle ones the load average "
                         "gives, so that runs compare)")
    ap.add_argument("--tmp", help="where part 3 writes its folder (default: the system's temporary folder)")
    ap.add_argument("--json")
    a = ap.parse_args()
    out = {}
    if a.checkpoint_elems and a.layout == "gpt-oss":
        gpt_oss(a, out)
    elif a.checkpoint_elems:
        checkpoint(a, out)
    else:
        stages(a, out)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
