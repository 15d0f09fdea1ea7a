"""rht_signs="per_layer": one RHT sign vector per layer from the recipe seed and the layer's index (torchao's
NVFP4 training draws one per layer), the same on every call, saved in QuantLinear's state and checked on load.
The Wgrad GEMM is rebuilt here from fs.rht with the explicit sign vector, fs.quantize and fs.gemm."""
from __future__ import annotations

import numpy as np
import pytest

import fp4sim as fs
from fp4sim import emulate
from fp4sim.emulate import layer_seed, per_layer_signs
from fp4sim.hadamard import rht_signs
from fp4sim.training import Recipe
from peers import torch_or_skip


def _wgrad_by_hand(dy, x, signs):
    """nvfp4_paper's Wgrad with round-to-nearest: both operands rotated along the tokens with ``signs``."""
    a = fs.rht(dy, 16, signs, axis=0, out="bf16")
    b = fs.rht(x, 16, signs, axis=0, out="bf16")
    qa = fs.quantize(a, "nvfp4", axis=0, global_amax=np.abs(a).max())
    qb = fs.quantize(b, "nvfp4", axis=0, global_amax=np.abs(b).max())
    return fs.gemm(qa, qb)


def test_each_layer_has_its_own_vector_the_same_on_every_call():
    rec = Recipe.preset("nvfp4_paper", rht_signs="per_layer", disable_stochastic_rounding=True, seed=11)
    assert rec.wgrad_x.rht_signs == rec.wgrad_dy.rht_signs == "per_layer"
    rng = np.random.default_rng(0)
    dy = rng.standard_normal((64, 32)).astype(np.float32)
    x = rng.standard_normal((64, 48)).astype(np.float32)
    vecs = [per_layer_signs(11, layer, 16) for layer in range(6)]
    assert len({v.tobytes() for v in vecs}) == 6 and all(set(np.unique(v)) <= {-1.0, 1.0} for v in vecs)
    assert np.array_equal(vecs[2], rht_signs(16, layer_seed(11, 2)))
    assert not np.array_equal(per_layer_signs(12, 2, 16), vecs[2])
    for layer in (0, 3):
        want = _wgrad_by_hand(dy, x, vecs[layer])
        for call in (0, 5):                         # stable across calls (per_transform would change)
            got = emulate.wgrad(dy, x, rec, layer, call)
            assert got.tobytes() == want.tobytes()
    assert not np.array_equal(emulate.wgrad(dy, x, rec, 0, 0), emulate.wgrad(dy, x, rec, 3, 0))


def test_quant_linear_saves_its_vector_and_refuses_another():
    torch_or_skip()
    from fp4sim.torch import QuantLinear
    rec = Recipe.preset("nvfp4_paper", rht_signs="per_layer", seed=3)
    a = QuantLinear(32, 16, recipe=rec, layer_index=4)
    st = a.state_dict()["_extra_state"]
    assert st["rht_signs"] == {"16": [int(v) for v in per_layer_signs(3, 4, 16)]}
    b = QuantLinear(32, 16, recipe=rec, layer_index=4)
    b.load_state_dict(a.state_dict())                     # the same seed and index: loads
    c = QuantLinear(32, 16, recipe=Recipe.preset("nvfp4_paper", rht_signs="per_layer", seed=4), layer_index=4)
    with pytest.raises(ValueError, match="per-layer 16-point RHT signs differ from this layer's"):
        c.load_state_dict(a.state_dict())
    d = QuantLinear(32, 16, recipe=rec, layer_index=5)
    with pytest.raises(ValueError, match="layer index 5"):
        d.load_state_dict(a.state_dict())
    e = QuantLinear(32, 16, recipe="nvfp4_paper", layer_index=4)          # TE's fixed vector: nothing to check
    e.load_state_dict(a.state_dict())
    assert "rht_signs" not in e.state_dict()["_extra_state"]


@pytest.mark.parametrize("signs", ["te", "fixed", "per_layer", "per_transform"])
def test_the_signs_are_the_same_on_every_data_parallel_rank(signs):
    """Data-parallel ranks draw their own stochastic rounding (emulate.sr_key) but rotate with the same RHT
    signs: with round-to-nearest the Wgrad of rank 0 and rank 3 are the same bits (the signs, hand-checked above
    for per_layer, do not depend on the rank), with stochastic rounding they differ, and rank 0 is the process
    outside any rank."""
    rng = np.random.default_rng(1)
    dy = rng.standard_normal((64, 32)).astype(np.float32)
    x = rng.standard_normal((64, 48)).astype(np.float32)
    for sr in (False, True):
        rec = Recipe.preset("nvfp4_paper", rht_signs=signs, disable_stochastic_rounding=not sr, seed=11)
        got = {}
        for rank in (0, 3):
            with emulate.data_parallel_rank(rank):
                got[rank] = emulate.wgrad(dy, x, rec, 2, 4).tobytes()
        assert (got[0] == got[3]) is (not sr)
        assert emulate.wgrad(dy, x, rec, 2, 4).tobytes() == got[0]
    if signs == "per_layer":
        rec = Recipe.preset("nvfp4_paper", rht_signs=signs, disable_stochastic_rounding=True, seed=11)
        with emulate.data_parallel_rank(3):
            assert emulate.wgrad(dy, x, rec, 2, 4).tobytes() == _wgrad_by_hand(dy, x, per_layer_signs(11, 2, 16)).tobytes()
    with pytest.raises(ValueError, match="rank=-1"):
        with emulate.data_parallel_rank(-1):
            pass
