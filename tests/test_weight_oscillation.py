"""collect_stats' weight oscillation: between logged Fprop calls, the share of the quantized weight's elements
that changed (w_changed) and that changed back to the value of the call before (w_flipped_back), against
fs.quantize / fs.dequantize applied to each weight directly (nvfp4_paper's Fprop weight: 16x16 blocks, RNE)."""
from __future__ import annotations

import numpy as np
import pytest

import fp4sim as fs
from peers import torch_or_skip


def deq(w):
    return fs.dequantize(fs.quantize(w, "nvfp4", block=(16, 16), global_amax=np.abs(w).max()))


def test_changed_and_flipped_back_shares_follow_the_quantized_weights():
    torch = torch_or_skip()
    from fp4sim.torch import QuantLinear, collect_stats
    rng = np.random.default_rng(5)
    w0 = (rng.standard_normal((32, 64)) * 0.1).astype(np.float32)
    w1 = w0 + (rng.standard_normal(w0.shape) * 0.004).astype(np.float32)      # small steps: some codes move
    w1[0, 0] = w0[0, 0]
    ws = [w0, w1, w0.copy(), w1 * 1.01]
    lin = QuantLinear(64, 32, bias=False, recipe="nvfp4_paper")
    x = torch.from_numpy(rng.standard_normal((16, 64)).astype(np.float32))
    with collect_stats(lin) as log:
        for w in ws:
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(w))
            lin(x)
    recs = [r for r in log.records() if r["operand"] == "fprop_w"]
    assert len(recs) == 4 and np.isnan(recs[0]["w_changed"]) and np.isnan(recs[1]["w_flipped_back"])
    d = [deq(w) for w in ws]
    for t in (1, 2, 3):
        ch = d[t] != d[t - 1]
        assert recs[t]["w_changed"] == ch.mean()
        if t >= 2:
            assert recs[t]["w_flipped_back"] == (ch & (d[t] == d[t - 2])).mean()
    assert 0 < recs[2]["w_flipped_back"] == recs[2]["w_changed"]           # w2 = w0: every change went back
    assert recs[3]["w_flipped_back"] < recs[3]["w_changed"]
    ds = log.dataset()
    assert float(ds.w_changed.values[0]) == pytest.approx(np.mean([r["w_changed"] for r in recs[1:]]), rel=1e-12)
    assert float(ds.w_flipped_back.values[0]) == pytest.approx(np.mean([r["w_flipped_back"] for r in recs[2:]]),
                                                               rel=1e-12)
    with collect_stats(lin) as log:                      # a new log starts afresh
        lin(x)
    assert np.isnan(next(r for r in log.records() if r["operand"] == "fprop_w")["w_changed"])
