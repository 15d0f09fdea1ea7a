"""One training run: a tiny GPT under one fp4sim recipe, checkpointed, resumable and deterministic.

A run is a :class:`RunConfig`; its directory holds ``ckpt.pt`` (model, optimizer, step, the log so far and each
QuantLinear's call counter, which keys its stochastic rounding), ``log.csv`` once finished and ``done.json``.
Restarting a killed run resumes from its last checkpoint and produces the same rows, bit for bit, as an
uninterrupted run: batches depend on (seed, step) only, and everything else that evolves is in the checkpoint.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import data
from .model import GPTConfig, build

COLUMNS = ("step", "tokens", "lr", "train_loss", "val_loss")


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run's numbers.

    preset / switches: :meth:`fp4sim.training.Recipe.preset` name and its switches or fields (``"none"``: plain
    float32 ``nn.Linear``); keep_last: transformer blocks at the end kept in BF16 (the head always is);
    tokens: training tokens (steps = tokens // (batch * ctx)); lr: peak AdamW learning rate (betas 0.9/0.95,
    weight decay 0.1, gradient clipping at 1.0) with a warmup-stable-decay schedule: linear warmup over
    ``warmup`` steps, constant, then linear decay to zero over the last ``decay_frac`` of the steps;
    eval_points: validation evaluations spread evenly over the run (the last at the final step) on
    ``val_windows`` fixed windows of the validation text.
    """
    preset: str = "nvfp4_paper"
    switches: tuple = ()
    keep_last: int = 1
    seed: int = 0
    tokens: int = 400_000
    batch: int = 16
    model: GPTConfig = field(default_factory=GPTConfig)
    lr: float = 2e-3
    warmup: int = 10
    decay_frac: float = 0.2
    eval_points: int = 12
    val_windows: int = 96
    accumulate: str = "fast"

    def __post_init__(self):
        if isinstance(self.model, dict):
            object.__setattr__(self, "model", GPTConfig(**self.model))
        object.__setattr__(self, "switches", tuple(tuple(kv) for kv in self.switches))
        if self.steps < 2:
            raise ValueError(f"tokens={self.tokens} gives {self.steps} steps of {self.batch}x{self.model.ctx} tokens; "
                             "give at least two steps' worth")
        if not 0 <= self.decay_frac < 1:
            raise ValueError(f"decay_frac={self.decay_frac}: a fraction in [0, 1)")
        if self.eval_points < 1 or self.eval_points > self.steps:
            raise ValueError(f"eval_points={self.eval_points}: between 1 and the number of steps ({self.steps})")

    @property
    def steps(self) -> int:
        return self.tokens // (self.batch * self.model.ctx)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "RunConfig":
        return cls(**json.loads(s))

    def key(self) -> str:
        h = hashlib.sha1(self.to_json().encode()).hexdigest()[:10]
        sw = "".join(f"-{k}" + ("" if v is True else f"{v}") for k, v in self.switches)
        return f"{self.preset}{sw}-t{self.tokens}-s{self.seed}-{h}"

    def recipe(self):
        from fp4sim.training import Recipe
        if self.preset == "none":
            return "none"
        return Recipe.preset(self.preset, keep=("head",), keep_last=self.keep_last, seed=self.seed,
                             accumulate=self.accumulate, **dict(self.switches))

    def eval_steps(self) -> list[int]:
        return sorted({max(1, round(self.steps * (i + 1) / self.eval_points)) for i in range(self.eval_points)})


def wsd_lr(step: int, steps: int, lr: float, warmup: int, decay_frac: float) -> float:
    """Warmup-stable-decay: the learning rate of optimizer step ``step`` (0-based) of ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    decay_start = steps - int(round(decay_frac * steps))
    if step >= decay_start and steps > decay_start:
        return lr * (steps - step) / (steps - decay_start + 1)
    return lr


def _quant_layers(model):
    from fp4sim.torch import QuantLinear
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _fmt(v) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def rows_to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _fmt(r[k]) for k in COLUMNS})
    return buf.getvalue()


def read_log(run_dir: Path) -> list[dict]:
    with open(run_dir / "log.csv", newline="") as f:
        return [{"step": int(r["step"]), "tokens": int(r["tokens"]), "lr": float(r["lr"]),
                 "train_loss": float(r["train_loss"]), "val_loss": float(r["val_loss"])} for r in csv.DictReader(f)]


def is_done(run_dir: Path, cfg: RunConfig) -> bool:
    p = run_dir / "done.json"
    return p.is_file() and json.loads(p.read_text()).get("config") == json.loads(cfg.to_json())


def _atomic_write(path: Path, payload: bytes):
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, path)


def train(cfg: RunConfig, run_dir: Path, *, ckpt_seconds: float = 120.0, ckpt_every: int | None = None,
          progress=None, stop_after: int | None = None) -> list[dict]:
    """Train (or resume, or just read) the run; return its log rows.

    ckpt_seconds / ckpt_every: checkpoint after this much wall time or every this many steps (and at the end);
    progress(step_tokens, loss): called after every step; stop_after: return after this many steps of this call
    without finishing (an interruption, for tests) — the last checkpoint is where a later call resumes.
    """
    import torch
    import torch.nn.functional as F

    run_dir = Path(run_dir)
    if is_done(run_dir, cfg):
        return read_log(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    train_ids, val_ids = data.splits()
    val = torch.from_numpy(data.val_windows(val_ids, cfg.val_windows, cfg.model.ctx))
    model = build(cfg.model, cfg.recipe(), cfg.seed)
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    qlayers = _quant_layers(model)
    step, rows, acc = 0, [], []
    ckpt = run_dir / "ckpt.pt"
    if ckpt.is_file():
        st = torch.load(ckpt, weights_only=False)
        if st["config"] != cfg.to_json():
            raise ValueError(f"{ckpt} belongs to another configuration; remove {run_dir} to start afresh")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, rows, acc = st["step"], st["rows"], st["acc"]
        for n, c in st["calls"].items():
            qlayers[n]._calls = c
    (run_dir / "config.json").write_text(cfg.to_json() + "\n")

    def save():
        buf = io.BytesIO()
        torch.save({"config": cfg.to_json(), "model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "rows": rows, "acc": acc, "calls": {n: m._calls for n, m in qlayers.items()}}, buf)
        _atomic_write(ckpt, buf.getvalue())

    def evaluate() -> float:
        model.eval()
        tot = 0.0
        with torch.no_grad():
            for i in range(0, len(val), cfg.batch):
                w = val[i:i + cfg.batch]
                logits = model(w[:, :-1])
                tot += float(F.cross_entropy(logits.reshape(-1, cfg.model.vocab), w[:, 1:].reshape(-1),
                                             reduction="sum"))
        model.train()
        return tot / (len(val) * cfg.model.ctx)

    evals = set(cfg.eval_steps())
    tokens_per_step = cfg.batch * cfg.model.ctx
    last_ckpt, done_here = time.monotonic(), 0
    while step < cfg.steps:
        lr = wsd_lr(step, cfg.steps, cfg.lr, cfg.warmup, cfg.decay_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        b = torch.from_numpy(data.train_batch(train_ids, cfg.seed, step, cfg.batch, cfg.model.ctx))
        logits = model(b[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.model.vocab), b[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        lv = float(loss.detach())
        acc.append(lv)
        if step in evals:
            rows.append({"step": step, "tokens": step * tokens_per_step, "lr": lr,
                         "train_loss": float(np.mean(acc)) if acc else math.nan, "val_loss": evaluate()})
            acc = []
        done_here += 1
        if progress is not None:
            progress(tokens_per_step, lv)
        now = time.monotonic()
        if step == cfg.steps or (ckpt_every and step % ckpt_every == 0) or \
                (not ckpt_every and now - last_ckpt >= ckpt_seconds):
            save()
            last_ckpt = now
        if stop_after is not None and done_here >= stop_after and step < cfg.steps:
            return rows
    _atomic_write(run_dir / "log.csv", rows_to_csv(rows).encode())
    _atomic_write(run_dir / "done.json", json.dumps({"config": json.loads(cfg.to_json())}).encode())
    ckpt.unlink(missing_ok=True)
    return rows
