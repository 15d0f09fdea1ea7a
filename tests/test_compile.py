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
