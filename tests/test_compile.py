"""torch.compile of a converted model: each QuantLinear is two opaque operators (fp4sim::qlinear and its backward),
so dynamo traces the model without a graph break, the compiled step gives eager's bits for what fp4sim computes,
and the call counter that keys stochastic rounding does not make it recompile from step to step.

Checked against the same model run eagerly: a ReLU MLP with biases (outputs and every gradient, bit for bit, over
three SR steps with AdamW), the paper_repro GPT and a small Hugging Face Llama (the loss and every quantized
layer's weight gradient bit for bit; what inductor compiles around the layers — RMSNorm, the embedding, the
cross-entropy whose gradient feeds the high-precision head — may reorder float32 sums, and is compared to 1e-5),
FSDP2 with compile on two gloo ranks, and the diagnostics (collect_stats, the NaN warning) inside a compiled
model."""
from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fp4sim.torch import QuantLinear, collect_stats, convert  # noqa: E402
from fp4sim.training import Recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _no_recompiles():
    """Within the block a recompile is an error (the SR call counter must not be a guard)."""
    import contextlib

    @contextlib.contextmanager
    def block():
        old = torch._dynamo.config.error_on_recompile
        torch._dynamo.config.error_on_recompile = True
        try:
            yield
        finally:
            torch._dynamo.config.error_on_recompile = old
    return block()


def _mlp():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    return convert(m, Recipe.preset("nvfp4_paper", seed=1), quantize_head=True)


def test_a_compiled_mlp_gives_eager_bits_without_breaks_or_recompiles():
    m = _mlp()
    eager = copy.deepcopy(m)
    x = torch.randn(16, 64)
    assert torch._dynamo.explain(copy.deepcopy(m))(x).graph_break_count == 0
    torch._dynamo.reset()
    c = torch.compile(m)
    opts = [torch.optim.AdamW(net.parameters(), lr=1e-2) for net in (m, eager)]
    with _no_recompiles():
        for step in range(3):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
            ye, yc = eager(x), c(x)
            assert torch.equal(ye, yc), step
            ye.square().sum().backward()
            yc.square().sum().backward()
            for (n, a), b in zip(m.named_parameters(), eager.parameters()):
                assert torch.equal(a.grad, b.grad), (step, n)
            for o in opts:
                o.step()
                o.zero_grad()
    assert [q._calls for q in m if isinstance(q, QuantLinear)] == [3, 3]
    assert all(not q._pending for q in m if isinstance(q, QuantLinear))      # every backward took its forward's
    with torch.no_grad():                                                   # inference keeps nothing waiting
        torch.compile(m)(x)
    assert all(not q._pending for q in m if isinstance(q, QuantLinear))


def _lm(kind):
    sys.path.insert(0, str(ROOT / "tests"))
    from test_distributed import _batch, _loss, _model
    return _model(kind), _model(kind), _batch, _loss


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_compiled_language_models_match_eager_where_fp4sim_computes(kind):
    m, eager, batch, loss_of = _lm(kind)
    ids = batch(0, 0)
    assert torch._dynamo.explain(copy.deepcopy(m))(ids[:, :-1]).graph_break_count == 0
    torch._dynamo.reset()
    c = torch.compile(m)
    # the layers under the FP4 recipe (the head, kept in BF16, takes its gradient from inductor's cross-entropy)
    quantized = {n + ".weight" for n, q in m.named_modules() if isinstance(q, QuantLinear) and not q._fp4sim_kept}
    assert quantized
    for step in range(2):
        with _no_recompiles():
            lc = loss_of(c, batch(step, 0))
        le = loss_of(eager, batch(step, 0))
        assert torch.equal(lc, le), step
        lc.backward()
        le.backward()
        for (n, a), b in zip(m.named_parameters(), eager.parameters()):
            if n in quantized:
                assert torch.equal(a.grad, b.grad), (step, n)
            else:                                  # inductor's own kernels around the layers
                assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), (step, n)
            a.grad = b.grad = None


def test_diagnostics_work_inside_a_compiled_model():
    m = _mlp()
    c = torch.compile(m)
    x = torch.randn(16, 64)
    c(x).sum().backward()                                   # compiled once, outside collect_stats
    with collect_stats(m) as log:
        c(x).sum().backward()
    recs = log.records()
    assert {r["gemm"] for r in recs} == {"fprop", "dgrad", "wgrad"} and len({r["layer"] for r in recs}) == 2
    bad = x.clone()
    bad[0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        c(bad)
    assert any("holds NaN" in str(v.message) for v in w)


def _fsdp_compile_worker(rank, world, path):
    from test_distributed import _batch, _loss, _model, _wrap
    out = {}
    m, ref = _wrap(_model("gpt"), "fsdp"), _wrap(_model("gpt"), "fsdp")
    c = torch.compile(m)
    lc, le = _loss(c, _batch(0, rank)), _loss(ref, _batch(0, rank))
    out["loss_equal"] = torch.equal(lc, le)
    lc.backward()
    le.backward()
    g = dict(m.named_parameters())["layers.1.up.weight"].grad.full_tensor()
    out["grad_equal"] = torch.equal(g, dict(ref.named_parameters())["layers.1.up.weight"].grad.full_tensor())
    torch.save(out, f"{path}/c{rank}.pt")


def test_fsdp2_and_compile_together(tmp_path, monkeypatch):
    from gloo import spawn
    spawn(_fsdp_compile_worker, (str(tmp_path),), monkeypatch)
    for r in range(2):
        out = torch.load(tmp_path / f"c{r}.pt")
        assert out == {"loss_equal": True, "grad_equal": True}


# ------------------------------------------------------------------ a deep sharded model, compiled
DEEP = 10


def _deep_llama(convert_it: bool, use_cache: bool):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=DEEP,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=use_cache)
    m = transformers.LlamaForCausalLM(cfg)
    return convert(m, Recipe.preset("nvfp4_paper", seed=1)) if convert_it else m


def _recompiles(m, rank) -> dict:
    """Three training steps of ``m`` sharded per decoder block and at the root, compiled: the recompiles dynamo
    logs, per function, and the times it gave up on a frame at its recompile limit (running it eagerly)."""
    import collections
    import logging
    from torch.distributed.fsdp import fully_shard
    torch._dynamo.reset()
    got = {"recompiled": collections.Counter(), "limit": 0}

    class Count(logging.Handler):
        def emit(self, rec):
            msg = rec.getMessage()
            if "Recompiling function" in msg:
                got["recompiled"][msg.split("Recompiling function ")[1].split(" ")[0]] += 1
            if "recompile_limit" in msg:
                got["limit"] += 1
    torch._logging.set_logs(recompiles=True)
    h = Count()
    logging.getLogger("torch").addHandler(h)
    try:
        for blk in m.model.layers:
            fully_shard(blk)
        fully_shard(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        step = torch.compile(m)
        for s in range(3):
            ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(10 * s + rank))
            step(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        logging.getLogger("torch").removeHandler(h)
        torch._logging.set_logs()
    return {"recompiled": dict(got["recompiled"]), "limit": got["limit"]}


def _deep_worker(rank, world, path):
    torch.set_num_threads(1)                        # as torchrun sets it (OMP_NUM_THREADS=1)
    out = {(c, u): _recompiles(_deep_llama(c, u), rank) for c in (False, True) for u in (True, False)}
    out["threads_after"] = torch.get_num_threads()
    torch.save(out, f"{path}/deep{rank}.pt")


def test_a_deep_sharded_llama_recompiles_no_more_converted_than_plain(tmp_path, monkeypatch):
    """A Hugging Face Llama of 10 decoder blocks, fully_shard per block and at the root, torch.compile, three steps
    on two gloo ranks: converted, it recompiles exactly as the unconverted model does, function by function
    (transformers' per-layer KV-cache guards with use_cache on; with use_cache=False the blocks share one graph
    and only the top-level wrapper recompiles), and never falls back to eager at dynamo's recompile limit where
    the plain model does not. Two things fp4sim did made every block compile again: the layer's key, a Python
    int constant of the graph (guarded per layer), and torch's thread count, which Numba's OpenMP layer changed
    under the first pass (a guarded global state)."""
    from gloo import spawn
    spawn(_deep_worker, (str(tmp_path),), monkeypatch)
    for r in range(2):
        out = torch.load(tmp_path / f"deep{r}.pt")
        assert out["threads_after"] == 1
        for use_cache in (True, False):
            plain, conv = out[(False, use_cache)], out[(True, use_cache)]
            assert conv["recompiled"] == plain["recompiled"], (r, use_cache, plain, conv)
            assert conv["limit"] <= plain["limit"], (r, use_cache, plain, conv)
        nocache = out[(True, False)]
        assert nocache["limit"] == 0 and not any("forward_with_checkpointing" in f or f == "forward"
                                                 for f in nocache["recompiled"]), nocache
