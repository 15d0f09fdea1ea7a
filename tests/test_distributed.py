"""A converted model under torch.distributed, two gloo processes on the CPU: FSDP2 (``fully_shard`` per layer and
on the whole model) and DDP, on the paper_repro GPT and a small Hugging Face Llama (SmolLM2's shapes, scaled
down). Each property is checked against one process running the unsharded model:

- each rank's forward output equals, bit for bit, the unsharded model's on that rank's batch (the weight is
  quantized from the whole gathered weight, with its global amax);
- ranks fed the same batch draw different stochastic rounding: the synchronised gradient is the mean of what one
  process computes with each rank's bits (``set_data_parallel_rank``), and not rank 0's alone;
- the loss falls over six AdamW steps as the unsharded model's does on the two batches together;
- a torch.distributed.checkpoint saved at step 3 and loaded into a fresh model gives, at step 6, the parameters
  of the run that did not stop, bit for bit (call counts and the ranks' common delayed amax included), and one
  process loads the two ranks' checkpoint as saved (another world size).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from fp4sim.torch import QuantLinear, convert, set_data_parallel_rank  # noqa: E402
from fp4sim.training import Recipe  # noqa: E402
from gloo import spawn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB, CTX = 96, 32
STEPS, SAVE_AT = 6, 3
pytestmark = pytest.mark.slow


def _recipe(seed=5):
    # the paper's recipe (SR on the gradients, RHT on Wgrad's operands) with the activations' tensor amax delayed:
    # held state that the checkpoint must carry and the ranks must share (the maximum over the ranks; delayed
    # gradient amaxes would make each rank's gradient depend on the other's draws, which one process cannot
    # reproduce alone)
    import dataclasses
    r = Recipe.preset("nvfp4_paper", seed=seed)
    return dataclasses.replace(r, fprop_x=dataclasses.replace(r.fprop_x, amax="delayed", amax_every=3))


def _model(kind: str, seed=5):
    torch.manual_seed(0)
    if kind == "gpt":
        sys.path.insert(0, str(ROOT))
        from paper_repro.model import GPT, GPTConfig
        m = GPT(GPTConfig(vocab=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ctx=CTX))
    else:
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CTX,
                                       tie_word_embeddings=True)
        m = transformers.LlamaForCausalLM(cfg)
    return convert(m, _recipe(seed))


def _logits(m, ids):
    out = m(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _loss(m, ids):
    return torch.nn.functional.cross_entropy(_logits(m, ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _batch(step: int, rank: int):
    """Two sequences counting up from random starts (next token = this one + 1, mod VOCAB): learnable in a few
    steps."""
    start = torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(1000 * step + rank))
    return (start + torch.arange(CTX + 1)) % VOCAB


def _wrap(m, mode: str):
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(m)
    from torch.distributed.fsdp import fully_shard
    tied = {id(e.weight) for e in m.modules() if isinstance(e, torch.nn.Embedding)}
    for sub in m.modules():
        if isinstance(sub, QuantLinear) and id(sub.weight) not in tied:    # a tied head goes with the root
            fully_shard(sub)
    fully_shard(m)
    return m


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _params(m):
    inner = m.module if hasattr(m, "module") else m
    return {n: _full(p.detach()).clone() for n, p in inner.named_parameters()}


def _grad_of(m, name):
    inner = m.module if hasattr(m, "module") else m
    return _full(dict(inner.named_parameters())[name].grad).clone()


def _train(m, opt, rank, start, stop, losses):
    for s in range(start, stop):
        opt.zero_grad()
        loss = _loss(m, _batch(s, rank))
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / dist.get_world_size())


def _worker(rank, world, path, mode, kind, probe):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    torch.set_num_threads(1)
    out = {}
    m = _model(kind)
    ref = copy.deepcopy(m)                                   # unsharded, this process alone
    w = _wrap(m, mode)
    # the same batch on both ranks (the first call: a delayed amax is measured there, the same on both ranks):
    # the synchronised gradient of one quantized weight
    same = _batch(77, 0)
    _loss(w, same).backward()
    out["grad_same_batch"] = _grad_of(w, probe)
    w.zero_grad(set_to_none=True)
    # the second call, each rank its own batch, against the unsharded model after the same first call
    with torch.no_grad():
        _loss(ref, same)
        ids = _batch(99, rank)
        out["forward_equal"] = torch.equal(_logits(w, ids[:, :-1]), _logits(ref, ids[:, :-1]))
    # training a fresh model, a distributed checkpoint at SAVE_AT, on to STEPS
    w = _wrap(_model(kind), mode)
    opt = torch.optim.AdamW(w.parameters(), lr=1e-2)
    losses = []
    _train(w, opt, rank, 0, SAVE_AT, losses)
    msd, osd = get_state_dict(w, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/ckpt")
    out["at_save"] = _params(w)
    _train(w, opt, rank, SAVE_AT, STEPS, losses)
    out["losses"], out["final"] = losses, _params(w)
    # a fresh model resumed from the checkpoint
    m2 = _wrap(_model(kind), mode)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    msd2, osd2 = get_state_dict(m2, opt2)
    st = {"model": msd2, "optim": osd2}
    dcp.load(st, checkpoint_id=f"{path}/ckpt")
    set_state_dict(m2, opt2, model_state_dict=st["model"], optim_state_dict=st["optim"])
    _train(m2, opt2, rank, SAVE_AT, STEPS, [])
    out["resumed"] = _params(m2)
    torch.save(out, f"{path}/out{rank}.pt")
    dist.barrier()


def _spawn(tmp_path, monkeypatch, mode, kind, probe):
    spawn(_worker, (str(tmp_path), mode, kind, probe), monkeypatch)
    return [torch.load(tmp_path / f"out{r}.pt", weights_only=False) for r in range(2)]


PROBES = {"gpt": "layers.1.up.weight", "llama": "model.layers.1.mlp.down_proj.weight"}


def _single_run(kind, seed):
    """The loss curve of the unsharded model in one process on both ranks' batches, SR seed ``seed``."""
    m = _model(kind, seed)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    out = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = _loss(m, torch.cat([_batch(s, 0), _batch(s, 1)]))
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


@pytest.mark.parametrize("mode, kind", [("fsdp", "gpt"), ("fsdp", "llama"), ("ddp", "gpt")])
def test_a_converted_model_trains_sharded_as_it_trains_alone(tmp_path, monkeypatch, mode, kind):
    probe = PROBES[kind]
    outs = _spawn(tmp_path, monkeypatch, mode, kind, probe)
    # 1. each rank's output is the unsharded model's on its batch, bit for bit
    assert all(o["forward_equal"] for o in outs)
    # 2. the ranks' SR draws differ: the synchronised gradient of one batch fed to both is the mean of one
    # process's gradients with rank 0's and rank 1's bits (the mean of two float32 values: up to its rounding)
    alone = []
    for r in range(2):
        m = _model(kind)
        set_data_parallel_rank(m, r)
        _loss(m, _batch(77, 0)).backward()
        alone.append(dict(m.named_parameters())[probe].grad)
    g = outs[0]["grad_same_batch"]
    assert torch.equal(g, outs[1]["grad_same_batch"])
    assert not torch.equal(alone[0], alone[1])
    assert torch.allclose(g, (alone[0] + alone[1]) / 2, rtol=1e-6, atol=1e-9)
    assert not torch.allclose(g, alone[0], rtol=1e-3, atol=0)     # rank-blind bits would give rank 0's alone
    # 3. the loss falls as the unsharded model's does on the two batches together. Not bit for bit: each rank
    # quantizes its half batch with its own tensor amax and draws its own SR bits. The tolerance is the spread of
    # the unsharded run over three SR seeds (measured here; about 0.1-0.3 nats after a few steps), widened by 0.1
    # nats for the ranks' own amaxes
    single = [_single_run(kind, seed) for seed in (5, 6, 7)]
    losses = outs[0]["losses"]
    assert losses == outs[1]["losses"]
    assert losses[-1] < losses[0] - 0.5 and all(c[-1] < c[0] - 0.5 for c in single), (losses, single)
    for i, v in enumerate(losses):
        lo, hi = min(c[i] for c in single), max(c[i] for c in single)
        assert lo - 0.1 <= v <= hi + 0.1, (i, losses, single)
    # 4. resumed from the distributed checkpoint: the parameters of the uninterrupted run, bit for bit
    for o in outs:
        assert o["final"].keys() == o["resumed"].keys()
        for n in o["final"]:
            assert torch.equal(o["final"][n], o["resumed"][n]), n
    # 5. another world size: one process loads the two ranks' checkpoint (DCP reshards), parameters, optimizer
    # state and each layer's call count and delayed amax as saved
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    m = _model(kind)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    msd, osd = get_state_dict(m, opt)
    st = {"model": msd, "optim": osd}
    dcp.load(st, checkpoint_id=str(tmp_path / "ckpt"))
    set_state_dict(m, opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), outs[0]["at_save"][n]), n
    q = [x for x in m.modules() if isinstance(x, QuantLinear)]
    assert all(x._calls == SAVE_AT for x in q)            # one call per training step before the save
    assert any(x._amax_state for x in q)


def _bad_worker(rank, world, path):
    from torch.distributed.fsdp import fully_shard
    out = {}
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    fully_shard(m)
    try:
        convert(m, "nvfp4_paper")
    except ValueError as e:
        out["convert_after_shard"] = str(e)
    # the ranks convert with other seeds: the first call stops on every rank, naming the rank that differs
    torch.manual_seed(0)
    m = convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)),
                Recipe.preset("nvfp4_paper", seed=rank), quantize_head=True)
    try:
        m(torch.randn(4, 32))
    except RuntimeError as e:
        out["mixed"] = str(e)
    torch.save(out, f"{path}/bad{rank}.pt")


def test_bad_distributed_input_is_named(tmp_path, monkeypatch):
    spawn(_bad_worker, (str(tmp_path),), monkeypatch)
    for r in range(2):
        out = torch.load(tmp_path / f"bad{r}.pt")
        assert "already sharded" in out.get("convert_after_shard", "") and "before fully_shard" in \
            out["convert_after_shard"], out
        assert "ranks [1] run it with another recipe" in out.get("mixed", ""), out


def test_a_state_saved_under_another_recipe_warns_and_loads():
    from fp4sim.torch import RecipeMismatchWarning
    a = convert(torch.nn.Sequential(torch.nn.Linear(32, 16)), Recipe.preset("nvfp4_paper", seed=1),
                quantize_head=True)
    a(torch.randn(4, 32))
    st = a.state_dict()
    b = convert(torch.nn.Sequential(torch.nn.Linear(32, 16)), Recipe.preset("nvfp4_paper", seed=2),
                quantize_head=True)
    with pytest.warns(RecipeMismatchWarning, match="saved under recipe 'nvfp4_paper'"):
        b.load_state_dict(st)
    assert b[0]._calls == 1 and torch.equal(b[0].weight, a[0].weight)
    c = convert(torch.nn.Sequential(torch.nn.Linear(32, 16)), Recipe.preset("nvfp4_paper", seed=1),
                quantize_head=True)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeMismatchWarning)
        c.load_state_dict(st)                                           # the same recipe: no warning


# ------------------------------------------------------------------------------------------ the fine-tune script
def _finetune_module(out):
    """analyses/finetune_smollm2.py with a small Llama and synthetic text in place of SmolLM2 and its corpus
    (what the test checks is the script's data-parallel training, not the model)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("finetune_smollm2", ROOT / "analyses" / "finetune_smollm2.py")
    fm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fm)
    fm.OUT = Path(out)

    def setup(recipe, seed):
        m = _model("llama", seed)
        return m, None, torch.optim.AdamW(m.parameters(), lr=2e-5, betas=(0.9, 0.95), weight_decay=0.0), ()

    def data(tok, seq_len):
        text = (torch.arange(4000) * 7 % VOCAB).numpy()
        return text, np.stack([text[i:i + seq_len + 1] for i in range(0, 8 * 50, 50)])
    fm._setup, fm._data = setup, data
    return fm


def _finetune_worker(rank, world, out):
    _finetune_module(out).run_one("nvfp4", 0, steps=4, batch=4, seq_len=16, eval_every=2, quiet=True)


def test_the_finetune_script_trains_data_parallel(tmp_path, monkeypatch):
    """run --nproc 2's training (inside the torchrun group the script starts): its own run folder, written by rank
    0 alone, the batch's loss as the mean of the ranks' halves — within 0.02 nats of one process on the whole
    batch (the ranks quantize their halves with their own amaxes), the held-out loss before the first step equal
    to it bit for bit (the same weights, the same windows)."""
    import csv
    import json
    spawn(_finetune_worker, (str(tmp_path),), monkeypatch)
    d = tmp_path / "runs" / "nvfp4_s0_dp2"
    assert json.loads((d / "done.json").read_text())["nproc"] == 2 and not (d / "ckpt.pt").exists()
    dp = list(csv.DictReader(open(d / "log.csv")))
    _finetune_module(tmp_path).run_one("nvfp4", 0, steps=4, batch=4, seq_len=16, eval_every=2, quiet=True)
    one = list(csv.DictReader(open(tmp_path / "runs" / "nvfp4_s0" / "log.csv")))
    assert [r["step"] for r in dp] == [r["step"] for r in one] == ["0", "1", "2", "3", "4"]
    assert dp[0]["val_loss"] == one[0]["val_loss"]
    for a, b in zip(dp[1:], one[1:]):
        assert abs(float(a["train_loss"]) - float(b["train_loss"])) < 0.02, (dp, one)
    import subprocess
    r = subprocess.run([sys.executable, str(ROOT / "analyses" / "finetune_smollm2.py"), "run", "--nproc", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--nproc 3: a number of processes that divides --batch 4" in r.stderr, r.stderr


def test_the_finetune_runs_refuse_other_settings_and_leave_nothing_when_stopped(tmp_path):
    """A finished run folder made with another batch, sequence length or evaluation period is refused (not its
    rows reused as this run's), a run stopped before its first checkpoint leaves no folder, --recipes / --seeds /
    --out pick the runs and where they go, and a bad choice names its flag."""
    fm = _finetune_module(tmp_path)
    fm.run_one("nvfp4", 0, steps=2, batch=4, seq_len=16, eval_every=1, quiet=True)
    d = tmp_path / "runs" / "nvfp4_s0"
    assert (d / "done.json").is_file()
    with pytest.raises(ValueError, match=r"--batch 4 \(this run asks for 2\)"):
        fm.run_one("nvfp4", 0, steps=2, batch=2, seq_len=16, eval_every=1, quiet=True)
    with pytest.raises(ValueError, match=r"--seq-len 16 \(this run asks for 32\)"):
        fm.run_one("nvfp4", 0, steps=4, batch=4, seq_len=32, eval_every=1, quiet=True)
    setup = fm._setup

    def stopped(recipe, seed):
        raise KeyboardInterrupt
    fm._setup = stopped
    with pytest.raises(KeyboardInterrupt):
        fm.run_one("bf16", 1, steps=2, batch=4, seq_len=16, eval_every=1, quiet=True)
    assert not (tmp_path / "runs" / "bf16_s1").exists()
    fm._setup = setup
    other = tmp_path / "elsewhere"
    assert fm.main(["run", "--recipes", "bf16", "--seeds", "3", "--steps", "2", "--batch", "4", "--seq-len", "16",
                    "--eval-every", "1", "--out", str(other)]) == 0
    assert [p.name for p in (other / "runs").iterdir()] == ["bf16_s3"]
    for args, flag in ((["--recipes", "fp5"], "--recipes 'fp5'"), (["--seeds", "x"], "--seeds 'x'")):
        with pytest.raises(SystemExit):
            fm.main(["run", *args])


def test_the_finetune_tokenizes_the_corpus_once(tmp_path):
    """The corpus is tokenized once: a second call in the process reuses the ids, a fresh process reads them from
    the cache under the study's folder; another tokenizer is tokenized anew. The ids are the tokenizer's own."""
    fm = _finetune_module(tmp_path)

    class Tok:
        def __init__(self, mod):
            self.mod, self.calls = mod, 0

        def get_vocab(self):
            return {str(i): i for i in range(self.mod)}

        def __call__(self, text, add_special_tokens=False):
            self.calls += 1
            return {"input_ids": [ord(c) % self.mod for c in text]}
    a = Tok(97)
    tr, va = fm._tokens(a)
    assert a.calls == 2 and len(tr) == 2_000_000 and tr[:5].tolist() == [ord(c) % 97 for c in _corpus_head(5)]
    fm._tokens(a)
    assert a.calls == 2
    fm._CACHE.clear()                                   # a fresh process: the ids come from the cache on disk
    tr2, va2 = fm._tokens(a)
    assert a.calls == 2 and np.array_equal(tr, tr2) and np.array_equal(va, va2)
    b = Tok(89)
    fm._tokens(b)
    assert b.calls == 2


def _corpus_head(n):
    import lzma
    with lzma.open(ROOT / "paper_repro" / "data" / "corpus.txt.xz", "rt", encoding="utf-8") as f:
        return f.read(n)


@pytest.mark.parametrize("form", [["--nproc", "2"], ["--nproc=2"]])
def test_the_finetune_launcher_passes_torchruns_own_parser(form):
    """`run --nproc 2` starts torchrun with the script's arguments: torchrun's own parser reads a `--nproc` among
    them as an abbreviation of its options and stops (exit 2, 'ambiguous option'), so the launcher leaves it out
    (the processes learn their number from the group); every other argument reaches the script."""
    from torch.distributed.run import get_args_parser
    fm = _finetune_module(ROOT)
    argv = ["run", *form, "--steps", "3", "--seq-len", "16"]
    cmd = fm._launch_command(argv, 2)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    a = get_args_parser().parse_args(cmd[3:])
    assert a.nproc_per_node == "2" and a.training_script.endswith("finetune_smollm2.py")
    assert a.training_script_args == ["run", "--steps", "3", "--seq-len", "16"]
    with pytest.raises(SystemExit):                   # what the launcher passed before: torchrun refuses it
        get_args_parser().parse_args([*cmd[3:6], *argv])


# ------------------------------------------------------------------------- the ranks' shared state, pinned
def _edge_worker(rank, world, path):
    """Each property below is one plausible one-line bug away from breaking, and none changes what a rank that
    is fed the same batch as the other computes: so every check gives the ranks different data or settings."""
    out = {}
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    # 1. the delayed and history amaxes are the maximum over the ranks: batches whose amaxes differ (not by a
    # power of two, so that a sum or the rank's own amax gives other NVFP4 scales, not only other numbers)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(7 + rank))
    x = x / x.abs().max() * (1.0 if rank == 0 else 5.3)
    held = {}
    for kw in ({"delayed_amax": 1}, {"amax_history": 4}):
        m = convert(copy.deepcopy(base), Recipe.preset("nvfp4_paper", seed=3, **kw), quantize_head=True)
        m(x).pow(2).sum().backward()
        held[next(iter(kw))] = {f"{i}:{k}": v for i, q in enumerate(m) if isinstance(q, QuantLinear)
                                for k, v in q._amax_state.items()}
    out["held"] = held
    out["x_amax"] = float(x.abs().max())
    # 2. set_data_parallel_rank(model, 0) on rank 1 draws rank 0's bits (the same batch on both ranks)
    xs = torch.randn(8, 32, generator=torch.Generator().manual_seed(11))
    grads = {}
    for pin in (None, 0):
        m = convert(copy.deepcopy(base), Recipe.preset("nvfp4_paper", seed=3), quantize_head=True)
        if pin is not None:
            set_data_parallel_rank(m, pin)
        m(xs).pow(2).sum().backward()
        grads[pin] = [p.grad.clone() for p in m.parameters()]
    out["grads"] = grads
    # 3. the recipe-agreement check stops ranks whose layers differ in index or order alone (same recipe, seed)
    for what in ("index", "order"):
        m = convert(copy.deepcopy(base), Recipe.preset("nvfp4_paper", seed=3), quantize_head=True)
        if rank == 1:
            a, b = m[0], m[2]
            if what == "index":
                a._setup(a.recipe, 7)
            else:                                   # the two layers numbered the other way round
                ia, ib = a.layer_index, b.layer_index
                a._setup(a.recipe, ib)
                b._setup(b.recipe, ia)
        try:
            m(xs)
            out[what] = "ran"
        except RuntimeError as e:
            out[what] = str(e)
    torch.save(out, f"{path}/edge{rank}.pt")


def test_the_ranks_share_what_they_must_and_no_more(tmp_path, monkeypatch):
    spawn(_edge_worker, (str(tmp_path),), monkeypatch)
    got = [torch.load(tmp_path / f"edge{r}.pt") for r in range(2)]
    want = float(np.float32(max(g["x_amax"] for g in got)))
    assert got[0]["x_amax"] != got[1]["x_amax"]
    for mode in ("delayed_amax", "amax_history"):
        h0, h1 = got[0]["held"][mode], got[1]["held"][mode]
        assert h0 and h0 == h1, (mode, h0, h1)                      # every operand's state, the same on each rank
        fx = [v for k, v in h0.items() if k.startswith("0:") and "x" in k.split(":")[1] and "fprop" in k]
        assert fx, h0
        vals = [v["held"] if "held" in v else max(v["history"]) for v in fx]
        assert all(float(v) == want for v in vals), (mode, vals, want)
    g0, g1 = got[0]["grads"], got[1]["grads"]
    assert all(torch.equal(a, b) for a, b in zip(g1[0], g0[None]))         # rank 1 pinned to 0 = rank 0's own
    assert not all(torch.equal(a, b) for a, b in zip(g1[None], g0[None]))  # rank 1's own bits are its own
    assert all(torch.equal(a, b) for a, b in zip(g0[0], g0[None]))
    for g in got:
        for what in ("index", "order"):
            assert "ranks [1] run it with another recipe or layer index" in g[what], (what, g[what])
