"""Delayed tensor amax: Operand(amax="delayed", amax_every=D) holds the amax measured every D calls,
amax="history" (TransformerEngine's delayed scaling) takes the largest of the previous N calls'. Checked
against a schedule run by hand (fs.quantize with the amax the schedule names, fs.gemm), on tensors that grow
from call to call so that a stale amax saturates; and a QuantLinear run saved mid-window and resumed equals an
uninterrupted one bit for bit."""
from __future__ import annotations

import io

import numpy as np
import pytest

import fp4sim as fs
from fp4sim import emulate
from fp4sim.training import Operand, Recipe
from peers import torch_or_skip

M, N, K = 32, 16, 64


def tensors(calls=7):
    rng = np.random.default_rng(9)
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    xs = [(rng.standard_normal((M, K)) * (1 + 0.6 * c)).astype(np.float32) for c in range(calls)]
    return w, xs


def amax(a):
    return np.float32(np.abs(a).max())


def schedule(mode, n, values):
    """The amax each call uses, by the rule written out: delayed (refresh on calls c % n == 0) or history."""
    out = []
    for c, v in enumerate(values):
        if mode == "delayed":
            out.append(values[c - c % n])
        else:
            prev = values[max(0, c - n):c]
            out.append(max(prev) if prev else v)
    return out


@pytest.mark.parametrize("mode,n", [("delayed", 3), ("history", 2)])
def test_fprop_follows_the_schedule(mode, n):
    w, xs = tensors()
    sw = "delayed_amax" if mode == "delayed" else "amax_history"
    rec = Recipe.preset("nvfp4_paper", **{sw: n})
    assert rec.fprop_x.amax == mode and rec.wgrad_dy.amax == mode
    state = {}
    ax = schedule(mode, n, [amax(x) for x in xs])
    aw = schedule(mode, n, [amax(w)] * len(xs))
    saturated = 0
    for c, x in enumerate(xs):
        y, _ = emulate.fprop(x, w, rec, 0, c, amax_state=state)
        qx = fs.quantize(x, "nvfp4", global_amax=ax[c])
        qw = fs.quantize(w, "nvfp4", block=(16, 16), global_amax=aw[c])
        assert y.tobytes() == fs.gemm(qx, qw).tobytes(), c
        saturated += int(ax[c] < amax(x))
    assert saturated >= 3                      # the stale amax mattered: the growing input saturated
    assert state["fprop_x"] == ({"held": float(amax(xs[6 - 6 % n]))} if mode == "delayed"
                                else {"history": [float(amax(x)) for x in xs[-n:]]})


def test_the_backward_operands_keep_their_own_state():
    w, xs = tensors(4)
    rec = Recipe.preset("nvfp4_paper", delayed_amax=2, disable_stochastic_rounding=True, disable_rht=True)
    state = {}
    for c, x in enumerate(xs):
        dy = (x[:, :N] * 0.01).astype(np.float32)
        emulate.fprop(x, w, rec, 0, c, amax_state=state)
        got = emulate.wgrad(dy, x, rec, 0, c, amax_state=state)
        held = xs[c - c % 2]
        hdy = (held[:, :N] * 0.01).astype(np.float32)
        want = fs.gemm(fs.quantize(dy, "nvfp4", axis=0, global_amax=amax(hdy)),
                       fs.quantize(x, "nvfp4", axis=0, global_amax=amax(held)))
        assert got.tobytes() == want.tobytes(), c
    assert set(state) == {"fprop_x", "fprop_w", "wgrad_dy", "wgrad_x"}


def test_resume_mid_window_is_bit_for_bit():
    torch = torch_or_skip()
    from fp4sim.torch import convert

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(K, 32), torch.nn.Tanh(), torch.nn.Linear(32, N))
        return convert(m, Recipe.preset("nvfp4_paper", delayed_amax=3, seed=2))

    w, xs = tensors(6)

    def step(m, opt, c):
        opt.zero_grad()
        m(torch.from_numpy(xs[c])).pow(2).mean().backward()
        opt.step()

    a = model()
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    for c in range(6):
        step(a, oa, c)
    b = model()
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    for c in range(4):                                       # stop at call 4: inside the window 3..5
        step(b, ob, c)
    buf = io.BytesIO()
    torch.save({"m": b.state_dict(), "o": ob.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    assert "amax" in ck["m"]["0._extra_state"]
    r = model()
    orr = torch.optim.SGD(r.parameters(), lr=0.1)
    r.load_state_dict(ck["m"])
    orr.load_state_dict(ck["o"])
    for c in range(4, 6):
        step(r, orr, c)
    for p, q in zip(a.parameters(), r.parameters()):
        assert torch.equal(p, q)


def test_delayed_amax_is_checked():
    with pytest.raises(ValueError, match="only a per-tensor scale can be delayed"):
        Operand("mxfp4", amax="delayed", amax_every=4)
    with pytest.raises(ValueError, match="amax_every=0"):
        Operand("nvfp4", amax="delayed", amax_every=0)
    with pytest.raises(ValueError, match=r"amax='stale': use one of \['current', 'delayed', 'history'\]"):
        Operand("nvfp4", amax="stale")
    with pytest.raises(ValueError, match="has no operand with a per-tensor scale"):
        Recipe.preset("mxfp8", delayed_amax=50)
    w, xs = tensors(1)
    with pytest.raises(ValueError, match="pass amax_state"):
        emulate.fprop(xs[0], w, Recipe.preset("nvfp4_paper", delayed_amax=5), 0, 0)
    assert "amax/50" in Recipe.preset("nvfp4_paper", delayed_amax=50).fprop_x.label()
