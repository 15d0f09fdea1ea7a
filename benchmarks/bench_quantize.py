"""NVFP4 / MXFP4 quantize, fake-quantize, dequantize and RHT throughput on a 4096x4096 float32 tensor, as ratios
to baselines measured in the same run: (a) a Numba streaming kernel that reads float32 and writes uint8 (the
memory-bound floor), timed in alternating rounds with each operation (so a load spike moves both sides), (b)
torchao's ``nvfp4_quantize`` eager and under ``torch.compile`` (when torch/torchao are installed). The SR / RNE
ratios likewise time the two calls in alternating rounds.

    python benchmarks/bench_quantize.py [--n 4096] [--repeat 5] [--no-torch] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import numba as nb
import numpy as np

import fp4sim as fs
from _common import best, best_alternating, stream_f32_to_u8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((a.n, a.n)) * np.exp(rng.standard_normal((a.n, 1)))).astype(np.float32)
    out = np.empty(x.size, np.uint8)
    rbits = rng.integers(0, 256, x.shape, dtype=np.uint8)
    t_stream = best(lambda: stream_f32_to_u8(x.reshape(-1), out), a.repeat)
    res = {"numba_threads": nb.get_num_threads(), "n": a.n, "stream_ms": t_stream * 1e3, "rows": []}
    torch_t = {}
    if not a.no_torch:
        try:
            os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
            import torch
            from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
            xt = torch.from_numpy(x)

            def eager():
                return nvfp4_quantize(xt, 16, per_tensor_amax_to_scale(xt.abs().amax()))
            torch_t["torchao eager"] = best(eager, a.repeat)
            comp = torch.compile(eager)
            comp()  # compile outside the timing
            torch_t["torchao compiled"] = best(comp, a.repeat)
            res["torch_threads"] = torch.get_num_threads()
        except Exception as e:  # noqa: BLE001 - report, do not fail a benchmark
            print(f"torch baselines unavailable: {type(e).__name__}: {e}")
    print(f"tensor {a.n}x{a.n} float32, numba threads {res['numba_threads']}")
    print(f"baseline (a) numba stream f32->u8: {t_stream * 1e3:8.2f} ms (before the operations; each row gives its own)")
    for k, v in torch_t.items():
        print(f"baseline (b) {k:20}: {v * 1e3:8.2f} ms")
    print(f"{'op':34} {'ms':>8} {'vs stream':>10} {'vs ao eager':>12} {'vs ao compiled':>15}")
    ops = [("quantize nvfp4", lambda: fs.quantize(x, "nvfp4")),
           ("quantize nvfp4 torchao flavour", lambda: fs.quantize(x, "nvfp4", flavor="torchao")),
           ("quantize nvfp4 sr (seed)", lambda: fs.quantize(x, "nvfp4", rounding="sr", seed=1)),
           ("quantize nvfp4 sr (rbits)", lambda: fs.quantize(x, "nvfp4", rounding="sr", rbits=rbits)),
           ("quantize nvfp4 along axis 0", lambda: fs.quantize(x, "nvfp4", axis=0)),
           ("quantize nvfp4 sr (seed) axis 0", lambda: fs.quantize(x, "nvfp4", axis=0, rounding="sr", seed=1)),
           ("quantize nvfp4_2d", lambda: fs.quantize(x, "nvfp4_2d")),
           ("quantize mxfp4", lambda: fs.quantize(x, "mxfp4")),
           ("quantize mxfp4 sr (seed)", lambda: fs.quantize(x, "mxfp4", rounding="sr", seed=1)),
           ("fake_quantize nvfp4", lambda: fs.fake_quantize(x, "nvfp4")),
           ("fake_quantize nvfp4_2d", lambda: fs.fake_quantize(x, "nvfp4_2d")),
           ("fake_quantize mxfp4", lambda: fs.fake_quantize(x, "mxfp4")),
           ("dequantize nvfp4", (lambda q: lambda: fs.dequantize(q))(fs.quantize(x, "nvfp4"))),
           ("dequantize mxfp4", (lambda q: lambda: fs.dequantize(q))(fs.quantize(x, "mxfp4"))),
           ("rht d=16 (bf16 out)", lambda: fs.rht(x, 16)),
           ("rht d=16 (fp32 out)", lambda: fs.rht(x, 16, out="fp32")),
           ("rht d=16 along axis 0", lambda: fs.rht(x, 16, axis=0))]
    def stream():
        stream_f32_to_u8(x.reshape(-1), out)

    for name, fn in ops:
        ts, t = best_alternating([stream, fn], a.repeat)
        row = {"op": name, "ms": t * 1e3, "stream_ms": ts * 1e3, "vs_stream": ts / t}
        for k, v in torch_t.items():
            row["vs_" + k.replace(" ", "_")] = v / t
        res["rows"].append(row)
        e = f"{row.get('vs_torchao_eager', float('nan')):12.2f}"
        c = f"{row.get('vs_torchao_compiled', float('nan')):15.2f}"
        print(f"{name:34} {t * 1e3:8.2f} {ts / t:10.2f} {e} {c}   (stream {ts * 1e3:.2f} ms)")
    fns = dict(ops)
    res["sr_vs_rne"] = {}
    for sr, rne in (("quantize nvfp4 sr (seed)", "quantize nvfp4"), ("quantize nvfp4 sr (rbits)", "quantize nvfp4"),
                    ("quantize nvfp4 sr (seed) axis 0", "quantize nvfp4 along axis 0"),
                    ("quantize mxfp4 sr (seed)", "quantize mxfp4")):
        t_rne, t_sr = best_alternating([fns[rne], fns[sr]], a.repeat)
        res["sr_vs_rne"][sr] = t_sr / t_rne
        print(f"{sr} / {rne}: {t_sr / t_rne:.2f}x (alternating: {t_sr * 1e3:.2f} / {t_rne * 1e3:.2f} ms)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
