"""The PyTorch bridge on the inputs real models give it: NaN and Inf operands, empty batches, non-float inputs,
exact resume from a state_dict (the SR call counts), the output head kept in high precision by default, and the
calls that used to do nothing without a word."""
from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest

import fp4sim as fs
from blockcases import heavy
from fp4sim import emulate
from fp4sim.training import Operand, Recipe
from peers import torch_or_skip

torch = torch_or_skip()
from fp4sim.torch import (QuantLinear, collect_stats, convert, drop_extra_state, set_recipe,  # noqa: E402
                          suggest_high_precision)


class Net(torch.nn.Module):
    """Embedding, two blocks of two linears, and a head (tied to the embedding when ``tied``)."""

    def __init__(self, vocab=32, d=32, tied=False, head="head"):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList()
        for _ in range(2):
            blk = torch.nn.Module()
            blk.up, blk.down = torch.nn.Linear(d, 2 * d, bias=False), torch.nn.Linear(2 * d, d, bias=False)
            self.layers.append(blk)
        setattr(self, head, torch.nn.Linear(d, vocab, bias=False))
        self.head_name = head
        if tied:
            getattr(self, head).weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)
        for blk in self.layers:
            h = h + blk.down(torch.relu(blk.up(h)))
        return getattr(self, self.head_name)(h)


def _data(n=4, T=16, vocab=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, T + 1), generator=g)


def _loss(model, batch):
    logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _layer(recipe="nvfp4_paper", inf=64, outf=32, bias=True):
    torch.manual_seed(0)
    return QuantLinear(inf, outf, bias=bias, recipe=recipe)


# ------------------------------------------------------------------------------------------------ NaN and Inf
@pytest.mark.parametrize("where", ["x", "w", "dy"])
@pytest.mark.parametrize("preset", ["nvfp4_paper", "mxfp4_paper"])
def test_a_nan_operand_warns_once_naming_the_layer_and_operand(where, preset):
    """One NaN in the input or the weight, or an all-NaN upstream gradient: the FP4 GEMMs encode it as +6 (the
    hardware's bits, unchanged), so it does not show in the output; the layer warns, naming itself and the
    operands, once per layer and operand however many calls follow."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    convert(model, preset)
    lin = model[0]
    x, dy = torch.from_numpy(heavy((16, 64), 1)), torch.full((16, 32), float("nan"))
    if where == "x":
        x[3, 5] = float("nan")
    elif where == "w":
        with torch.no_grad():
            lin.weight[2, 7] = float("nan")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(3):
            y = model(x.clone().requires_grad_(True))
            y.backward(dy if where == "dy" else torch.ones_like(y))
            lin.weight.grad = None
    msgs = [str(w.message) for w in got if "holds NaN" in str(w.message)]
    names = {"x": ("the input", "fprop_x"), "w": ("the weight", "fprop_w"), "dy": ("the output gradient",
                                                                                   "dgrad_dy")}[where]
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith("layer '0': ") and names[0] in msgs[0] and names[1] in msgs[0], msgs[0]
    if where != "dy":
        assert torch.isfinite(y).all()              # the NaN is gone from the output: what the warning is for


@pytest.mark.parametrize("where", ["x", "w", "dy"])
def test_a_deferred_nan_check_warns_once_later(where, monkeypatch):
    """On a CUDA device the NaN check does not wait for the device: its flag is read by a later check once it has
    arrived, or by fp4sim.torch.flush_warnings(). Here the CPU takes that path (``_defers`` patched): the check
    itself warns nothing, the flush warns once, naming the layer and operand, and further calls stay quiet."""
    from fp4sim.torch import nonfinite
    monkeypatch.setattr(nonfinite, "_defers", lambda t: True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    convert(model, "nvfp4_paper")
    lin = model[0]
    x, dy = torch.from_numpy(heavy((16, 64), 1)), torch.full((16, 32), float("nan"))
    t = {"x": x, "w": lin.weight, "dy": dy}[where]
    if where != "dy":
        with torch.no_grad():
            t[3, 5] = float("nan")
    rec, bw = lin.recipe, lin.recipe_backward               # the operands the layer's own checks name
    uses = {"x": ((rec, "fprop_x"), (bw, "wgrad_x")), "w": ((rec, "fprop_w"), (bw, "dgrad_w")),
            "dy": ((bw, "dgrad_dy"), (bw, "wgrad_dy"))}
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        nonfinite._check_finite(lin, "warn", where, t, uses[where])
    assert not [w for w in got if "holds NaN" in str(w.message)]
    assert len(nonfinite._NAN_CHECKS) == 1
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        nonfinite.flush_warnings()
        for _ in range(2):
            y = model(x.clone().requires_grad_(True))
            y.backward(dy if where == "dy" else torch.ones_like(y))
        nonfinite.flush_warnings()
    msgs = [str(w.message) for w in got if "holds NaN" in str(w.message)]
    assert len(msgs) == 1 and msgs[0].startswith("layer '0': "), msgs
    assert not nonfinite._NAN_CHECKS
    with warnings.catch_warnings(record=True) as got:     # a finite tensor: nothing, after the flush too
        warnings.simplefilter("always")
        nonfinite._check_finite(lin, "warn", "x", torch.ones(4, 64), ((Recipe.preset("nvfp4_paper"), "fprop_x"),))
        nonfinite.flush_warnings()
    assert not [w for w in got if "holds NaN" in str(w.message)]


def test_an_all_nan_gradient_gives_finite_gradients_and_raise_stops_it():
    """Under nvfp4_paper an all-NaN upstream gradient becomes dW = dx = 0 (E2M1 NaN -> +6 in blocks whose scale
    comes from a NaN-free amax of 0): what a diverging run would train on. on_nonfinite='raise' stops there, at
    the layer, for NaN and Inf alike; 'ignore' keeps quiet."""
    lin = _layer(Recipe.preset("nvfp4_paper"))
    x = torch.from_numpy(heavy((16, 64), 2)).requires_grad_(True)
    with pytest.warns(RuntimeWarning, match="output gradient"):
        lin(x).backward(torch.full((16, 32), float("nan")))
    assert torch.isfinite(lin.weight.grad).all() and torch.isfinite(x.grad).all()
    for bad in (float("nan"), float("inf")):
        lin = _layer(Recipe.preset("nvfp4_paper", on_nonfinite="raise"))
        xb = torch.from_numpy(heavy((16, 64), 2))
        xb[0, 0] = bad
        with pytest.raises(FloatingPointError, match=r"layer '#0': the input \(operands fprop_x, wgrad_x\) holds "
                                                     + ("NaN" if bad != bad else "Inf")):
            lin(xb)
        y = lin(torch.from_numpy(heavy((16, 64), 2)))
        with pytest.raises(FloatingPointError, match="the output gradient"):
            y.backward(torch.full((16, 32), bad))
    lin = _layer(Recipe.preset("nvfp4_paper", on_nonfinite="ignore"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xb = torch.from_numpy(heavy((16, 64), 2))
        xb[1, 1] = float("nan")
        lin(xb)
    with pytest.raises(ValueError, match="on_nonfinite='sometimes'"):
        Recipe.preset("nvfp4_paper", on_nonfinite="sometimes")


def test_a_nan_in_a_bf16_layer_propagates_without_a_warning():
    """BF16 keeps NaN (0x7FFF), so a kept layer's output shows it and no warning is needed."""
    lin = _layer("bf16")
    x = torch.from_numpy(heavy((16, 64), 3))
    x[0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = lin(x)
    assert torch.isnan(y[0]).all() and torch.isfinite(y[1:]).all()


# ------------------------------------------------------------------------------------------------ nn.Linear's contract
@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
def test_an_empty_batch_behaves_as_nn_linear(shape):
    """No rows (an MoE expert that received no tokens): the output is empty with nn.Linear's shape, dW and db are
    zeros, and the call still counts."""
    q = _layer()
    ref = torch.nn.Linear(64, 32)
    ref.load_state_dict(drop_extra_state(q.state_dict()))
    outs = []
    for m in (q, ref):
        x = torch.zeros(shape, requires_grad=True)
        y = m(x)
        y.sum().backward()
        outs.append((y, x.grad, m.weight.grad, m.bias.grad))
    for a, b in zip(*outs):
        assert a.shape == b.shape and torch.equal(a, b)
    assert not outs[0][2].any() and q._calls == 1


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_a_non_float_input_raises_type_error(dtype):
    with pytest.raises(TypeError, match=f"floating-point input, not {dtype}"):
        _layer()(torch.ones(4, 64, dtype=dtype))


def test_an_input_on_another_device_raises_naming_both():
    """nn.Linear refuses an input on another device than its weight; so does QuantLinear, naming both devices,
    before anything is quantized (the 'meta' device stands in for a GPU on a CPU-only machine)."""
    lin = _layer()
    with pytest.raises(ValueError, match="the input is on meta and the weight on cpu"):
        lin(torch.ones(4, 64, device="meta"))
    with pytest.raises(ValueError, match="on meta"):
        lin(torch.ones(0, 64, device="meta"))
    assert lin._calls == 0


def test_the_recipe_attribute_takes_a_preset_name_or_a_recipe_and_refuses_anything_else():
    lin = _layer()
    lin.recipe = "bf16"
    assert isinstance(lin.recipe, Recipe) and lin.recipe.name == "bf16"
    lin.recipe_backward = Recipe.preset("mxfp4_paper")
    assert lin.recipe_backward.name == "mxfp4_paper"
    lin(torch.randn(4, 64)).sum().backward()
    with pytest.raises(TypeError, match="recipe must be a fp4sim.training.Recipe or a preset name, not int"):
        lin.recipe = 3
    with pytest.raises(ValueError, match="preset 'bf61' is not known"):
        lin.recipe_backward = "bf61"
    c = copy.deepcopy(lin)
    assert c.recipe.name == "bf16" and c.recipe_backward.name == "mxfp4_paper"
    p = pickle.loads(pickle.dumps(lin))
    assert p.recipe == lin.recipe and p._calls == lin._calls == 1


# ------------------------------------------------------------------------------------------------ exact resume
def _train_steps(model, opt, n, start=0):
    grads = []
    for s in range(start, start + n):
        opt.zero_grad()
        _loss(model, _data(seed=s)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def _fresh(recipe):
    torch.manual_seed(0)
    model = convert(Net(), recipe)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def test_save_load_step_gives_the_bits_of_an_uninterrupted_run(tmp_path):
    """Two SR steps, model and optimizer state_dicts saved (torch.save, read back with weights_only=True) and
    loaded into a fresh model: the third step's gradients equal the uninterrupted run's bit for bit (the call
    counts, which key the SR bits, travel in the state_dict). Without them (a plain state_dict) they differ."""
    rec = Recipe.preset("nvfp4_paper", seed=9, accumulate="fast")
    model, opt = _fresh(rec)
    _train_steps(model, opt, 2)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    want = _train_steps(model, opt, 1, start=2)[0]
    st = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    extra = st["model"]["layers.0.up._extra_state"]
    assert extra["calls"] == 2 and extra["recipe_names"] == ["nvfp4_paper", "nvfp4_paper"]
    model2, opt2 = _fresh(rec)
    model2.load_state_dict(st["model"])
    opt2.load_state_dict(st["opt"])
    assert all(m._calls == 2 for m in model2.modules() if isinstance(m, QuantLinear))
    got = _train_steps(model2, opt2, 1, start=2)[0]
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    model3, opt3 = _fresh(rec)                    # the same weights without the counts: other SR bits
    model3.load_state_dict(drop_extra_state(st["model"]))
    opt3.load_state_dict(st["opt"])
    assert not all(torch.equal(a, b) for a, b in zip(want, _train_steps(model3, opt3, 1, start=2)[0]))


def test_plain_and_converted_state_dicts_load_into_each_other():
    """A plain model's state_dict loads strictly into a converted one (the counts stay as they are); a converted
    one's loads strictly into a plain model once drop_extra_state has taken the counts out, with the same
    weights."""
    torch.manual_seed(1)
    plain = Net()
    conv = convert(copy.deepcopy(plain), "nvfp4_paper")
    conv.layers[0].up._calls = 5
    conv.load_state_dict(plain.state_dict())                    # strict
    assert conv.layers[0].up._calls == 5
    with pytest.raises(RuntimeError, match="_extra_state"):
        Net().load_state_dict(conv.state_dict())
    other = Net()
    other.load_state_dict(drop_extra_state(conv.state_dict()))
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), plain.state_dict().values()))
    with pytest.raises(ValueError, match="extra state"):
        conv.layers[0].up.set_extra_state({"calls": -1})
    buf = io.BytesIO()
    torch.save(conv.state_dict(), buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["layers.0.up._extra_state"]["calls"] == 5


# ------------------------------------------------------------------------------------------------ the head
@pytest.mark.parametrize("head,tied", [("head", False), ("lm_head", False), ("output", False), ("proj", True)])
def test_convert_keeps_the_output_head_in_high_precision_unless_asked(head, tied):
    """The head (named lm_head / output / head, or tied to the embedding) runs under the high-precision recipe by
    default; quantize_head=True quantizes it; the block linears are quantized either way."""
    model = convert(Net(head=head, tied=tied), "nvfp4_paper")
    lin = getattr(model, head)
    assert isinstance(lin, QuantLinear) and lin._fp4sim_kept and lin.recipe.name == "bf16"
    assert all(m.recipe.name == "nvfp4_paper" for b in model.layers for m in (b.up, b.down))
    _loss(model, _data()).backward()
    model = convert(Net(head=head, tied=tied), "nvfp4_paper", quantize_head=True)
    assert getattr(model, head).recipe.name == "nvfp4_paper" and not getattr(model, head)._fp4sim_kept
    untied = convert(Net(head="proj"), "nvfp4_paper")             # neither named nor tied: quantized
    assert untied.proj.recipe.name == "nvfp4_paper"
    with pytest.raises(TypeError, match="quantize_head"):
        convert(Net(), "nvfp4_paper", quantize_head="yes")


# ------------------------------------------------------------------------------------------------ no silent no-ops
def test_calls_that_would_do_nothing_raise():
    plain = Net()
    with pytest.raises(ValueError, match="no QuantLinear layers"):
        set_recipe(plain, "bf16")
    with pytest.raises(ValueError, match="no QuantLinear layers"):
        with collect_stats(plain):
            pass
    with pytest.raises(ValueError, match="keep_high_precision 'lm-head' matches no linear layer"):
        convert(Net(), "nvfp4_paper", keep_high_precision=("lm-head",))
    with pytest.raises(ValueError, match="keep glob 'lm_head' matches no linear layer"):
        convert(Net(), Recipe.preset("nvfp4_paper", keep=("lm_head",)))
    with pytest.raises(ValueError, match="no torch.nn.Linear layers"):
        convert(torch.nn.Sequential(torch.nn.ReLU()), "nvfp4_paper")
    with pytest.raises(TypeError, match="disable_rht='no': a switch takes True or False"):
        Recipe.preset("nvfp4_paper", disable_rht="no")
    with pytest.raises(TypeError, match="rht_size"):
        Recipe.preset("nvfp4_paper", rht_size="16")
    with pytest.raises(ValueError, match=r"Operand\('nvfp4', block=\(1, 32\)\).*\(1, 16\) or \(16, 16\)"):
        Operand("nvfp4", block=(1, 32))
    with pytest.raises(ValueError, match="scheme=None"):
        Operand(None, block=(1, 16))
    model = convert(Net(), "nvfp4_paper")
    with pytest.raises(ValueError, match="ran no backward pass"):
        suggest_high_precision(model, lambda: model(_data()[:, :-1]))
    assert all(p.grad is None for p in model.parameters())


def test_set_recipe_applies_the_new_recipes_keep_rules():
    """set_recipe(model, Recipe.preset(..., keep=...)): the layers the new recipe keeps take its high-precision
    recipe, the rest the recipe itself; layers convert kept stay as they are."""
    model = convert(Net(), "nvfp4_paper")
    set_recipe(model, Recipe.preset("mxfp4_paper", keep=("layers.1.*",)))
    assert model.layers[0].up.recipe.name == "mxfp4_paper" and model.layers[0].up.recipe_backward.name == "mxfp4_paper"
    assert model.layers[1].up.recipe.name == "bf16" and model.layers[1].down.recipe_backward.name == "bf16"
    assert model.head.recipe.name == "bf16"
    set_recipe(model, Recipe.preset("mxfp4_paper", keep_last=1), which="forward")
    assert model.layers[1].down.recipe.name == "bf16" and model.layers[0].down.recipe.name == "mxfp4_paper"
    with pytest.raises(ValueError, match="keep glob 'mlp.*' matches no linear layer"):
        set_recipe(model, Recipe.preset("bf16", keep=("mlp.*",)))


def test_operand_block_validation_names_the_scheme_and_its_blocks():
    assert Operand("nvfp4", block=[16, 16]).block == (16, 16)
    assert Operand("fp8_blockwise", block=(128, 128)).block == (128, 128)
    with pytest.raises(ValueError, match=r"mxfp4.*\(1, 32\)"):
        Operand("mxfp4", block=(1, 16))
    with pytest.raises(ValueError, match="does not apply"):
        Operand("bf16", block=(1, 16))
    with pytest.raises(ValueError, match="a \\(rows, columns\\) pair"):
        Operand("nvfp4", block=16)
    assert emulate.quantize_operand(heavy((32, 64), 4), Operand("nvfp4", block=(16, 16)), 1,
                                    Recipe.preset("nvfp4_paper"), 0, 0, "fprop_w").scheme.block == (16, 16)
    assert np.isfinite(fs.dequantize(fs.quantize(heavy((16, 32), 5), "nvfp4"))).all()


# ------------------------------------------------------------------------------------------------ gradient fidelity
def test_gradient_fidelity_against_a_float32_copy_and_leaves_the_model_as_it_was():
    """gradient_fidelity against a direct computation: the model's own weight gradients (g_q) and those of a deep
    copy whose every QuantLinear runs the 'none' recipe (g_ref), on the same batch: snr = |g_ref| / |g_q - g_ref|,
    cosine, rel_error = 1 / snr, for every layer, the BF16-kept head included (finite: BF16 is not float32).
    Afterwards the gradients, SR call counts and recipes are as before, a second call gives the same numbers, and
    the next training step has the bits it would have had without the diagnostic."""
    from fp4sim.torch import gradient_fidelity
    torch.manual_seed(3)
    model = convert(Net(), Recipe.preset("nvfp4_paper", seed=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_steps(model, opt, 1)
    batch = _data(seed=7)
    step = lambda m=model: _loss(m, batch).backward()  # noqa: E731
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, QuantLinear):
            m.recipe = m.recipe_backward = "none"
    step(ref)
    mine = copy.deepcopy(model)
    step(mine)
    before = {n: (m._calls, m.recipe, m.recipe_backward) for n, m in model.named_modules()
              if isinstance(m, QuantLinear)}
    grads = [p.grad.clone() for p in model.parameters()]
    ds = gradient_fidelity(model, step)
    names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert list(ds.layer.values) == names and ds.attrs["snr_threshold"] == pytest.approx(3 ** 0.5)
    for n in names:
        q = mine.get_submodule(n).weight.grad.double()
        r = ref.get_submodule(n).weight.grad.double()
        snr = float(r.norm() / (q - r).norm())
        assert float(ds.snr.sel(layer=n)) == pytest.approx(snr, rel=1e-12), n
        assert float(ds.rel_error.sel(layer=n)) == pytest.approx(1 / snr, rel=1e-12)
        assert float(ds.cosine.sel(layer=n)) == pytest.approx(float((q * r).sum() / (q.norm() * r.norm())),
                                                              rel=1e-12)
        assert 1 < snr < 1e6, n                            # quantized and kept (BF16) layers alike
    assert float(ds.snr.sel(layer="head")) > float(ds.snr.sel(layer="layers.0.up"))
    assert {n: (m._calls, m.recipe, m.recipe_backward) for n, m in model.named_modules()
            if isinstance(m, QuantLinear)} == before
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    again = gradient_fidelity(model, step)
    assert np.array_equal(again.snr.values, ds.snr.values)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    twin_opt.load_state_dict(opt.state_dict())
    a = _train_steps(model, opt, 1, start=1)[0]
    b = _train_steps(twin, twin_opt, 1, start=1)[0]
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_gradient_fidelity_refuses_what_it_cannot_measure():
    from fp4sim.torch import gradient_fidelity
    with pytest.raises(ValueError, match="no QuantLinear layers"):
        gradient_fidelity(Net(), lambda: None)
    model = convert(Net(), "nvfp4_paper")
    with pytest.raises(ValueError, match="ran no backward pass"):
        gradient_fidelity(model, lambda: model(_data()[:, :-1]))
    assert all(m.recipe.name in ("nvfp4_paper", "bf16") for m in model.modules() if isinstance(m, QuantLinear))
    plain = convert(Net(), "none")
    ds = gradient_fidelity(plain, lambda: _loss(plain, _data()).backward())
    assert np.all(np.isinf(ds.snr.values)) and np.all(ds.rel_error.values == 0)


def test_four_over_six_operands_and_switch():
    """Operand(four_over_six=...) quantizes with TE's 4over6 block scales (the same bits as fs.quantize with it);
    the preset switch sets it on every round-to-nearest NVFP4 operand and leaves the SR gradients alone; it is
    refused for other schemes, for SR, and for other error rules."""
    rec = Recipe.preset("nvfp4_paper", four_over_six="mse")
    assert [getattr(rec, op).four_over_six for op in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_x",
                                                       "wgrad_dy")] == ["mse", "mse", None, "mse", "mse", None]
    w = heavy((48, 64), 6)
    q = emulate.quantize_operand(w, rec.fprop_w, 1, rec, 0, 0, "fprop_w")
    want = fs.quantize(w, "nvfp4_2d", four_over_six="mse")
    assert np.array_equal(q.codes, want.codes) and np.array_equal(q.scales, want.scales)
    plain = fs.quantize(w, "nvfp4_2d")
    assert not np.array_equal(plain.scales, want.scales)
    assert "4over6-MSE" in rec.table()
    lin = QuantLinear(64, 48, bias=False, recipe=rec)
    lin(torch.from_numpy(heavy((32, 64), 7))).sum().backward()
    with pytest.raises(ValueError, match="round-to-nearest"):
        Operand("nvfp4", rounding="sr", four_over_six="mse")
    with pytest.raises(ValueError, match="round-to-nearest"):
        Operand("mxfp4", four_over_six="mae")
    with pytest.raises(ValueError, match="'mae', 'mse' or None"):
        Operand("nvfp4", four_over_six="l1")
    with pytest.raises(ValueError, match="four_over_six='l1'"):
        Recipe.preset("nvfp4_paper", four_over_six="l1")


_ORDER_SCRIPT = """
import {order}
import hashlib, os, sys
import numpy as np, torch
before = dict(os.environ)
import fp4sim
from fp4sim.torch import QuantLinear
from fp4sim.training import Recipe
assert dict(os.environ) == before, "importing fp4sim changed the environment"
torch.manual_seed(0)
h = hashlib.sha256()
for acc in ("fast", "exact"):
    lin = QuantLinear(96, 80, recipe=Recipe.preset("nvfp4_paper", accumulate=acc))
    x = torch.randn(64, 96, requires_grad=True)
    y = lin(x)
    y.backward(torch.randn_like(y))
    for t in (y, x.grad, lin.weight.grad):
        h.update(t.detach().numpy().tobytes())
print(h.hexdigest())
"""


def test_the_bridge_gives_the_same_bits_whatever_the_import_order():
    """torch, NumPy or fp4sim imported first (fresh processes, with and without a Numba kernel run before torch
    is imported): importing fp4sim changes no environment variable, and a QuantLinear's output and gradients
    (fast and exact accumulation) are the same bytes."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT")}
    outs = {}
    for order in ("torch", "numpy", "fp4sim",
                  "fp4sim, numpy; fp4sim.quantize(numpy.ones((64, 64), numpy.float32), 'nvfp4')"):
        out = subprocess.run([sys.executable, "-c", _ORDER_SCRIPT.format(order=order)], env=base,
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        outs[order] = out.stdout.split()[-1]
    assert len(set(outs.values())) == 1, outs


def test_the_bridge_multiplies_with_torch_and_equals_the_numpy_rule_under_it(monkeypatch):
    """Inside a pass the float32 GEMMs go through torch.matmul (torch's threads), nowhere else: the layer's
    output and gradients equal fp4sim.emulate's with matmul_by(torch) bit for bit; with exact accumulation
    (sums independent of the BLAS) they equal the plain NumPy rule too; outside a pass NumPy multiplies."""
    from fp4sim import _xp
    from fp4sim.torch.function import _torch_matmul
    calls = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    rng = np.random.default_rng(3)
    x, dy = heavy((48, 64), 4), rng.standard_normal((48, 40)).astype(np.float32)
    a1 = Operand("nvfp4", (1, 16))
    reuse = dict(fprop_x=a1, wgrad_x=a1, wgrad_x_reuse_fprop=True, dgrad_w_reuse_fprop=True)
    for acc, rec in (("fast", Recipe.preset("nvfp4_paper", accumulate="fast")),
                     ("exact", Recipe.preset("nvfp4_paper", accumulate="exact")),
                     ("fast", Recipe.preset("bf16", accumulate="fast", **reuse)),        # the reuse GEMMs
                     ("exact", Recipe.preset("bf16", accumulate="exact", **reuse))):
        lin = QuantLinear(64, 40, bias=False, recipe=rec)
        w = lin.weight.detach().numpy().copy()
        xt = torch.from_numpy(x.copy()).requires_grad_()
        calls.clear()
        y = lin(xt)
        y.backward(torch.from_numpy(dy))
        if acc == "fast":
            assert len(calls) == 3, calls                          # Fprop, Dgrad, Wgrad
        calls.clear()

        def run(k=lin.layer_index):
            y, qw, qx = emulate.fprop(x, w, rec, layer=k, return_qx=True)
            return y, emulate.dgrad(dy, w, rec, layer=k, qw_fprop=qw), emulate.wgrad(dy, x, rec, layer=k, qx_fprop=qx)
        with _xp.matmul_by(_torch_matmul):
            want = run()
        numpy_rule = run()
        got = (y.detach().numpy(), xt.grad.numpy(), lin.weight.grad.numpy())
        for g, wnt, ref in zip(got, want, numpy_rule):
            assert np.array_equal(g.view(np.uint32), wnt.view(np.uint32))
            if acc == "exact" and rec.fprop_w.scheme == "nvfp4":
                assert np.array_equal(g.view(np.uint32), ref.view(np.uint32))
    assert _xp._MATMUL.get() is None


def test_bridge_threads_limit_numba_inside_a_pass_only(monkeypatch):
    """With bridge_threads(1), Fprop, Dgrad and Wgrad run with one Numba thread, and the count is back
    afterwards; bridge_threads(0) returns to the default (None: the process's count); bad counts are refused."""
    import numba
    from fp4sim import threads
    seen = []
    for name in ("fprop", "dgrad", "wgrad"):
        real = getattr(emulate, name)

        def spy(*a, _real=real, **k):
            seen.append(numba.get_num_threads())
            return _real(*a, **k)
        monkeypatch.setattr(emulate, name, spy)
    before = numba.get_num_threads()
    try:
        assert threads.bridge_threads(1) == 1
        layer = QuantLinear(32, 16, recipe=Recipe.preset("nvfp4_paper", accumulate="fast"))
        layer(torch.randn(8, 32, requires_grad=True)).sum().backward()
    finally:
        assert threads.bridge_threads(0) is None
    assert seen == [1, 1, 1]
    assert numba.get_num_threads() == before
    seen.clear()
    layer(torch.randn(8, 32, requires_grad=True)).sum().backward()
    assert seen == [before] * 3
    with pytest.raises(ValueError, match="threads"):
        threads.bridge_threads(-1)


# ------------------------------------------------------------------------------------------------ audit pins
@pytest.mark.parametrize("dtype,big", [(torch.float16, 6.0e4), (torch.bfloat16, 3.0e38)])
def test_a_finite_half_precision_input_whose_sum_overflows_is_finite(dtype, big):
    """Every element finite, but their sum overflows the dtype: not a non-finite operand, so a healthy run under
    on_nonfinite='raise' goes on (and 'warn' says nothing)."""
    x = torch.full((8, 64), big, dtype=dtype)
    assert not torch.isfinite(x.sum()) and torch.isfinite(x).all()
    for mode in ("raise", "warn"):
        lin = _layer(Recipe.preset("nvfp4_paper", on_nonfinite=mode))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", message=".*overflow.*")          # the output may overflow; x is finite
            y = lin(x.clone())
        assert y.dtype == dtype and y.shape == (8, 32)


def test_an_inf_operand_does_not_warn_of_nan():
    """+Inf in the input (no NaN): the layer does not claim the input holds NaN; on_nonfinite='raise' names it
    Inf."""
    x = torch.from_numpy(heavy((16, 64), 8))
    x[2, 3] = float("inf")
    lin = _layer("nvfp4_paper")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        lin(x)
    assert not [w for w in got if "holds NaN" in str(w.message)], [str(w.message) for w in got]
    with pytest.raises(FloatingPointError, match="the input .* holds Inf"):
        _layer(Recipe.preset("nvfp4_paper", on_nonfinite="raise"))(x)


def test_kept_layers_and_the_head_honour_the_recipes_on_nonfinite():
    """convert(model, Recipe(..., on_nonfinite='raise')): the layers it keeps in BF16 (keep_last, the head) run
    a BF16 recipe with the same on_nonfinite, so a NaN reaching the head stops the pass there, naming it."""
    model = convert(Net(), Recipe.preset("nvfp4_paper", keep_last=1, on_nonfinite="raise"))
    assert model.layers[1].up._fp4sim_kept and model.head._fp4sim_kept
    for lin in (model.layers[1].up, model.head, model.layers[0].up):
        assert lin.recipe.on_nonfinite == lin.recipe_backward.on_nonfinite == "raise"
    h = torch.randn(4, 32)
    h[0, 0] = float("nan")
    for name in ("head", "layers.1.up"):
        with pytest.raises(FloatingPointError, match=rf"layer '{name}': the input"):
            model.get_submodule(name)(h)


class _Wrapped(torch.nn.Module):
    """A Hugging Face-like wrapper: the network under ``transformer`` (head ``transformer.head``) and a second
    under ``model`` with its head ``model.lm_head``."""

    def __init__(self):
        super().__init__()
        self.transformer = Net(head="head")
        self.model = Net(head="lm_head")

    def forward(self, idx):
        return self.transformer(idx) + self.model(idx)


def test_convert_keeps_a_head_under_a_wrapper_in_high_precision():
    model = convert(_Wrapped(), "nvfp4_paper")
    for name in ("transformer.head", "model.lm_head"):
        lin = model.get_submodule(name)
        assert lin._fp4sim_kept and lin.recipe.name == lin.recipe_backward.name == "bf16", name
    for name in ("transformer.layers.0.up", "model.layers.1.down"):
        assert model.get_submodule(name).recipe.name == "nvfp4_paper", name
    _loss(model, _data()).backward()


def test_convert_of_a_converted_model_sets_the_new_recipe_forward_and_backward():
    """Documented: converting again keeps the QuantLinear modules (parameters, SR call counts) and gives each the
    new recipe for Fprop and for Dgrad / Wgrad, with the keep rules applied anew — also after set_recipe split
    the forward from the backward."""
    model = convert(Net(), "nvfp4_paper")
    _loss(model, _data()).backward()
    set_recipe(model, "bf16", which="forward")
    mods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    calls = {n: m._calls for n, m in mods.items()}
    weights = {n: m.weight for n, m in mods.items()}
    convert(model, Recipe.preset("mxfp4_paper", keep=("layers.0.*",)))
    now = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert all(now[n] is mods[n] and now[n].weight is weights[n] and now[n]._calls == calls[n] for n in mods)
    want = {"layers.0.up": "bf16", "layers.0.down": "bf16", "layers.1.up": "mxfp4_paper",
            "layers.1.down": "mxfp4_paper", "head": "bf16"}
    assert {n: (m.recipe.name, m.recipe_backward.name) for n, m in now.items()} == {n: (r, r) for n, r in want.items()}
    assert [m.layer_index for m in now.values()] == list(range(5))


def test_a_grid_recipe_trains_a_model_whose_kept_layers_run_bf16_gemms():
    """Recipe(accumulate='k64_rtz', accumulate_grid=1024): the grid belongs to the NVFP4 models; the kept BF16
    layers (the head, the last block) take their exact rule and the step runs; the head's output is the BF16
    recipe's with the exact rule, bit for bit."""
    rec = Recipe.preset("nvfp4_paper", keep_last=1, accumulate="k64_rtz", accumulate_grid=1024)
    model = convert(Net(), rec)
    _loss(model, _data()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    h = torch.randn(6, 32)
    plain = QuantLinear(32, 32, bias=False, recipe="bf16")
    with torch.no_grad():
        plain.weight.copy_(model.head.weight)
    assert torch.equal(model.head(h), plain(h))


class _Counter(torch.nn.Module):
    """Scales its input by a buffer it increments on every call (a stand-in for any module whose buffers change
    what the next call computes)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1
        return x * self.n


def test_gradient_fidelity_isolates_its_two_runs():
    """Dropout draws the same masks in both runs (the torch RNG is reset between them), a buffer that changes on
    every call starts both runs from its value (buffers reset between runs), a BatchNorm's running statistics
    are as before afterwards, and the torch RNG is restored: the SNR equals one computed by hand on two copies
    run from the same RNG state."""
    from fp4sim.torch import gradient_fidelity
    torch.manual_seed(11)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                              torch.nn.Dropout(0.5), _Counter(), torch.nn.Linear(64, 16))
    model = convert(net, Recipe.preset("nvfp4_paper", seed=4), quantize_head=True)
    model.train()
    x, t = torch.randn(48, 32), torch.randn(48, 16)
    loss = lambda m: torch.nn.functional.mse_loss(m(x), t).backward()  # noqa: E731
    rng = torch.get_rng_state()
    bufs = [b.clone() for b in model.buffers()]
    q, ref = copy.deepcopy(model), copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, QuantLinear):
            m.recipe = m.recipe_backward = "none"
    torch.set_rng_state(rng)
    loss(q)
    torch.set_rng_state(rng)
    loss(ref)
    torch.set_rng_state(rng)
    ds = gradient_fidelity(model, lambda: loss(model))
    for n in ("0", "5"):
        gq, gr = (c.get_submodule(n).weight.grad.double() for c in (q, ref))
        assert float(ds.snr.sel(layer=n)) == pytest.approx(float(gr.norm() / (gq - gr).norm()), rel=1e-12), n
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(bufs, model.buffers()))
    assert float(model[4].n) == 0 and float(q[4].n) == 1


def test_a_state_saved_under_another_backward_recipe_warns_naming_it():
    """The saved fingerprint covers the backward recipe too: a layer whose forward recipe is the checkpoint's but
    whose backward recipe is another warns, naming the backward recipe the checkpoint was saved under."""
    import warnings
    from fp4sim.torch import RecipeMismatchWarning, set_recipe

    def model(backward):
        torch.manual_seed(0)
        m = convert(torch.nn.Sequential(torch.nn.Linear(32, 16)), Recipe.preset("nvfp4_paper", seed=1),
                    quantize_head=True)
        if backward:
            set_recipe(m, Recipe.preset(backward, seed=1), which="backward")
        return m
    a = model("mxfp4_paper")
    a(torch.randn(4, 32)).sum().backward()
    st = a.state_dict()
    with pytest.warns(RecipeMismatchWarning, match="backward 'mxfp4_paper'"):
        model(None).load_state_dict(st)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeMismatchWarning)
        model("mxfp4_paper").load_state_dict(st)                      # the same two recipes: no warning


def test_more_pending_compiled_forwards_than_kept_drop_the_oldest():
    """The compiled path's operators keep at most 16 forwards per layer waiting for their backward: the 17th
    forward drops the oldest, whose backward then says why it has no forward; the others' backwards run, and
    give the eager layer's gradient for the same call."""
    from fp4sim.torch.compile_ops import _PENDING_MAX
    torch.manual_seed(0)
    m = convert(torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False)), Recipe.preset("nvfp4_paper", seed=1),
                quantize_head=True)
    eager = copy.deepcopy(m)
    q = m[0]
    xs = [torch.randn(4, 32, generator=torch.Generator().manual_seed(i), requires_grad=True)
          for i in range(_PENDING_MAX + 1)]
    ys = [torch.ops.fp4sim.qlinear(x, q.weight, q._fp4sim_key, True)[0] for x in xs]
    assert sorted(q._pending) == list(range(1, _PENDING_MAX + 1))            # call 0, the oldest, dropped
    with pytest.raises(RuntimeError, match=f"holds no forward call 0 .*more than {_PENDING_MAX} forwards"):
        ys[0].sum().backward()
    assert q.weight.grad is None
    ys[-1].sum().backward()
    with torch.no_grad():
        for x in xs[:-1]:                                                    # the eager layer's calls 0..15
            eager(x)
    ye = eager(xs[-1].detach())                                              # and its call 16
    ye.sum().backward()
    assert torch.equal(ys[-1].detach(), ye.detach())
    assert torch.equal(q.weight.grad, eager[0].weight.grad)
