"""Crafted boundary inputs, copies, and the rough edges of the tools on real inputs: each test fails when the
behaviour it names is broken (they were checked by injecting those bugs)."""
from __future__ import annotations

import copy
import json
import math
import pickle
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import fp4sim as fs
from fp4sim.layout import pack_fp4, unpack_fp4
from fp4sim.reference.blocks import mx_ref, nvfp4_ref
from fp4sim.validate import compare

f32 = np.float32


def _bits(a, d):
    return (np.array([a], np.float32).view(np.uint32).astype(np.int64) + d).astype(np.uint32).view(np.float32)[0]


# ----------------------------------------------------------------------------------------------- scale boundaries
def test_te_and_paper_orders_give_different_scale_bytes():
    """Tensor amax 95.09591, block amax 2.0165424: te's amax_b * fl(S_enc * fl(1/6)) gives byte 82, the paper's
    fl(amax_b / 6) * S_enc gives 81 (computed here from the formulas, float32 op by op)."""
    x = np.zeros((2, 32), np.float32)
    x[0, 0], x[1, 0], x[1, 1] = f32(95.09591), f32(2.0165424), 1.0
    s_enc = f32(2688.0) / f32(95.09591)
    te = fs.encode(np.array([f32(2.0165424) * f32(s_enc * (f32(1) / f32(6)))]), fs.E4M3)[0]
    paper = fs.encode(np.array([f32(f32(2.0165424) / f32(6)) * s_enc]), fs.E4M3)[0]
    assert (te, paper) == (82, 81)
    assert fs.quantize(x, "nvfp4", flavor="te").scales[1, 0] == 82
    assert fs.quantize(x, "nvfp4", flavor="paper").scales[1, 0] == 81
    for fl in ("te", "paper"):
        _, s = nvfp4_ref(x, fl)
        assert np.array_equal(s, fs.quantize(x, "nvfp4", flavor=fl).scales)


def test_te_multiplies_by_the_rounded_reciprocal_of_six():
    """S_enc * fl(1/6) and fl(S_enc / 6) differ by an ulp for this tensor amax, and this block amax sits where
    that ulp changes the E4M3 byte (89 vs 88)."""
    ag, ab = f32(1.5374819040298462), f32(0.05834195017814636)
    s_enc = f32(2688.0) / ag
    assert f32(s_enc * (f32(1) / f32(6))) != f32(s_enc / f32(6))
    want = fs.encode(np.array([ab * f32(s_enc * (f32(1) / f32(6)))]), fs.E4M3)[0]
    other = fs.encode(np.array([ab * f32(s_enc / f32(6))]), fs.E4M3)[0]
    assert (want, other) == (89, 88)
    x = np.zeros((2, 16), np.float32)
    x[0, 0], x[1, 0] = ag, ab
    assert fs.quantize(x, "nvfp4").scales[1, 0] == 89
    assert fs.quantize(x, "nvfp4_2d").scales[0, 0] == fs.quantize(x[:1], "nvfp4").scales[0, 0]


@pytest.mark.parametrize("mode", ["rceil", "floor", "ceil", "even"])
def test_mx_scales_within_ulps_of_six_times_powers_of_two(mode):
    """Block amaxes 6*2^k -3..+3 ulps for |k| <= 20: the byte from exact integer/fraction arithmetic."""
    amaxes = np.array([_bits(f32(6.0 * 2.0 ** k), d) for k in range(-20, 21) for d in range(-3, 4)], np.float32)
    x = np.zeros((amaxes.size, 32), np.float32)
    x[:, 0] = amaxes
    x[:, 1] = amaxes / 3
    got = fs.quantize(x, "mxfp4", scale_mode=mode).scales[:, 0].astype(int)
    want = []
    for a in amaxes:
        if mode == "rceil":
            v = float(f32(a * (f32(1) / f32(6))))
            m, e = math.frexp(v)
            want.append((e - 1 if m == 0.5 else e) + 127)   # smallest e with 2^e >= v
        else:
            m, e = math.frexp(float(a))                    # a = m * 2^e, 0.5 <= m < 1
            E = e - 1                                      # floor(log2 a)
            if mode == "even":
                q = round(m * 4) / 4                       # a rounded to E2M1's 1 mantissa bit (ties away
                E = e - 1 + (1 if q == 1.0 else 0)         # from zero: the bit-add rule)
            elif mode == "ceil" and m != 0.5:
                E += 1
            want.append(E - 2 + 127)
    assert got.tolist() == want
    codes, scales = mx_ref(x, scale_mode=mode)
    assert np.array_equal(scales[:, 0], got)


def test_nvfp4_sr_threshold_is_inclusive_on_lattice_inputs():
    """With S_enc = 1 (global amax 2688) and a +-6 element per block the factor is exactly 1, so x = 0.5 + j/512
    has delta = j/256 exactly: SR rounds up iff j + r >= 256 (r the random byte)."""
    j = np.arange(1, 256)
    x = np.zeros((j.size, 16), np.float32)
    x[:, 0] = 6.0
    x[:, 1] = (0.5 + j / 512).astype(np.float32)
    for shift, up in ((0, True), (-1, False)):
        rb = np.zeros(x.shape, np.uint8)
        rb[:, 1] = (256 - j + shift).astype(np.uint8)
        for scheme in ("nvfp4", "nvfp4_2d"):
            q = fs.quantize(x, scheme, rounding="sr", rbits=rb, global_amax=2688.0)
            c = unpack_fp4(q.codes)[:, 1]
            assert np.all(c == (2 if up else 1)), (scheme, shift, np.flatnonzero(c != (2 if up else 1))[:5])
        e = fs.encode(x[:, 1], fs.E2M1, rounding="sr", rbits=rb[:, 1].copy())
        assert np.all(e == (2 if up else 1))


def test_lattice_ties_round_to_even_in_the_fast_paths():
    """E2M1 ties (0.25 ... 5) scaled by exactly 1 (NVFP4) or 2^0 (MX): every tie rounds to the even code."""
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    even = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 8, 5.0: 8}  # in halves of the grid: code values
    x = np.zeros((4, 32), np.float32)
    x[:, 0] = 6.0
    x[:, 16] = 6.0
    x[:, 1:8] = ties
    x[:, 17:24] = -ties
    want = np.array([fs.encode(np.array([v]), fs.E2M1)[0] for v in ties])
    assert [fs.E2M1.values[c] * 2 for c in want] == [even[float(v)] for v in ties]
    q = fs.quantize(x, "nvfp4", global_amax=2688.0)
    c = unpack_fp4(q.codes)
    assert np.array_equal(c[:, 1:8], np.tile(want, (4, 1))) and np.array_equal(c[:, 17:24], np.tile(want | 8, (4, 1)))
    qm = fs.quantize(x * f32(0.5), "mxfp4", scale_mode="floor")  # amax 3 -> scale 2^-1: x*0.5 / 2^-1 = x
    assert np.array_equal(unpack_fp4(qm.codes)[:, 1:8], np.tile(want, (4, 1)))


# ----------------------------------------------------------------------------------------------- copies
@pytest.mark.parametrize("scheme", sorted(fs.SCHEMES))
def test_quantized_tensors_and_schemes_survive_copy_deepcopy_and_pickle(scheme):
    x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    q = fs.quantize(x, scheme)
    y = fs.dequantize(q).view(np.uint32)
    for f in (copy.copy, copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        q2 = f(q)
        assert np.array_equal(fs.dequantize(q2).view(np.uint32), y)
        assert f(q.scheme) == q.scheme and f(fs.E2M1) is fs.E2M1
        assert np.array_equal(fs.quantize(x, f(q.scheme)).codes, q.codes)


# ----------------------------------------------------------------------------------------------- warnings
def test_nvfp4_warns_where_dequantize_overflows():
    x = np.ones((2, 16), np.float32)
    with pytest.warns(RuntimeWarning, match="FLT_MAX/448"):
        q = fs.quantize(x, "nvfp4", global_amax=1e36)
    with pytest.warns(RuntimeWarning, match="FLT_MAX/448"):
        fs.dequantize(q)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fs.dequantize(fs.quantize(x, "nvfp4", global_amax=7e35))


# ----------------------------------------------------------------------------------------------- validate
def test_validate_reports_the_input_index_for_axis_zero():
    x = np.random.default_rng(3).standard_normal((64, 48)).astype(np.float32)
    q = fs.quantize(x, "nvfp4", axis=0)           # blocks along axis 0: codes (48, 32)
    c = unpack_fp4(q.codes.reshape(48, -1)).copy()
    c[5, 20] ^= 1                                  # column 5 of x, row 20
    r = compare(x, pack_fp4(c), q.scales, "nvfp4", axis=0, diagnose=False)
    assert r.code_mismatches == 1
    m = r.mismatches[0]
    assert m["index"] == [20, 5] and m["x"] == float(x[20, 5]) and m["block"] == 1 and m["element"] == 4


def test_validate_accepts_one_scale_per_16x16_tile():
    x = np.random.default_rng(4).standard_normal((40, 64)).astype(np.float32)
    q = fs.quantize(x, "nvfp4_2d")
    assert q.scales.shape == (3, 4)
    assert compare(x, q.codes, q.scales, "nvfp4_2d").exact
    assert compare(x, q.codes, q.scales_per_row(), "nvfp4_2d").exact


G = np.random.default_rng(5).standard_normal((64, 256)).astype(np.float32)


def _sr_codes(x, scheme, **kw):
    q = fs.quantize(x, scheme, **kw)
    return q.codes, q.scales


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_sr_check_fails_rne_rz_and_doubled_steps_at_64x256(scheme):
    for rounding, phrase in (("rne", "round to nearest (RNE)"), ("rz", "round toward zero (RZ)")):
        c, s = _sr_codes(G, scheme, rounding=rounding)
        r = compare(G, c, s, scheme, rounding="sr")
        assert r.verdict == "sr_inconsistent", (rounding, r.summary())
        assert any("deterministic rounding (RNE/RZ)" in f and phrase in f for f in r.sr["findings"]), r.sr["findings"]
    c, s = _sr_codes(G, scheme, rounding="sr", seed=1)
    u = unpack_fp4(c.reshape(64, -1))
    mag = u & 7
    doubled = np.where((mag > 0) & (mag < 6), (u & 8) | (mag + 1), u).astype(np.uint8)
    r = compare(G, pack_fp4(doubled), s, scheme, rounding="sr")
    assert r.verdict == "sr_inconsistent" and r.sr["not_neighbour"] > 0


def test_sr_check_false_alarm_rate_is_at_most_alpha():
    alpha, n = 0.05, 120
    fails = sum(not compare(G, *_sr_codes(G, "nvfp4", rounding="sr", seed=s), "nvfp4", rounding="sr",
                            alpha=alpha).ok for s in range(n))
    # Binomial(120, <= 0.05): P(more than 14 false alarms) < 1e-3
    assert fails <= 14, fails


def test_sr_check_power_and_off_by_one():
    """An off-by-one random-bit comparison shifts the round-up rate by 1/256: below what 64x256 elements can
    show (the report says the detectable shift), caught at 512x1024."""
    rb = np.random.default_rng(6).integers(0, 256, G.shape, dtype=np.uint8)
    off = np.maximum(rb.astype(np.int16) - 1, 0).astype(np.uint8)
    r = compare(G, *_sr_codes(G, "nvfp4", rounding="sr", rbits=off), "nvfp4", rounding="sr")
    assert r.sr["detectable_rate_shift"] > 1 / 256       # the honest statement: not detectable at this size
    big = np.random.default_rng(7).standard_normal((512, 1024)).astype(np.float32)
    rb = np.random.default_rng(8).integers(0, 256, big.shape, dtype=np.uint8)
    off = np.maximum(rb.astype(np.int16) - 1, 0).astype(np.uint8)
    r = compare(big, *_sr_codes(big, "nvfp4", rounding="sr", rbits=off), "nvfp4", rounding="sr")
    assert r.sr["detectable_rate_shift"] < 1 / 256 and r.verdict == "sr_inconsistent"
    assert any("too rarely" in f for f in r.sr["findings"])


def test_sr_check_expects_the_truncated_probability_and_sees_scale_mismatches():
    """With 2 random bits the up-probability is floor(4 delta)/4, far from delta: a correct 2-bit SR kernel
    passes; a kernel whose scale bytes differ fails even when its codes are consistent with them."""
    big = np.random.default_rng(9).standard_normal((256, 256)).astype(np.float32)
    c, s = _sr_codes(big, "nvfp4", rounding="sr", seed=2, sr_bits=2)
    assert compare(big, c, s, "nvfp4", rounding="sr", sr_bits=2).ok
    assert not compare(big, c, s, "nvfp4", rounding="sr", sr_bits=8).ok
    c, s = _sr_codes(big, "nvfp4", rounding="sr", seed=2)
    s2 = s.copy()
    s2[0, 0] += 1
    r = compare(big, c, s2, "nvfp4", rounding="sr")
    assert r.verdict == "sr_inconsistent" and r.scale_mismatches == 1


def test_all_nan_input_validates_exact():
    x = np.full((4, 32), np.nan, np.float32)
    for scheme in ("nvfp4", "mxfp4", "fp8_e4m3"):
        q = fs.quantize(x, scheme)
        assert compare(x, q.codes, q.scales, scheme, global_amax=q.global_amax).exact, scheme


def _validate(*args):
    return subprocess.run([sys.executable, "-m", "fp4sim.validate", *map(str, args)], capture_output=True, text=True)


def test_validate_cli_bad_files_and_options_exit_2_in_one_line(tmp_path):
    x = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    q = fs.quantize(x, "nvfp4")
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "c.npy", q.codes)
    np.save(tmp_path / "s.npy", q.scales)
    good = ["--scheme", "nvfp4", "--input", tmp_path / "x.npy", "--codes", tmp_path / "c.npy", "--scales",
            tmp_path / "s.npy"]
    np.savez(tmp_path / "t.npz", a=x)
    (tmp_path / "trunc.npz").write_bytes((tmp_path / "t.npz").read_bytes()[:300])
    (tmp_path / "bad.safetensors").write_bytes(b"\xff\xff\xff\xff\x00\x00\x00\x00{not json")
    import torch
    import fractions
    torch.save({"t": torch.ones(2), "o": fractions.Fraction(1, 3)}, tmp_path / "pickled.pt")  # not weights-only
    cases = [
        (["--input", tmp_path / "trunc.npz"], "cannot be read"),
        (["--input", tmp_path / "bad.safetensors"], "cannot be read"),
        (["--input", tmp_path / "pickled.pt:t"], "pickled"),
        (["--json", tmp_path], "is a directory"),
        (["--json", tmp_path / "no" / "r.json"], "does not exist"),
        (["--alpha", "5"], "--alpha"),
        (["--max-mismatches", "-1"], "--max-mismatches"),
        (["--rbits", tmp_path / "c.npy"], "--rounding sr"),
        (["--global-amax", "nonsense"], "neither a file nor a number"),
    ]
    for extra, phrase in cases:
        args = list(good)
        for k in range(0, len(extra), 2):
            if extra[k] in args:
                args[args.index(extra[k]) + 1] = extra[k + 1]
            else:
                args += extra[k:k + 2]
        r = _validate(*args)
        assert r.returncode == 2, (extra, r.stderr)
        err = r.stderr.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("fp4sim.validate: bad input:")
        assert phrase in err, (extra, err)
    r = _validate(*good, "--global-amax", float(np.abs(x).max()))
    assert r.returncode == 0, r.stderr


def test_validate_cli_delayed_scaling(tmp_path):
    x = np.random.default_rng(2).standard_normal((16, 64)).astype(np.float32)
    q = fs.quantize(x, "nvfp4", global_amax=10.0)
    for n, a in (("x", x), ("c", q.codes), ("s", q.scales)):
        np.save(tmp_path / f"{n}.npy", a)
    args = ["--scheme", "nvfp4", "--input", tmp_path / "x.npy", "--codes", tmp_path / "c.npy", "--scales",
            tmp_path / "s.npy", "--global-amax", "10"]
    assert _validate(*args).returncode == 1
    r = _validate(*args, "--delayed-scaling")
    assert r.returncode == 0 and "EXACT" in r.stdout


# ----------------------------------------------------------------------------------------------- analyze inputs
def _analyze(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fp4sim.analyze", "--quiet", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd)


def test_analyze_folder_tree_with_duplicate_names_and_bad_files(tmp_path):
    import torch
    rng = np.random.default_rng(0)
    want = {}
    for step in ("step1", "step2"):
        (tmp_path / step).mkdir()
        t = torch.from_numpy(rng.standard_normal((32, 64)).astype(np.float32))
        torch.save(t, tmp_path / step / "blk.input.pt")
        want[f"{step}/blk.input"] = t.numpy()
        np.savez(tmp_path / step / "d.npz", **{"blk.weight": rng.standard_normal((16, 32)).astype(np.float32)})
    torch.save({"layer.weight": torch.ones(16, 32), "nested": {"b": torch.zeros(4, 16, dtype=torch.bfloat16) + 1.5}},
               tmp_path / "state.pt")
    np.save(tmp_path / "plain.npy", rng.standard_normal((8, 32)).astype(np.float32))
    (tmp_path / "broken.npz").write_bytes((tmp_path / "state.pt").read_bytes())   # a zip that is no npz
    np.savez(tmp_path / "bf.npz", b=np.ones((4, 16), ml_dtypes.bfloat16))
    r = _analyze(tmp_path, "--no-hadamard", "--json", tmp_path / "s.json", "--out", tmp_path / "s.nc")
    assert r.returncode == 1, r.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    names = set(s["tensors"])
    assert {"step1/blk.input", "step2/blk.input", "step1/d.npz:blk.weight", "step2/d.npz:blk.weight",
            "layer.weight", "nested.b", "plain"} <= names
    assert s["tensors"]["nested.b"]["schemes"]["bf16"]["status"] == "exact"   # 1.5 in bf16, not int16 bits
    assert s["tensors"]["layer.weight"]["schemes"]["nvfp4"]["status"] == "exact"
    reasons = {k["tensor"]: k["reason"] for k in s["skipped"]}
    assert any("not a NumPy .npz" in v for k, v in reasons.items() if k.endswith("broken.npz"))
    assert any("safetensors" in v for v in reasons.values())                  # bf16 in .npz: what to do
    import xarray as xr
    ds = xr.open_dataset(tmp_path / "s.nc")
    assert set(map(str, ds.tensor.values)) == names
    from fp4sim.analyze.inputs import discover, load
    srcs = {x.name: x for x in discover([tmp_path])[0]}
    for k, v in want.items():
        assert np.array_equal(load(srcs[k]), v)
    assert srcs["step1/blk.input"].role == "activation" and srcs["nested.b"].role == "activation"


def test_analyze_cli_checks_before_working(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "f").write_text("")
    (tmp_path / "roles").mkdir()
    np.savez(tmp_path / "roles" / "x.npz", a=np.ones((4, 16), np.float32))
    (tmp_path / "roles" / "roles.json").write_text("{bad json")
    cases = [(["--seed", "-1"], "--seed"), (["--out", tmp_path / "nodir" / "x.nc"], "does not exist"),
             (["--json", tmp_path], "is a directory"), (["--figures", tmp_path / "f"], "is a file"),
             (["--threads", "0"], "threads"), ([tmp_path / "roles"], "roles.json"),
             (["--scheduler", "tcp://127.0.0.1:9"], "no Dask scheduler answered")]
    for args, phrase in cases:
        r = _analyze(*args)
        assert r.returncode == 2 and phrase in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    r = _analyze(tmp_path / "empty")
    assert r.returncode == 2 and "no tensors found" in r.stderr


def test_wgrad_table_says_when_the_rht_was_skipped(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", **{"l.input": rng.standard_normal((40, 32)).astype(np.float32),
                                   "l.grad_output": rng.standard_normal((40, 16)).astype(np.float32)})
    r = _analyze(tmp_path / "d.npz", "--no-hadamard")
    assert r.returncode == 0
    assert "off (40 tokens, not a multiple of 16)" in r.stdout


def test_readme_first_command_runs_the_sample_analysis():
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)\n", readme).group(1)
    job = first.split("&&")[-1].split()
    assert job == ["python", "-m", "fp4sim.analyze"], first      # the installed package is the one under test
    r = subprocess.run([sys.executable] + job[1:], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "smollm2.blk29.ffn_down.weight_grad" in r.stdout and "minilm.encoder.layer.0" in r.stdout


# ----------------------------------------------------------------------------------------------- torch dump
def test_dump_linear_tensors_max_rows_and_stale_gradients(tmp_path):
    torch = pytest.importorskip("torch")
    from fp4sim.torch import dump_linear_tensors
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    xb = torch.randn(2, 10, 8)
    step = lambda: model(xb).pow(2).mean().backward()  # noqa: E731
    step()                                              # a stale gradient nobody zeroed
    stale = model[0].weight.grad.clone()
    out = dump_linear_tensors(model, step, tmp_path / "d.npz", max_rows=7)
    assert out["0.input"].shape == (7, 8) and out["0.grad_output"].shape == (7, 16)
    full = dump_linear_tensors(model, step, tmp_path / "e.npz")
    g, x = full["0.grad_output"].astype(np.float64), full["0.input"].astype(np.float64)
    assert np.allclose(full["0.weight_grad"], g.T @ x, rtol=1e-5, atol=1e-7)   # this step's own gradient
    assert np.allclose(model[0].weight.grad.numpy(), stale.numpy() * 3, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="max_rows"):
        dump_linear_tensors(model, step, tmp_path / "f.npz", max_rows=0)


def test_round_up_exponent_of_amax_over_six_is_the_same_computed_either_way():
    """TE's pow_2_scales path rounds fl(amax / 6) up to a power of two; MX rceil rounds fl(amax * fl(1/6)). Every
    float32 mantissa of several binades (2^23 each) gives the same exponent, so that path is mxfp4 rceil."""
    m = np.arange(1 << 23, dtype=np.uint32)

    def up(v):
        b = v.view(np.uint32)
        return (b >> 23).astype(np.int64) + ((b & 0x7FFFFF) != 0)

    for E in (1, 2, 100, 127, 128, 200, 254):
        a = ((np.uint32(E) << 23) | m).view(np.float32)
        with np.errstate(over="ignore"):
            assert np.array_equal(up(a / f32(6)), up(a * (f32(1) / f32(6)))), E


def test_the_array_loader_reads_bfloat16_pt_tensors_as_bfloat16(tmp_path):
    """A bfloat16 .pt tensor (alone or in a state_dict) comes back as ml_dtypes.bfloat16 with the same bits, not as
    the raw int16 words: both the validate reader (fp4sim.arrays_io.load_array) and analyze's loader."""
    torch = pytest.importorskip("torch")
    import ml_dtypes
    from fp4sim.arrays_io import load_array
    bits = np.array([0x3FC0, 0xBF80, 0x0001, 0x7F7F, 0xFF80, 0x8000, 0x4049], np.uint16)   # 1.5, -1, tiny, ...
    t = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
    torch.save(t, tmp_path / "one.pt")
    torch.save({"a": t, "b": t.float()}, tmp_path / "sd.pt")
    for spec in (str(tmp_path / "one.pt"), f"{tmp_path / 'sd.pt'}:a"):
        a = load_array(spec)
        assert a.dtype == np.dtype(ml_dtypes.bfloat16), spec
        assert np.array_equal(a.view(np.uint16), bits), spec
    assert float(load_array(str(tmp_path / "one.pt"))[0]) == 1.5
    from fp4sim.analyze.inputs import _load_pt
    b = _load_pt(tmp_path / "one.pt", None)
    assert b.dtype == np.dtype(ml_dtypes.bfloat16) and np.array_equal(b.view(np.uint16), bits)


def test_safetensors_with_float8_and_bfloat16_entries_are_read_through_ml_dtypes(tmp_path):
    """A .safetensors file of a kernel's outputs (float32 input, uint8 codes, F8_E4M3 scale bytes) beside BF16,
    F8_E5M2 and F8_E8M0 entries: each entry reads back with its own dtype and bits; validate takes the F8 scales
    (EXACT); analyze analyses the float entries and skips the others with their dtype as the reason."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    from fp4sim.arrays_io import load_array
    x = np.random.default_rng(3).standard_normal((32, 64)).astype(np.float32)
    q = fs.quantize(x, "nvfp4")
    t = {"x": torch.from_numpy(x), "codes": torch.from_numpy(q.codes),
         "scales": torch.from_numpy(q.scales).view(torch.float8_e4m3fn), "bf": torch.from_numpy(x).bfloat16(),
         "e5": torch.from_numpy(x).to(torch.float8_e5m2), "e8": torch.tensor([1.0, 2.0, 0.5]).to(torch.float8_e8m0fnu)}
    f = tmp_path / "k.safetensors"
    save_file(t, str(f))
    want = {"x": (np.float32, x.view(np.uint32)), "codes": (np.uint8, q.codes),
            "scales": (ml_dtypes.float8_e4m3fn, q.scales), "bf": (ml_dtypes.bfloat16, t["bf"].view(torch.int16).numpy()),
            "e5": (ml_dtypes.float8_e5m2, t["e5"].view(torch.uint8).numpy()),
            "e8": (ml_dtypes.float8_e8m0fnu, np.array([127, 128, 126], np.uint8))}
    for k, (dt, bits) in want.items():
        a = load_array(f"{f}:{k}")
        assert a.dtype == np.dtype(dt) and a.shape == bits.shape, k
        assert np.array_equal(a.view(bits.dtype), bits), k
    r = _validate("--scheme", "nvfp4", "--input", f"{f}:x", "--codes", f"{f}:codes", "--scales", f"{f}:scales")
    assert r.returncode == 0 and "EXACT" in r.stdout, r.stdout + r.stderr
    r = _analyze(f, "--no-hadamard", "--json", tmp_path / "s.json")
    assert r.returncode == 1, r.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert set(s["tensors"]) == {"x", "bf"}
    reasons = {k["tensor"]: k["reason"] for k in s["skipped"]}
    assert {k.rpartition(":")[2] for k in reasons} == {"codes", "scales", "e5", "e8"}
    assert any("float8_e4m3fn" in v for v in reasons.values())
    with pytest.raises(ValueError, match="holds 6 entries"):
        load_array(str(f))
    with pytest.raises(ValueError, match="no entry 'y'"):
        load_array(f"{f}:y")
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    last = max((e["data_offsets"][1], k) for k, e in json.loads(raw[8:8 + n]).items() if k != "__metadata__")[1]
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[:-1])
    with pytest.raises(ValueError, match=f"entry '{last}' is truncated"):
        load_array(f"{cut}:{last}")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="header is not JSON"):
        load_array(f"{tmp_path / 'junk.safetensors'}:x")


def test_the_fp4sim_command_lists_its_subcommands_and_runs_them(tmp_path):
    """The installed `fp4sim` console script: --help lists every subcommand; `fp4sim validate` runs the validate
    parser on real files (EXACT, exit 0; a mismatch exits 1); `fp4sim recipes` prints the recipe table of docs/training.md;
    an unknown command exits 2 with the list. The python -m forms are the same functions."""
    from pathlib import Path as _P
    from fp4sim.cli import COMMANDS
    from fp4sim.training import presets_markdown
    exe = _P(sys.executable).parent / "fp4sim"
    assert exe.is_file(), f"{exe}: the console script is installed by `pip install .` (README's commands)"
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and all(f"  {c}" in r.stdout for c in COMMANDS), r.stdout
    x = np.random.default_rng(4).standard_normal((32, 64)).astype(np.float32)
    q = fs.quantize(x, "nvfp4")
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "c.npy", q.codes)
    np.save(tmp_path / "s.npy", q.scales)
    args = ["validate", "--scheme", "nvfp4", "--input", tmp_path / "x.npy", "--codes", tmp_path / "c.npy",
            "--scales", tmp_path / "s.npy"]
    r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0 and "EXACT" in r.stdout, r.stdout + r.stderr
    bad = q.scales.copy()
    bad[0, 0] ^= 1
    np.save(tmp_path / "s.npy", bad)
    r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 1 and "MISMATCH" in r.stdout
    r = subprocess.run([str(exe), "recipes"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == presets_markdown() and "backward_override" in r.stdout
    r = subprocess.run([str(exe), "analyse"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown command 'analyse'" in r.stderr and "analyze" in r.stderr


def _safetensors_file(path, header: dict, data: bytes):
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)
    return path


def test_safetensors_metadata_is_no_entry_and_offsets_must_fit_shape_and_dtype(tmp_path):
    """Every Hugging Face file carries __metadata__: it is not an entry (a one-tensor file reads without a key,
    analyze sees one tensor). An entry whose byte offsets disagree with its shape and dtype is refused with a
    clear error, never read (it would read another entry's bytes)."""
    from safetensors.numpy import save_file
    from fp4sim._safetensors import load_safetensors, safetensors_keys
    from fp4sim.arrays_io import load_array
    w = np.random.default_rng(4).standard_normal((32, 64)).astype(np.float32)
    f = tmp_path / "model.safetensors"
    save_file({"layer.weight": w}, str(f), metadata={"format": "pt"})
    assert b"__metadata__" in f.read_bytes()[:200]
    assert safetensors_keys(f) == ["layer.weight"]
    assert np.array_equal(load_array(str(f)).view(np.uint32), w.view(np.uint32))
    with pytest.raises(ValueError, match="no entry '__metadata__'"):
        load_array(f"{f}:__metadata__")
    r = _analyze(f, "--no-hadamard", "--json", tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    assert list(json.loads((tmp_path / "s.json").read_text())["tensors"]) == ["layer.weight"]
    data = np.arange(6, dtype=np.float32).tobytes()                      # 24 bytes: a = 0..3, b = 4..5
    bad = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]},  # 16 bytes of shape, 8 of offsets
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
           "c": {"dtype": "F32", "shape": [1], "data_offsets": [8, 16]},  # 8 bytes for one float32
           "d": {"dtype": "F32", "shape": [2], "data_offsets": [24, 16]}}
    g = _safetensors_file(tmp_path / "bad.safetensors", {"__metadata__": {"format": "pt"}, **bad}, data)
    assert safetensors_keys(g) == ["a", "b", "c", "d"]
    assert np.array_equal(load_safetensors(g, "b"), [4.0, 5.0])
    for k in ("a", "c", "d"):
        with pytest.raises(ValueError, match=f"entry '{k}' is truncated or corrupt"):
            load_safetensors(g, k)
