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
    ``val_windows`` fixed windows of the validation text. log_wgrad_error / log_fidelity: at each evaluation,
    log every quantized layer's relative Wgrad GEMM error / every QuantLinear's weight-gradient SNR and cosine
    against float32 (:func:`fidelity`) on the first validation batch, into ``wgrad_error.csv`` /
    ``fidelity.csv``; neither changes the run's training. nproc: data-parallel processes (DDP under torchrun,
    each taking every nproc-th sequence of the batch and drawing its own stochastic rounding): another run than
    the single-process one, with its own key.
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
    phases: tuple = ()
    keep_first: int = 0
    operands: tuple = ()
    log_wgrad_error: bool = False
    eval_tokens: tuple = ()
    log_fidelity: bool = False
    nproc: int = 1

    def __post_init__(self):
        if isinstance(self.model, dict):
            object.__setattr__(self, "model", GPTConfig(**self.model))
        object.__setattr__(self, "switches", tuple(tuple(kv) for kv in self.switches))
        object.__setattr__(self, "phases", tuple(Phase(*p) if not isinstance(p, Phase) else p for p in self.phases))
        object.__setattr__(self, "operands", tuple((op, sch, tuple(b) if b else None, rnd)
                                                   for op, sch, b, rnd in self.operands))
        object.__setattr__(self, "eval_tokens", tuple(int(t) for t in self.eval_tokens))
        if any(t < 1 for t in self.eval_tokens):
            raise ValueError(f"eval_tokens={self.eval_tokens}: token counts of at least 1")
        last = 1
        for ph in self.phases:
            at = ph.step(self.tokens // (self.batch * self.model.ctx))
            if at < last:
                raise ValueError(f"phase at {ph.at:g} of the run: phases need non-decreasing positions")
            last = at
        if self.steps < 2:
            raise ValueError(f"tokens={self.tokens} gives {self.steps} steps of {self.batch}x{self.model.ctx} tokens; "
                             "give at least two steps' worth")
        if not isinstance(self.nproc, int) or self.nproc < 1 or self.batch % self.nproc:
            raise ValueError(f"nproc={self.nproc}: a number of data-parallel processes that divides the batch "
                             f"({self.batch})")
        if not 0 <= self.decay_frac < 1:
            raise ValueError(f"decay_frac={self.decay_frac}: a fraction in [0, 1)")
        if self.eval_points < 1 or self.eval_points > self.steps:
            raise ValueError(f"eval_points={self.eval_points}: between 1 and the number of steps ({self.steps})")

    @property
    def steps(self) -> int:
        return self.tokens // (self.batch * self.model.ctx)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["phases"] = [list(dataclasses.astuple(p)) for p in self.phases]
        d["operands"] = [list(o) for o in self.operands]
        d["eval_tokens"] = list(self.eval_tokens)
        for k, v in OPTIONAL.items():       # at their defaults these fields are left out, so runs configured
            if d[k] == v:                   # before they existed keep their keys (a hash of this JSON)
                del d[k]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "RunConfig":
        return cls(**json.loads(s))

    def parent(self) -> "RunConfig":
        """The run this one branches from: the same configuration without its phases (its first phase step is
        the branch point; up to there both runs are the same run)."""
        return dataclasses.replace(self, phases=())

    def key(self) -> str:
        h = hashlib.sha1(self.to_json().encode()).hexdigest()[:10]
        sw = "".join(f"-{k}" + ("" if v is True else f"{v}") for k, v in self.switches)
        ph = f"-{len(self.phases)}ph" if self.phases else ""
        return f"{self.preset}{sw}{ph}-t{self.tokens}-s{self.seed}-{h}"

    def recipe(self, preset=None, switches=None, keep_last=None):
        """The fp4sim Recipe of this run (or of a phase's preset / switches / kept blocks)."""
        return make_recipe(self.preset if preset is None else preset, self.switches if switches is None else switches,
                           self.keep_last if keep_last is None else keep_last, self.seed, self.accumulate,
                           self.keep_first, self.operands if preset is None else ())

    def eval_steps(self) -> list[int]:
        """The steps after which the run evaluates: ``eval_points`` spread over the run, or, with ``eval_tokens``,
        the steps those token counts fall in (a grid shared by runs of different lengths) and the last step."""
        if self.eval_tokens:
            tps = self.batch * self.model.ctx
            return sorted({t // tps for t in self.eval_tokens if 1 <= t // tps <= self.steps} | {self.steps})
        return sorted({max(1, round(self.steps * (i + 1) / self.eval_points)) for i in range(self.eval_points)})

    def decay_step(self) -> int:
        """The first step of the learning-rate decay (:func:`wsd_lr`)."""
        return self.steps - int(round(self.decay_frac * self.steps))

    def prefix_json(self) -> str | None:
        """What determines the run up to its decay, for runs that evaluate on a shared ``eval_tokens`` grid and
        have no phases: the configuration without its length (runs that differ only in ``tokens`` are one run
        until the shorter one's decay starts: the same warmup and constant rate, batches, evaluations and SR
        call counts). None for other runs."""
        if not self.eval_tokens or self.phases:
            return None
        d = json.loads(self.to_json())
        del d["tokens"]
        return json.dumps(d, sort_keys=True)

    def prefix_key(self) -> str | None:
        j = self.prefix_json()
        return None if j is None else "prefix-" + hashlib.sha1(j.encode()).hexdigest()[:10]


OPTIONAL = {"phases": [], "keep_first": 0, "operands": [], "log_wgrad_error": False, "eval_tokens": [],
            "log_fidelity": False, "nproc": 1}


def make_recipe(preset, switches, keep_last, seed, accumulate, keep_first=0, operands=()):
    """A preset with its switches, the head and the first/last blocks in BF16, and ``operands``: (operand name,
    scheme or None, block or None, rounding) overrides of single GEMM operands."""
    from fp4sim.training import Operand, Recipe
    if preset == "none":
        return "none"
    ops = {op: Operand(sch, blk, rnd) for op, sch, blk, rnd in operands}
    return Recipe.preset(preset, keep=("head",), keep_last=keep_last, keep_first=keep_first, seed=seed,
                         accumulate=accumulate, **dict(switches), **ops)


@dataclass(frozen=True)
class Phase:
    """From ``at`` (a fraction of the run's steps) on, train under another recipe: ``which="both"`` re-converts
    every layer (the preset, switches and kept blocks all change: a branch of the paper's ablations), ``"forward"``
    or ``"backward"`` switch only Fprop or only Dgrad/Wgrad of the quantized layers (the paper's late switch to
    BF16)."""
    at: float
    preset: str
    switches: tuple = ()
    keep_last: int = 1
    which: str = "both"

    def __post_init__(self):
        object.__setattr__(self, "switches", tuple(tuple(kv) for kv in self.switches))
        if self.which not in ("both", "forward", "backward"):
            raise ValueError(f"Phase which={self.which!r}: use 'both', 'forward' or 'backward'")
        if not 0 < self.at < 1:
            raise ValueError(f"Phase at={self.at!r}: a fraction of the run strictly between 0 and 1")

    def step(self, steps: int) -> int:
        """The step it starts at: round(at * steps), kept inside the run (1 .. steps - 1) for short runs."""
        return min(max(int(round(self.at * steps)), 1), steps - 1)


def apply_phase(model, cfg: "RunConfig", ph: Phase):
    from fp4sim.torch import convert, set_recipe
    rec = cfg.recipe(ph.preset, ph.switches, ph.keep_last)
    if ph.which == "both":
        convert(model, rec)
    else:
        set_recipe(model, rec, which=ph.which)


# A run has diverged when its training loss is not finite, or when its mean over the last DIVERGE_WINDOW steps
# exceeds the lowest such mean so far by more than DIVERGE_NATS: it stops there and says so in done.json.
DIVERGE_WINDOW, DIVERGE_NATS = 5, 1.0


def divergence(losses) -> str | None:
    """Why a training-loss history counts as diverged (None while it does not)."""
    if not losses:
        return None
    if not math.isfinite(losses[-1]):
        return f"training loss {losses[-1]} at step {len(losses)}"
    if len(losses) < DIVERGE_WINDOW:
        return None
    w = np.convolve(np.asarray(losses, np.float64), np.ones(DIVERGE_WINDOW) / DIVERGE_WINDOW, mode="valid")
    if w[-1] - w.min() > DIVERGE_NATS:
        return (f"training loss (mean of {DIVERGE_WINDOW} steps) {w[-1]:.3f} at step {len(losses)}, "
                f"{w[-1] - w.min():.2f} nats above its lowest {w.min():.3f}")
    return None


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


def wgrad_errors(model, windows, vocab: int) -> dict:
    """Each quantized layer's relative Wgrad GEMM error (fp4sim.torch.suggest_high_precision, the paper's App. E.2
    diagnostic) for one forward and backward pass on ``windows`` (token ids, shape (batch, ctx + 1)), against the
    float64 product of the same operands; layers kept in BF16 are left out. The model is left exactly as it was:
    gradients, and the call counters that key stochastic rounding, are restored."""
    import torch.nn.functional as F

    from fp4sim.torch import suggest_high_precision
    qlayers = _quant_layers(model)
    calls = {n: m._calls for n, m in qlayers.items()}

    def fwd_bwd():
        F.cross_entropy(model(windows[:, :-1]).reshape(-1, vocab), windows[:, 1:].reshape(-1)).backward()
    try:
        _, rel = suggest_high_precision(model, fwd_bwd, fraction=1.0)
    finally:
        for n, c in calls.items():
            qlayers[n]._calls = c
    return {n: float(v) for n, v in rel.items() if not getattr(qlayers[n], "_fp4sim_kept", False)}


def fidelity(model, windows, vocab: int) -> dict:
    """Each QuantLinear's weight-gradient fidelity (fp4sim.torch.gradient_fidelity: the same forward and backward
    pass on ``windows`` once as the model is and once in float32, kept layers included): {layer: (snr, cosine)}.
    The model is left exactly as it was (parameters, gradients, SR call counts)."""
    import torch.nn.functional as F

    from fp4sim.torch import gradient_fidelity

    def fwd_bwd():
        F.cross_entropy(model(windows[:, :-1]).reshape(-1, vocab), windows[:, 1:].reshape(-1)).backward()
    ds = gradient_fidelity(model, fwd_bwd)
    return {str(n): (float(s), float(c)) for n, s, c in zip(ds.layer.values, ds.snr.values, ds.cosine.values)}


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
    """A finished run's rows (with its per-layer Wgrad errors, where it logged them)."""
    with open(run_dir / "log.csv", newline="") as f:
        rows = [{"step": int(r["step"]), "tokens": int(r["tokens"]), "lr": float(r["lr"]),
                 "train_loss": float(r["train_loss"]), "val_loss": float(r["val_loss"])} for r in csv.DictReader(f)]
    f = Path(run_dir) / "fidelity.csv"
    if f.is_file():
        by_step = {}
        with open(f, newline="") as fh:
            for r in csv.DictReader(fh):
                by_step.setdefault(int(r["step"]), {})[r["layer"]] = (float(r["snr"]), float(r["cosine"]))
        for r in rows:
            if r["step"] in by_step:
                r["fidelity"] = by_step[r["step"]]
    w = Path(run_dir) / "wgrad_error.csv"
    if w.is_file():
        by_step = {}
        with open(w, newline="") as f:
            for r in csv.DictReader(f):
                by_step.setdefault(int(r["step"]), {})[r["layer"]] = float(r["wgrad_rel_error"])
        for r in rows:
            if r["step"] in by_step:
                r["wgrad_error"] = by_step[r["step"]]
    return rows


def diverged(run_dir: Path) -> str | None:
    """Why a finished run stopped early (None if it ran to the end)."""
    return json.loads((Path(run_dir) / "done.json").read_text()).get("diverged")


def is_done(run_dir: Path, cfg: RunConfig) -> bool:
    p = run_dir / "done.json"
    return p.is_file() and json.loads(p.read_text()).get("config") == json.loads(cfg.to_json())


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _atomic_write(path: Path, payload: bytes):
    """Write ``path`` whole or not at all (rank 0 alone in a data-parallel run)."""
    if _rank():
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, path)


def _latest_snapshot(prefix_dir: Path, upto: int) -> Path | None:
    """The snapshot of a shared prefix with the largest step at or before ``upto``, or None."""
    if not prefix_dir.is_dir():
        return None
    got = []
    for p in prefix_dir.glob("snap-*.pt"):
        s = p.stem[len("snap-"):]
        if s.isdigit() and 0 < int(s) <= upto:
            got.append((int(s), p))
    return max(got)[1] if got else None


PROGRESS = "paper_repro-progress"


def _launch(cfg: RunConfig, run_dir: Path, progress, **kw) -> list[dict]:
    """Train a run of ``cfg.nproc`` data-parallel processes: torchrun starts them (``python -m paper_repro.train``),
    rank 0 reports its progress on stdout, and the log rows are read back from the run's folder."""
    import subprocess
    import sys
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // cfg.nproc))}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # gloo processes may abort at exit while OpenMP workers spin
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.nproc}",
           "-m", "paper_repro.train", cfg.to_json(), str(run_dir),
           json.dumps({k: (list(v) if isinstance(v, (set, tuple)) else v) for k, v in kw.items()})]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in p.stdout:
        if line.startswith(PROGRESS) and progress is not None:
            _, tok, loss = line.split()
            progress(int(tok), None if loss == "None" else float(loss))
    err = p.stderr.read()
    if p.wait():
        tail = "\n".join(line for line in err.splitlines() if "Traceback" in line or "Error" in line)[-2000:]
        raise RuntimeError(f"the {cfg.nproc}-process run {cfg.key()} failed (exit {p.returncode}): "
                           f"{tail or err[-2000:]}")
    return read_log(run_dir) if is_done(run_dir, cfg) else _partial_rows(run_dir)


def _partial_rows(run_dir: Path) -> list[dict]:
    """The rows of a run interrupted on purpose (stop_after): those its checkpoint holds."""
    import torch
    ck = Path(run_dir) / "ckpt.pt"
    return torch.load(ck, weights_only=False)["rows"] if ck.is_file() else []


def train(cfg: RunConfig, run_dir: Path, *, ckpt_seconds: float = 120.0, ckpt_every: int | None = None,
          progress=None, stop_after: int | None = None, snapshot_steps=()) -> list[dict]:
    """Train (or resume, or just read) the run; return its log rows.

    snapshot_steps: steps before which to save the run's state for shorter runs of the same prefix
    (:meth:`RunConfig.prefix_key`; only steps up to this run's own decay). A run with a prefix starts from the
    latest snapshot of that prefix at or before its decay step: its own decay step's (a cooldown branched from a
    longer trunk) or an earlier one (a trunk longer than any before it, extending a sweep), which gives the same
    numbers, bit for bit, as training it from the start.
    ckpt_seconds / ckpt_every: checkpoint after this much wall time or every this many steps (and at the end);
    progress(step_tokens, loss): called after every step, and once before the first with ``loss=None`` and the
    tokens already behind the run (resumed from its checkpoint or a branch point's snapshot), which this call
    does not train; stop_after: return after this many steps of this call
    without finishing (an interruption, for tests) — the last checkpoint is where a later call resumes.
    """
    import warnings

    import torch
    import torch.nn.functional as F

    from fp4sim.torch import RecipeMismatchWarning

    import torch.distributed as dist

    run_dir = Path(run_dir)
    if is_done(run_dir, cfg):
        return read_log(run_dir)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if cfg.nproc > 1 and world == 1:
        return _launch(cfg, run_dir, progress, ckpt_seconds=ckpt_seconds, ckpt_every=ckpt_every,
                       stop_after=stop_after, snapshot_steps=snapshot_steps)
    if world != cfg.nproc:
        raise ValueError(f"{cfg.key()}: a run of nproc={cfg.nproc} in a process group of {world}")
    rank = _rank()
    run_dir.mkdir(parents=True, exist_ok=True)
    train_ids, val_ids = data.splits()
    val = torch.from_numpy(data.val_windows(val_ids, cfg.val_windows, cfg.model.ctx))
    model = build(cfg.model, cfg.recipe(), cfg.seed)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model     # what a step runs
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    qlayers = _quant_layers(model)
    step, rows, acc, hist = 0, [], [], []
    ckpt = run_dir / "ckpt.pt"
    phase_at = [ph.step(cfg.steps) for ph in cfg.phases]
    snap = (run_dir.parent / cfg.parent().key() / f"snap-{phase_at[0]}.pt") if cfg.phases else None
    prefix = cfg.prefix_json()
    prefix_dir = run_dir.parent / cfg.prefix_key() if prefix is not None else None
    trunk_snap = _latest_snapshot(prefix_dir, cfg.decay_step()) if prefix is not None else None
    snapshot_steps = {s for s in snapshot_steps if 0 < s <= cfg.decay_step()} if prefix is not None else set()

    def load(path, want_config):
        nonlocal step, rows, acc, hist
        st = torch.load(path, weights_only=False)
        if st["config"] != want_config:
            raise ValueError(f"{path} belongs to another configuration; remove {path.parent} to start afresh")
        with warnings.catch_warnings():
            # the run's configuration is checked above; the recipe a state was saved under is the parent's (a
            # branch's snapshot) or a later phase's (a resumed branch, whose phases are applied after loading)
            warnings.simplefilter("ignore", RecipeMismatchWarning)
            model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, rows, acc, hist = st["step"], st["rows"], st["acc"], st.get("hist", [])
        for n, c in st["calls"].items():
            qlayers[n]._calls = c

    def state(config_json):
        buf = io.BytesIO()
        torch.save({"config": config_json, "model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "rows": rows, "acc": acc, "hist": hist, "calls": {n: m._calls for n, m in qlayers.items()}}, buf)
        return buf.getvalue()

    if ckpt.is_file():
        load(ckpt, cfg.to_json())
    elif snap is not None and snap.is_file():           # a sibling branch already trained the shared prefix
        load(snap, cfg.parent().to_json())
    elif trunk_snap is not None:    # a run of the same prefix passed this run's decay step (a cooldown branch),
        load(trunk_snap, prefix)    # or an earlier one (a longer trunk extending a sweep)
    if progress is not None and step:
        progress(step * cfg.batch * cfg.model.ctx, None)
    if world > 1 and rank == 0 and step:
        print(PROGRESS, step * cfg.batch * cfg.model.ctx, None, flush=True)
    for ph, at in zip(cfg.phases, phase_at):            # phases already passed (a resumed run; the one at this
        if at < step:                                   # very step is applied by the loop below)
            apply_phase(model, cfg, ph)
    qlayers = _quant_layers(model)
    if rank == 0:
        (run_dir / "config.json").write_text(cfg.to_json() + "\n")

    def save():
        _atomic_write(ckpt, state(cfg.to_json()))

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
    diverged = None
    while step < cfg.steps:
        if step in snapshot_steps and not (prefix_dir / f"snap-{step}.pt").is_file():
            prefix_dir.mkdir(parents=True, exist_ok=True)
            _atomic_write(prefix_dir / f"snap-{step}.pt", state(prefix))
        if step in phase_at:
            if step == phase_at[0] and not snap.is_file():    # the branch point, shared with sibling branches
                snap.parent.mkdir(parents=True, exist_ok=True)
                _atomic_write(snap, state(cfg.parent().to_json()))
            for ph, at in zip(cfg.phases, phase_at):          # in order (several may start at one step)
                if at == step:
                    apply_phase(model, cfg, ph)
        lr = wsd_lr(step, cfg.steps, cfg.lr, cfg.warmup, cfg.decay_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        b = torch.from_numpy(data.train_batch(train_ids, cfg.seed, step, cfg.batch, cfg.model.ctx))
        if world > 1:
            b = b[rank::world]                       # this rank's sequences of the global batch
        logits = net(b[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.model.vocab), b[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        lv = loss.detach().clone()
        if world > 1:
            dist.all_reduce(lv)                      # the global batch's loss: the mean of the ranks' equal shares
            lv /= world
        lv = float(lv)
        acc.append(lv)
        hist.append(lv)
        diverged = divergence(hist)
        if diverged:
            rows.append({"step": step, "tokens": step * tokens_per_step, "lr": lr,
                         "train_loss": float(np.mean(acc)), "val_loss": math.nan})
            break
        if step in evals:
            rows.append({"step": step, "tokens": step * tokens_per_step, "lr": lr,
                         "train_loss": float(np.mean(acc)) if acc else math.nan, "val_loss": evaluate()})
            if cfg.log_wgrad_error:
                rows[-1]["wgrad_error"] = wgrad_errors(model, val[:cfg.batch], cfg.model.vocab)
            if cfg.log_fidelity:
                rows[-1]["fidelity"] = fidelity(model, val[:cfg.batch], cfg.model.vocab)
            acc = []
        done_here += 1
        if progress is not None:
            progress(tokens_per_step, lv)
        if world > 1 and rank == 0:
            print(PROGRESS, tokens_per_step, lv, flush=True)
        now = time.monotonic()
        if step == cfg.steps or (ckpt_every and step % ckpt_every == 0) or \
                (not ckpt_every and now - last_ckpt >= ckpt_seconds):
            save()
            last_ckpt = now
        if stop_after is not None and done_here >= stop_after and step < cfg.steps:
            return rows
    if cfg.log_wgrad_error:
        lines = ["step,layer,wgrad_rel_error"] + [f"{r['step']},{n},{v!r}" for r in rows
                                                   for n, v in r.get("wgrad_error", {}).items()]
        _atomic_write(run_dir / "wgrad_error.csv", ("\n".join(lines) + "\n").encode())
    if cfg.log_fidelity:
        lines = ["step,layer,snr,cosine"] + [f"{r['step']},{n},{v[0]!r},{v[1]!r}" for r in rows
                                             for n, v in r.get("fidelity", {}).items()]
        _atomic_write(run_dir / "fidelity.csv", ("\n".join(lines) + "\n").encode())
    _atomic_write(run_dir / "log.csv", rows_to_csv(rows).encode())
    _atomic_write(run_dir / "done.json", json.dumps({"config": json.loads(cfg.to_json()),
                                                     "diverged": diverged}).encode())
    if rank == 0:
        ckpt.unlink(missing_ok=True)
    return rows


def _rank_main(argv):
    """One process of a data-parallel run (:func:`_launch`): ``CONFIG_JSON RUN_DIR OPTIONS_JSON``. The runs
    train on the CPU, so the processes join a gloo group."""
    import torch.distributed as dist
    cfg, run_dir, kw = RunConfig.from_json(argv[0]), Path(argv[1]), json.loads(argv[2])
    dist.init_process_group("gloo")
    try:
        train(cfg, run_dir, **kw)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys
    _rank_main(sys.argv[1:])
