"""Emulated training cost, as ratios measured in one run (CPU).

    python benchmarks/bench_training.py [--repeat 3] [--d-model 256] [--only gemm|step] [--json out.json]
    python benchmarks/bench_training.py --model paper [--presets nvfp4_paper,bf16] [--general] [--sizes 128x32,64x64]
                                        [--keep-last 0] [--accumulate fast|exact|hopper|hopper_fast_accum]
                                        [--json out.json]
    python benchmarks/bench_training.py --model paper --import-order torch,numpy,fp4sim [--rounds 2] [...]
    python benchmarks/bench_training.py --model gpt2-124m --device cuda [--presets ...] [--exact-rules] [--json out.json]

1. fp4sim.gemm (exact and fast; for NVFP4 also the hardware accumulation models k64_rtz and exact_sum) for
   M = N = K = 1024 NVFP4 / MXFP4 operands, against a float32 BLAS matmul of the same shape (the quantization of
   the operands is not included).
2. One training step (forward + backward) of a small transformer (d_model, 2 blocks, 128 tokens x 4 sequences)
   under each preset, against the same model in plain torch float32.
``--model paper``: instead, the full optimizer step (forward, backward, AdamW) of the paper_repro GPT (4 blocks,
4 heads, 2 key/value heads, squared-ReLU MLP, no biases) at d_model 128 with 32 x 128 tokens per step and at
d_model 64 with 64 x 128, every block linear under ``Recipe.preset(name, accumulate="fast")``, the head kept in
high precision as paper_repro keeps it, against the same model in plain torch float32; with ``--general`` the
same steps with the fast path turned off (what ``accumulate="fast"`` cost before it) are timed in the same
rounds, so the before / after ratio comes from one run.
``--model gpt2-124m``: the whole AdamW step of a GPT-2-small-shaped model (paper_repro's GPT at d_model 768, 12
layers, 12 heads, vocabulary 50304, 8 sequences of 1024 tokens; the head kept in high precision) on ``--device``
(cuda, or cpu with the size options for a small check) under each preset with ``accumulate="fast"``, against the
same model's BF16 autocast step and float32 step in the same process: ms per step, the ratios, tokens/s, and peak
memory (torch's allocator, and CuPy's memory pool beside it). ``--exact-rules``: also one step each under the exact
GEMM rules (NVFP4 ``tcgen05``, FP8 ``hopper``, NVFP4 ``te_reference``), reported as a step ratio and in ns per
product of the 4- and 8-bit GEMMs (the layers kept in BF16 not counted).
Each ratio's two sides are timed in three alternating rounds (best of --repeat calls each), so a load spike
on a shared machine does not fall on one side only. torch is imported first, as a user's script does.
``--import-order``: each listed order (torch, numpy or fp4sim imported first) in a fresh process of its own,
and the plain float32 step in a process that never imports fp4sim (the baseline of every ratio, and what the
plain step costs where fp4sim is imported: importing fp4sim must not slow torch's own work); the processes
run in turn, ``--rounds`` times, best time of each kept.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ORDERS = {"torch": ("torch", "numpy", "fp4sim"), "numpy": ("numpy", "fp4sim", "torch"),
          "fp4sim": ("fp4sim", "numpy", "torch"), "none": ("torch", "numpy")}


def _import(order: str):
    """Import torch, NumPy and fp4sim in the given order (``none``: no fp4sim), then the benchmark helpers."""
    import importlib
    for name in ORDERS[order]:
        importlib.import_module(name)
    sys.path.insert(0, str(Path(__file__).parent))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3,
                    help="calls per timing, the best kept (default 3); each ratio's sides alternate over 3 rounds")
    ap.add_argument("--d-model", type=int, default=256, help="--model tiny: the model width (default 256)")
    ap.add_argument("--json", help="write the ratios (and, --model paper, tokens/s) to this JSON file")
    ap.add_argument("--only", choices=("gemm", "step"), help="--model tiny: only part 1 (gemm) or part 2 (step)")
    ap.add_argument("--model", choices=("tiny", "paper", "gpt2-124m"), default="tiny",
                    help="tiny (default): fs.gemm at 1024^3 and a 2-block transformer's forward + backward; paper: "
                         "paper_repro's GPT, the whole AdamW step")
    ap.add_argument("--presets", default=ap_default_presets(),
                    help="--model paper: comma-separated Recipe presets to time, each optionally with switches as "
                         "PRESET:KEY=VALUE[:KEY=VALUE] (e.g. nvfp4_paper:scale_format=ue5m3, "
                         "nvfp4_paper:delayed_amax=16) (default: %(default)s; --model gpt2-124m: "
                         f"{GPT2_PRESETS})")
    ap.add_argument("--general", action="store_true",
                    help="--model paper: also time each preset with the fast path off (the general path), in the "
                         "same rounds")
    ap.add_argument("--sizes", default="128x32,64x64",
                    help="--model paper: comma-separated D_MODELxSEQUENCES, each sequence 128 tokens (default "
                         "%(default)s)")
    ap.add_argument("--accumulate", choices=("fast", "exact", "hopper", "hopper_fast_accum"), default="fast",
                    help="--model paper: the recipes' GEMM rule (default fast)")
    ap.add_argument("--keep-last", type=int, default=0,
                    help="--model paper: blocks at the end kept in BF16 (default 0; paper_repro's full mode keeps 1)")
    ap.add_argument("--import-order", help="--model paper: comma-separated orders among torch, numpy, fp4sim, "
                    "each timed in a fresh process against a process without fp4sim; a line per process as it "
                    "finishes and the ratios after every round")
    ap.add_argument("--rounds", type=int, default=2,
                    help="--import-order: rounds of the processes, best time kept (default 2)")
    ap.add_argument("--device", default="cuda", help="--model gpt2-124m: cuda (default) or cpu")
    ap.add_argument("--exact-rules", action="store_true",
                    help="--model gpt2-124m: also the exact GEMM rules (tcgen05, hopper, te_reference), one step each")
    for opt, what in (("--layers", 12), ("--heads", 12), ("--seq", 1024), ("--batch", 8)):
        ap.add_argument(opt, type=int, default=what, help=f"--model gpt2-124m: (default {what})")
    ap.add_argument("--width", type=int, default=768, help="--model gpt2-124m: d_model (default 768)")
    ap.add_argument("--child", choices=tuple(ORDERS), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.import_order:
        return import_orders(a)
    _import(a.child or "torch")
    if a.model == "paper":
        return paper_steps(a)
    if a.model == "gpt2-124m":
        return gpt2_steps(a)
    import fp4sim as fs
    import numpy as np
    import torch
    from _common import best_alternating
    from fp4sim.torch import convert
    from fp4sim.training import Recipe
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from test_training import TinyGPT

    out = {"gemm": {}, "step": {}}
    rng = np.random.default_rng(0)
    A = rng.standard_normal((1024, 1024)).astype(np.float32)
    B = rng.standard_normal((1024, 1024)).astype(np.float32)
    for scheme in ("nvfp4", "mxfp4") if a.only != "step" else ():
        qa, qb = fs.quantize(A, scheme), fs.quantize(B, scheme)
        for acc in ("exact", "k64_rtz", "exact_sum", "fast") if scheme == "nvfp4" else ("exact", "fast"):
            t_blas, t = best_alternating([lambda: A @ B.T, lambda: fs.gemm(qa, qb, accumulate=acc)], a.repeat)
            out["gemm"][f"{scheme}_{acc}"] = t / t_blas
            print(f"gemm {scheme:6} {acc:9}: {t * 1e3:8.1f} ms = {t / t_blas:5.2f}x BLAS (float32 BLAS matmul "
                  f"1024^3 in alternating rounds: {t_blas * 1e3:.1f} ms)")

    d = a.d_model
    idx = torch.randint(0, 32, (4, 129), generator=torch.Generator().manual_seed(0))

    def step_fn(model):
        def f():
            logits = model(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), idx[:, 1:].reshape(-1))
            model.zero_grad(set_to_none=True)
            loss.backward()
        return f

    torch.manual_seed(0)
    base = step_fn(TinyGPT(d=d, heads=4))
    for preset in ("none", "bf16", "nvfp4_paper", "mxfp4_paper", "mxfp8", "fp8_blockwise") if a.only != "gemm" else ():
        for acc in ("exact", "fast"):
            if preset == "none" and acc == "fast":
                continue
            torch.manual_seed(0)
            rec = "none" if preset == "none" else Recipe.preset(preset, accumulate=acc)
            m = convert(TinyGPT(d=d, heads=4), rec)
            t0, t = best_alternating([base, step_fn(m)], a.repeat)
            key = preset if preset == "none" else f"{preset}_{acc}"
            out["step"][key] = t / t0
            print(f"step {key:22}: {t * 1e3:8.1f} ms = {t / t0:5.2f}x plain torch (its float32 step in "
                  f"alternating rounds, d_model {d}: {t0 * 1e3:.1f} ms)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


def import_orders(a):
    """Each order in a fresh process (``--child ORDER``), and the plain step in one without fp4sim, in turn,
    ``a.rounds`` times; prints and returns the ratios to the fp4sim-free process's plain step."""
    orders = a.import_order.split(",")
    bad = [o for o in orders if o not in ORDERS or o == "none"]
    if bad:
        raise SystemExit(f"--import-order {a.import_order}: give orders among torch, numpy, fp4sim")
    args = ["--model", "paper", "--repeat", str(a.repeat), "--sizes", a.sizes, "--presets", a.presets,
            "--accumulate", a.accumulate, "--keep-last", str(a.keep_last)]
    best: dict = {}
    import time
    n = a.rounds * (len(orders) + 1)
    i = 0
    t_start = time.perf_counter()
    for r in range(a.rounds):
        for order in ["none"] + orders:
            i += 1
            t0 = time.perf_counter()
            print(f"[{i}/{n}] round {r + 1}/{a.rounds}: the {order if order != 'none' else 'fp4sim-free'}"
                  f"{'-first' if order != 'none' else ''} process ...", end="", flush=True, file=sys.stderr)
            out = subprocess.run([sys.executable, __file__, *args, "--child", order], capture_output=True,
                                 text=True)
            if out.returncode:
                raise SystemExit(f"the {order}-first process failed:\n{out.stderr[-3000:]}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            for key, t in got["time"].items():
                k = (order, key)
                best[k] = min(best.get(k, float("inf")), t)
            el = time.perf_counter() - t_start
            print(f" {time.perf_counter() - t0:.0f} s (about {el / i * (n - i):.0f} s left)", flush=True,
                  file=sys.stderr)
        if r + 1 < a.rounds:
            print(f"after round {r + 1} of {a.rounds} (best so far):", flush=True)
            _order_table(a, orders, best)
    print(f"after {a.rounds} round{'s' * (a.rounds > 1)}:", flush=True)
    return _order_table(a, orders, best)


def _order_table(a, orders, best):
    """Print and return the ratios to the fp4sim-free process's plain step, from the best times so far."""
    res = {"baseline_plain_s": {}, "orders": {}}
    for size in a.sizes.split(","):
        d, B = (int(v) for v in size.split("x"))
        tok = B * 128
        t0 = best[("none", f"d{d}_B{B}_plain")]
        res["baseline_plain_s"][size] = t0
        print(f"d_model {d}, {B} x 128 tokens: plain float32 step without fp4sim in the process {t0 * 1e3:.1f} ms "
              f"({tok / t0:.0f} tokens/s)", flush=True)
        for order in orders:
            tp = best[(order, f"d{d}_B{B}_plain")]
            row = {"plain": tp / t0}
            line = f"  {order:6} first: plain step {tp / t0:5.2f}x"
            for preset in a.presets.split(","):
                t = best[(order, f"d{d}_B{B}_{preset}")]
                row[preset] = t / t0
                line += f", {preset} {t / t0:5.2f}x ({tok / t:.0f} tokens/s)"
            res["orders"].setdefault(size, {})[order] = row
            print(line, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


def _preset_spec(spec: str):
    """("nvfp4_paper", {"scale_format": "ue5m3"}) from "nvfp4_paper:scale_format=ue5m3" (values read as Python
    literals where they are one, else as strings)."""
    import ast
    name, *kvs = spec.split(":")
    sw = {}
    for kv in kvs:
        k, _, v = kv.partition("=")
        try:
            sw[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            sw[k] = v
    return name, sw


GPT2_PRESETS = "nvfp4_paper,mxfp4_paper,fp8_blockwise"
EXACT_RULES = ("nvfp4_paper:accumulate=tcgen05", "fp8_blockwise:accumulate=hopper", "nvfp4_paper:accumulate=te_reference")


def gpt2_steps(a):
    """The GPT-2-small-shaped step on ``a.device``: float32, BF16 autocast and each preset (see the docstring)."""
    import time

    import torch
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from paper_repro.model import GPT, GPTConfig, build
    from paper_repro.train import make_recipe

    from fp4sim.torch import QuantLinear
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu with a small --width/--layers)")
    c = GPTConfig(vocab=50304, d_model=a.width, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.heads, ctx=a.seq)
    B = a.batch
    idx = torch.randint(0, c.vocab, (B, c.ctx + 1), generator=torch.Generator().manual_seed(0)).to(dev)
    presets = a.presets if a.presets != ap_default_presets() else GPT2_PRESETS
    specs = [(p, "fast") for p in presets.split(",")] + ([(r, None) for r in EXACT_RULES] if a.exact_rules else [])

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def pool_bytes():
        if not cuda:
            return 0
        try:
            import cupy
            return int(cupy.get_default_memory_pool().total_bytes())
        except ImportError:
            return 0

    def timed(kind, spec=None, acc=None, repeat=a.repeat):
        torch.manual_seed(0)
        if spec is None:
            model = GPT(c)
        else:
            name, sw = _preset_spec(spec)
            rule = sw.pop("accumulate", acc)
            model = build(c, make_recipe(name, sw, 0, 0, rule), 0)
        model = model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        autocast = kind == "bf16_autocast"

        def step():
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                logits = model(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, c.vocab), idx[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss
        loss = step()                              # compiles the kernels, allocates the optimizer state
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            loss = step()
            sync()
            times.append(time.perf_counter() - t0)
        products = 3 * B * c.ctx * sum(m.in_features * m.out_features for m in model.modules()
                                       if isinstance(m, QuantLinear) and m.recipe.fprop_x.scheme != "bf16")
        row = {"ms": 1e3 * min(times), "median_ms": 1e3 * sorted(times)[len(times) // 2],
               "tokens_per_s": B * c.ctx / min(times), "loss": float(loss.detach()), "quantized_products": products,
               "peak_torch_bytes": int(torch.cuda.max_memory_allocated()) if cuda else None,
               "cupy_pool_bytes": pool_bytes()}
        del model, opt
        if cuda:
            torch.cuda.empty_cache()
        return row

    out = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
           "config": {"d_model": c.d_model, "layers": c.n_layers, "heads": c.n_heads, "vocab": c.vocab,
                      "seq": c.ctx, "batch": B}, "rows": {}}
    print(f"{out['device']}: GPT d_model {c.d_model}, {c.n_layers} layers, {c.n_heads} heads, {B} x {c.ctx} tokens "
          "per step, AdamW", flush=True)
    rows = out["rows"]
    for kind in ("float32", "bf16_autocast"):
        rows[kind] = timed(kind)
        print(f"  {kind:40} {rows[kind]['ms']:9.1f} ms  {rows[kind]['tokens_per_s']:9.0f} tokens/s", flush=True)
    for spec, acc in specs:
        key = spec if acc is None else f"{spec}_{acc}"
        try:
            r = rows[key] = timed("emulated", spec, acc, repeat=a.repeat if acc else 1)
        except Exception as e:  # noqa: BLE001 - report a failing variant and go on with the others
            rows[key] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"  {key:40} failed: {rows[key]['error']}", flush=True)
            continue
        r["vs_bf16"] = r["ms"] / rows["bf16_autocast"]["ms"]
        r["vs_float32"] = r["ms"] / rows["float32"]["ms"]
        r["ns_per_product"] = 1e9 * r["ms"] / 1e3 / r["quantized_products"] if r["quantized_products"] else None
        mem = ""
        if cuda:
            r["peak_vs_bf16"] = ((r["peak_torch_bytes"] + r["cupy_pool_bytes"]) /
                                 (rows["bf16_autocast"]["peak_torch_bytes"] + rows["bf16_autocast"]["cupy_pool_bytes"]))
            mem = f", peak memory {r['peak_vs_bf16']:.2f}x BF16's (torch + CuPy pool)"
        print(f"  {key:40} {r['ms']:9.1f} ms  {r['tokens_per_s']:9.0f} tokens/s = {r['vs_bf16']:.2f}x the BF16 step, "
              f"{r['vs_float32']:.2f}x float32; {r['ns_per_product']:.3g} ns per quantized product{mem}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


def ap_default_presets() -> str:
    return "bf16,nvfp4_paper,mxfp4_paper,mxfp8,fp8_blockwise"


def paper_steps(a):
    import torch
    from _common import best
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from paper_repro.model import GPT, GPTConfig

    child = a.child is not None
    if child and a.child == "none":
        fastpath = build = make_recipe = None
    else:
        from fp4sim import fastpath
        from paper_repro.model import build
        from paper_repro.train import make_recipe
    from _common import best_alternating

    out = {"step": {}, "tokens_per_s": {}, "threads": torch.get_num_threads(), "time": {}}
    for size in a.sizes.split(","):
        d, B = (int(v) for v in size.split("x"))
        c = GPTConfig(d_model=d, n_layers=4)
        idx = torch.randint(0, c.vocab, (B, c.ctx + 1), generator=torch.Generator().manual_seed(0))

        def step_fn(model, fast=True):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

            def f():
                old = fastpath._set_enabled(fast) if fastpath else None
                try:
                    logits = model(idx[:, :-1])
                    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, c.vocab), idx[:, 1:].reshape(-1))
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                finally:
                    if fastpath:
                        fastpath._set_enabled(old)
            return f

        torch.manual_seed(0)
        base = step_fn(GPT(c))                       # plain float32 (what build(c, "none", 0) gives)
        if child:
            out["time"][f"d{d}_B{B}_plain"] = best(base, a.repeat)
            if a.child == "none":
                continue
            for preset in a.presets.split(","):
                f = step_fn(build(c, make_recipe(*_preset_spec(preset), a.keep_last, 0, a.accumulate), 0))
                out["time"][f"d{d}_B{B}_{preset}"] = best(f, a.repeat)
                out["time"][f"d{d}_B{B}_plain"] = min(out["time"][f"d{d}_B{B}_plain"], best(base, a.repeat))
            continue
        for preset in a.presets.split(","):
            rec = make_recipe(*_preset_spec(preset), a.keep_last, 0, a.accumulate)
            fns = [base, step_fn(build(c, rec, 0))]
            if a.general:
                fns.append(step_fn(build(c, rec, 0), fast=False))
            ts = best_alternating(fns, a.repeat)
            t0, t = ts[0], ts[1]
            key = f"d{d}_B{B}_{preset}" + ("" if a.accumulate == "fast" else "_" + a.accumulate)
            tok = B * c.ctx
            out["step"][key] = t / t0
            out["tokens_per_s"][key] = {"emulated": tok / t, "plain": tok / t0}
            line = (f"step {key:24}: {t * 1e3:7.1f} ms = {t / t0:5.2f}x plain float32 ({t0 * 1e3:6.1f} ms); "
                    f"{tok / t:7.0f} vs {tok / t0:7.0f} tokens/s")
            if a.general:
                out["step"][key + "_general"] = ts[2] / t0
                out["tokens_per_s"][key]["general"] = tok / ts[2]
                line += f"; fast path off: {ts[2] / t0:5.2f}x ({tok / ts[2]:6.0f} tokens/s)"
            print(line, flush=True)
    if child:
        print(json.dumps({"time": out["time"]}))
        return out
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
