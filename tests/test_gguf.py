"""llama.cpp's GGUF FP4 tensors (ggml's MXFP4 and NVFP4 block types): files written by gguf-py's own writer and
quantizer from real MiniLM weights, read back into fp4sim's conventions and decoded bit for bit as gguf-py decodes
them; ggml's MXFP4 quantizer rule against gguf-py's ``quantize_blocks`` byte for byte, on real weights and on
values placed on its ties, and where fp4sim's ``mxfp4`` (floor scale mode) differs from it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fp4sim as fs
from fp4sim.gguf import from_ggml_order, ggml_mxfp4_quantize, read_gguf, to_ggml_order
from fp4sim.layout import pack_fp4, unpack_fp4
from peers import import_or_missing, write_gguf

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "fp4sim" / "data" / "sample_dump.npz"


def _weights():
    z = np.load(SAMPLE)
    return {"query": z["minilm.encoder.layer.0.attention.self.query.weight"],
            "ffn": z["minilm.encoder.layer.5.intermediate.dense.weight"]}


def _ties():
    """Blocks whose elements sit exactly on the rule's ties (midpoints between E2M1 values times the scale), on
    both signs, small negatives that round to zero, amaxes on and off powers of two (values above 6 x scale clip),
    and an all-zero block."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    rows = []
    for e in (-3, 0, 5):
        s = np.float32(2.0 ** e)
        b = np.concatenate([mids, -mids, [-0.1, -0.2, 0.2, -1e-3], [4.0, 7.9, -7.5, 6.0, 3.0],
                            [0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 0.0, -0.0, 1.5]]).astype(np.float32)[:32] * s
        rows.append(b)
    rows.append(np.zeros(32, np.float32))
    return np.stack(rows)


def _gguf_bytes(x):
    q = import_or_missing("gguf.quants")
    gg = import_or_missing("gguf")
    return q.quantize(x, gg.GGMLQuantizationType.MXFP4)


@pytest.mark.parametrize("case", ["query", "ffn", "ties"])
def test_ggml_mxfp4_rule_is_gguf_pys_byte_for_byte(case):
    x = _ties() if case == "ties" else _weights()[case]
    codes, scales = ggml_mxfp4_quantize(x)
    theirs = _gguf_bytes(x).reshape(x.shape[0], -1, 17)
    assert np.array_equal(scales, theirs[:, :, 0])
    ours = to_ggml_order(unpack_fp4(codes), 32).reshape(x.shape[0], -1, 16)
    assert np.array_equal(ours, theirs[:, :, 1:])


def test_ggml_mxfp4_against_fp4sims_floor_mode():
    """fp4sim's mxfp4 with scale_mode="floor" (round-to-nearest-even) gives ggml's scale bytes; its codes differ
    where a negative value rounds to zero (ggml +0, fp4sim -0) and where an element sits on a tie (ggml: the
    smaller magnitude; fp4sim: the even code)."""
    for x in (_weights()["ffn"], _ties()):
        codes, scales = ggml_mxfp4_quantize(x)
        q = fs.quantize(x, "mxfp4", scale_mode="floor")
        assert np.array_equal(np.asarray(q.scales).reshape(scales.shape), scales)
        g, f = unpack_fp4(codes), unpack_fp4(np.asarray(q.codes).reshape(x.shape[0], -1))
        diff = g != f
        zero = diff & (g == 0) & (f == 8)
        s = np.repeat(np.ldexp(np.float64(1), scales.astype(np.int64) - 127), 32, axis=1)
        y = np.abs(x.astype(np.float64)) / s                               # the element in units of the scale
        grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
        tie = np.isin(y, (grid[:-1] + grid[1:]) / 2)
        assert not (diff & ~zero & ~tie).any()
        assert zero.any() and (diff & tie).any() == (x.shape[0] == 4)      # the ties case has both kinds
    # on the real FFN weight: every scale byte and 95-96% of the codes, the rest all +0 against -0
    x = _weights()["ffn"]
    g = unpack_fp4(ggml_mxfp4_quantize(x)[0])
    f = unpack_fp4(np.asarray(fs.quantize(x, "mxfp4", scale_mode="floor").codes).reshape(x.shape[0], -1))
    assert 0.94 < (g == f).mean() < 0.97


def test_one_detail_changed_fails_the_oracle():
    """The oracle tells the rule from its neighbours: ties to even, the round-up (rceil) scale, fp4sim's nibble
    order."""
    x = _ties()
    theirs = _gguf_bytes(x).reshape(x.shape[0], -1, 17)
    q = fs.quantize(x, "mxfp4", scale_mode="floor")                     # ties to even
    even = to_ggml_order(unpack_fp4(np.asarray(q.codes).reshape(4, -1)), 32).reshape(4, -1, 16)
    assert not np.array_equal(even, theirs[:, :, 1:])
    rceil = fs.quantize(_weights()["ffn"], "mxfp4", scale_mode="rceil")
    assert not np.array_equal(np.asarray(rceil.scales).reshape(1536, -1),
                              _gguf_bytes(_weights()["ffn"]).reshape(1536, -1, 17)[:, :, 0])
    codes, _ = ggml_mxfp4_quantize(x)
    assert not np.array_equal(codes.reshape(4, -1, 16), theirs[:, :, 1:])   # fp4sim's packing is not ggml's


def test_a_gguf_file_reads_as_gguf_py_decodes_it(tmp_path):
    """A GGUF file written by gguf-py (an MXFP4 tensor from its own quantizer, an NVFP4 tensor's raw blocks, an F32
    tensor): the FP4 tensors' codes and scales in fp4sim's conventions, their values bit for bit gguf-py's
    dequantization; the other tensor listed with its type."""
    gg = import_or_missing("gguf")
    gq = import_or_missing("gguf.quants")
    T = gg.GGMLQuantizationType
    w = _weights()["ffn"]
    mx = gq.quantize(w, T.MXFP4)
    rng = np.random.default_rng(3)
    R, K = 64, 128
    sc = rng.integers(0x08, 0x7F, (R, K // 16)).astype(np.uint8)              # UE4M3 bytes, subnormal to 240
    sc[0, 0], sc[1, 1] = 0x00, 0x7F                                              # zero and ggml's "0x7F is zero"
    c = rng.integers(0, 16, (R, K)).astype(np.uint8)
    nv = np.concatenate([sc.reshape(R, K // 64, 4), to_ggml_order(c, 16).reshape(R, K // 64, 32)], -1)
    nv = nv.reshape(R, -1)
    wr = gg.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    wr.add_tensor("blk.0.ffn_up.weight", mx, raw_dtype=T.MXFP4)
    wr.add_tensor("blk.0.attn_q.weight", nv, raw_dtype=T.NVFP4)
    wr.add_tensor("blk.0.attn_norm.weight", np.ones(384, np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    f = read_gguf(tmp_path / "m.gguf")
    assert set(f.fp4) == {"blk.0.ffn_up.weight", "blk.0.attn_q.weight"}
    assert f.tensors["blk.0.attn_norm.weight"].type == "F32" and not f.tensors["blk.0.attn_norm.weight"].fp4
    t = f.tensors["blk.0.ffn_up.weight"]
    assert t.type == "MXFP4" and t.shape == w.shape
    codes, scales = ggml_mxfp4_quantize(w)
    assert np.array_equal(t.codes, codes) and np.array_equal(t.scales, scales)
    dq = gq.dequantize(mx, T.MXFP4)
    assert t.values().tobytes() == dq.astype(np.float32).tobytes()
    n = f.tensors["blk.0.attn_q.weight"]
    assert n.type == "NVFP4" and n.shape == (R, K) and np.array_equal(n.scales, sc)
    assert np.array_equal(unpack_fp4(n.codes), c)
    assert n.values().tobytes() == gq.dequantize(nv, T.NVFP4).astype(np.float32).tobytes()
    assert (n.values()[1, 16:32] == 0).all()                                    # 0x7F: zero, as ggml reads it
    with pytest.raises(ValueError, match="not one of ggml's FP4 types"):
        f.tensors["blk.0.attn_norm.weight"].codes


def test_orders_and_bad_input(tmp_path):
    c = np.random.default_rng(0).integers(0, 16, (3, 64)).astype(np.uint8)
    for sub in (16, 32):
        assert np.array_equal(from_ggml_order(to_ggml_order(c, sub), sub), c)
    b = to_ggml_order(c, 32)
    assert b[0, 0] == c[0, 0] | (c[0, 16] << 4)                                 # element j and j + 16 share byte j
    assert pack_fp4(c)[0, 0] == c[0, 0] | (c[0, 1] << 4)                        # fp4sim: 2i and 2i + 1
    with pytest.raises(ValueError, match="NaN or Inf"):
        ggml_mxfp4_quantize(np.full((1, 32), np.nan, np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        ggml_mxfp4_quantize(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="below 2\\^-125"):
        ggml_mxfp4_quantize(np.full((1, 32), 1e-39, np.float32))
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        read_gguf(tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="no such file"):
        read_gguf(tmp_path / "missing.gguf")


def test_analyze_reads_a_gguf_file(tmp_path):
    """python -m fp4sim.analyze FILE.gguf: each tensor by its GGUF name, FP4 tensors as ggml reads them, other
    quantized types as gguf-py dequantizes them, float tensors as stored."""
    gg = import_or_missing("gguf")
    gq = import_or_missing("gguf.quants")
    from fp4sim.analyze.inputs import discover, load
    T = gg.GGMLQuantizationType
    w = _weights()["query"]
    mx = gq.quantize(w, T.MXFP4)
    q41 = gq.quantize(w, T.Q4_1)
    wr = gg.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    wr.add_tensor("blk.0.attn_q.weight", mx, raw_dtype=T.MXFP4)
    wr.add_tensor("blk.0.attn_k.weight", q41, raw_dtype=T.Q4_1)
    wr.add_tensor("blk.0.attn_v.weight", w)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    srcs, problems, _ = discover([str(tmp_path / "m.gguf")])
    assert not problems and [s.name for s in srcs] == ["blk.0.attn_q.weight", "blk.0.attn_k.weight",
                                                       "blk.0.attn_v.weight"]
    assert {s.role for s in srcs} == {"weight"}
    got = {s.name: load(s) for s in srcs}
    assert got["blk.0.attn_q.weight"].tobytes() == gq.dequantize(mx, T.MXFP4).astype(np.float32).tobytes()
    assert got["blk.0.attn_k.weight"].tobytes() == gq.dequantize(q41, T.Q4_1).astype(np.float32).tobytes()
    assert got["blk.0.attn_v.weight"].tobytes() == w.tobytes()
    from fp4sim.analyze import analyze
    ds = analyze([str(tmp_path / "m.gguf")], schemes=["mxfp4_floor"], quiet=True, hadamard=False)
    assert list(ds.tensor.values) == [s.name for s in srcs]


def test_ggml_ue4m3_is_gguf_pys_on_every_float32_pattern_in_range():
    """ggml's UE4M3 rounding against gguf-py's fp32_to_ue4m3 (its port of ggml_fp32_to_ue4m3): every 97th float32
    bit pattern from 0 to 464, and the edges (the subnormal boundary, the half-up ties, [248, 256) -> 448)."""
    gq = import_or_missing("gguf.quants")
    from fp4sim.gguf import ggml_ue4m3
    v = np.arange(0, 0x43E80000, 97, dtype=np.uint32).view(np.float32)
    edges = np.array([0, 2.0 ** -10, 2.0 ** -9, 7.5 / 512, 7.9 / 512, 2.0 ** -6, 1.0625, 1.1875, 240, 247.9, 248,
                      255.9, 256, 300, 448, 460, -1.0], np.float32)
    v = np.concatenate([v, edges]).astype(np.float32)
    assert np.array_equal(ggml_ue4m3(v), gq.NVFP4.fp32_to_ue4m3(v))
    assert ggml_ue4m3(np.float32(1.0625)) == 0x39 and ggml_ue4m3(np.float32(250)) == 0x7E      # half up; 448
    assert fs.encode(np.array([1.0625], np.float32), "E4M3")[0] == 0x38                          # RNE: even


def _nvfp4_oracle(x):
    """ggml's quantize_row_nvfp4_ref composed of gguf-py's own pieces: its UE4M3 encoder and decoder (with the 0.5
    factor) and the doubled E2M1 table, the first nearest candidate per element; the GGUF rows."""
    gq = import_or_missing("gguf.quants")
    R, K = x.shape
    blk = x.reshape(R, K // 16, 16)
    ue = gq.NVFP4.fp32_to_ue4m3((np.abs(blk).max(-1) / np.float32(6)).astype(np.float32))
    d = gq.NVFP4.ue4m3_to_fp32(ue).astype(np.float32)
    kv = np.array(gq.NVFP4.kvalues, np.float32)
    err = np.abs((d[..., None, None] * kv).astype(np.float32) - blk[..., None]).astype(np.float32)
    idx = np.argmin(err, -1).astype(np.uint8).reshape(R, K)
    q = to_ggml_order(idx, 16).reshape(R, K // 64, 32)
    return np.concatenate([ue.reshape(R, K // 64, 4), q], -1).reshape(R, -1)


def test_ggml_nvfp4_rule_against_gguf_pys_pieces_and_its_decoder():
    from fp4sim.gguf import ggml_nvfp4_quantize, to_gguf_blocks
    gg = import_or_missing("gguf")
    gq = import_or_missing("gguf.quants")
    ties = _ties()[:, :32].reshape(-1, 64)
    ties[0, :16] = np.linspace(-6.375, 6.375, 16)                  # amax / 6 = 1.0625, a half-up tie: 1.125
    ties[1, 16:32] = np.linspace(-1500, 1500, 16)                   # amax / 6 = 250: 448
    ties = ties.astype(np.float32)
    for x in (_weights()["query"], _weights()["ffn"][:, :320].copy(), ties):
        codes, scales = ggml_nvfp4_quantize(x)
        rows = to_gguf_blocks(codes, scales, "NVFP4")
        assert np.array_equal(rows, _nvfp4_oracle(x))
        dq = gq.dequantize(rows, gg.GGMLQuantizationType.NVFP4).astype(np.float32)
        assert np.isfinite(dq).all() and dq.shape == x.shape
    assert scales[0, 0] == 0x39 and scales[1, 1] == 0x7E


_write = write_gguf


GQ, GF = "blk.0.attn_q.weight", "blk.0.ffn_up.weight"
_BLOCK_BYTES = {"MXFP4": 17, "NVFP4": 36}


def _clean(tmp_path):
    from fp4sim.gguf import ggml_nvfp4_quantize, to_gguf_blocks
    w = _weights()
    mx = _gguf_bytes(w["query"])
    nv = to_gguf_blocks(*ggml_nvfp4_quantize(w["ffn"]), "NVFP4")
    ref = _write(tmp_path / "ref.gguf", {GQ: w["query"], GF: w["ffn"]})           # an F32 GGUF as the reference
    return mx, nv, ref, w


def test_validate_checkpoint_on_a_gguf_file(tmp_path):
    import subprocess
    import sys
    from fp4sim.validate.checkpoint import check_checkpoint
    mx, nv, ref, w = _clean(tmp_path)
    f = _write(tmp_path / "m.gguf", {GQ: (mx, "MXFP4"), GF: (nv, "NVFP4"), "norm.weight": np.ones(8, np.float32)})
    rep = check_checkpoint(f)
    assert rep.ok and rep.format == "gguf" and set(rep.tensors) == {GQ, GF}, rep.summary()
    rep = check_checkpoint(f, ref)
    assert rep.ok and all(t["exact"] for t in rep.tensors.values()), rep.summary()
    assert rep.tensors[GQ]["rule"] == "ggml's MXFP4 quantizer"
    assert rep.tensors[GF]["rules"] == ["ggml's NVFP4 quantizer"]
    r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "checkpoint", str(f), "--reference", str(ref)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0 and "2 of 2 equal to the reference" in r.stdout, r.stdout + r.stderr
    assert not check_checkpoint(_write(tmp_path / "none.gguf", {"a.weight": w["query"]})).ok


def _pairs(rows, kind):
    """GGUF rows with each block's code bytes in fp4sim / gpt-oss pair order instead of ggml's halves."""
    from fp4sim.checkpoints.gguf import _BLOCK, _SUB
    n, nbytes, ns = _BLOCK[kind]
    b = rows.reshape(rows.shape[0], -1, nbytes).copy()
    from fp4sim.gguf import from_ggml_order
    q = b[:, :, ns:].reshape(rows.shape[0], -1)
    b[:, :, ns:] = pack_fp4(from_ggml_order(q, _SUB[kind])).reshape(b[:, :, ns:].shape)
    return b.reshape(rows.shape)


def _scale_plus(rows, kind, step):
    from fp4sim.checkpoints.gguf import _BLOCK
    n, nbytes, ns = _BLOCK[kind]
    b = rows.reshape(rows.shape[0], -1, nbytes).copy()
    b[:, :, :ns] = (b[:, :, :ns].astype(np.int16) + step).clip(0, 254).astype(np.uint8)
    return b.reshape(rows.shape)


@pytest.mark.parametrize("kind", ["MXFP4", "NVFP4"])
@pytest.mark.parametrize("fault", ["pairs", "binade", "binade low"])
def test_each_gguf_fault_is_named(tmp_path, kind, fault):
    from fp4sim.validate.checkpoint import check_checkpoint
    mx, nv, ref, w = _clean(tmp_path)
    rows, name = (mx, GQ) if kind == "MXFP4" else (nv, GF)
    step = (1 if kind == "MXFP4" else 8) * (-1 if fault == "binade low" else 1)
    if fault == "binade low":
        # one binade off is the exponent field off by one: ggml's UE4M3 bytes of these weights reach into the
        # subnormal range (bytes 3 to 7), where it is not, so the weights are scaled by 2^4 for this case
        from fp4sim.gguf import ggml_nvfp4_quantize, to_gguf_blocks
        x = w["query" if kind == "MXFP4" else "ffn"] * np.float32(16)
        rows = _gguf_bytes(x) if kind == "MXFP4" else to_gguf_blocks(*ggml_nvfp4_quantize(x), "NVFP4")
        ref = _write(tmp_path / "ref16.gguf", {name: x})
        assert rows.reshape(rows.shape[0], -1, _BLOCK_BYTES[kind])[:, :, 0].min() >= (1 if kind == "MXFP4" else 16)
    bad = _pairs(rows, kind) if fault == "pairs" else _scale_plus(rows, kind, step)
    f = _write(tmp_path / "bad.gguf", {name: (bad, kind)})
    rep = check_checkpoint(f, ref)
    phrase = {"pairs": "gpt-oss's pair order", "binade": "one binade high", "binade low": "one binade low"}[fault]
    rule = "ggml's MXFP4 quantizer" if kind == "MXFP4" else "ggml's NVFP4 quantizer"
    assert not rep.ok and any(phrase in x and rule in x for x in rep.tensors[name]["faults"]), rep.summary()


def test_gguf_checks_without_a_reference(tmp_path):
    from fp4sim.validate.checkpoint import check_checkpoint
    mx, nv, ref, w = _clean(tmp_path)
    mx2 = mx.copy().reshape(mx.shape[0], -1, 17)
    mx2[3, 2, 0] = 255
    nv2 = nv.copy().reshape(nv.shape[0], -1, 36)
    nv2[0, 0, 1] |= 0x80
    nv2[1, 0, 2] = 0x7F
    rep = check_checkpoint(_write(tmp_path / "b.gguf", {GQ: (mx2.reshape(mx.shape), "MXFP4"),
                                                        GF: (nv2.reshape(nv.shape), "NVFP4")}))
    assert any("1 E8M0 scale bytes are 255" in x for x in rep.tensors[GQ]["faults"]), rep.summary()
    assert any("1 UE4M3 scale bytes have the sign bit set" in x for x in rep.tensors[GF]["faults"]), rep.summary()
    assert any("1 scale bytes are 0x7F" in x for x in rep.tensors[GF]["faults"]), rep.summary()


def test_what_each_rule_costs_on_a_real_weight(tmp_path):
    """rule_costs on MiniLM's FFN weight: ggml's MXFP4 error and clipped-block share from gguf-py's own bytes
    (its quantizer, its decoder), ggml's NVFP4 error through gguf-py's decoder; and validate checkpoint's line."""
    gg = import_or_missing("gguf")
    gq = import_or_missing("gguf.quants")
    from fp4sim.gguf import ggml_nvfp4_quantize, rule_costs, to_gguf_blocks
    from fp4sim.validate.checkpoint import check_checkpoint
    x = _weights()["ffn"]
    c = rule_costs(x)
    x64 = x.astype(np.float64)
    ref = (x64 ** 2).sum()
    rows = _gguf_bytes(x)
    y = gq.dequantize(rows, gg.GGMLQuantizationType.MXFP4).astype(np.float64)
    assert c["rel_mse"]["ggml MXFP4"] == pytest.approx(((y - x64) ** 2).sum() / ref, rel=1e-12)
    e = rows.reshape(x.shape[0], -1, 17)[:, :, 0].astype(np.int64)
    amax = np.abs(x64).reshape(x.shape[0], -1, 32).max(-1)
    assert c["clipped_blocks"] == (amax > 6 * np.ldexp(1.0, e - 127)).mean()
    y = gq.dequantize(to_gguf_blocks(*ggml_nvfp4_quantize(x), "NVFP4"), gg.GGMLQuantizationType.NVFP4)
    assert c["rel_mse"]["ggml NVFP4"] == pytest.approx(((y.astype(np.float64) - x64) ** 2).sum() / ref, rel=1e-12)
    y = fs.fake_quantize(x, "mxfp4", scale_mode="rceil").astype(np.float64)
    assert c["rel_mse"]["MXFP4 rceil"] == pytest.approx(((y - x64) ** 2).sum() / ref, rel=1e-12)
    assert 0.3 < c["clipped_blocks"] < 0.6 and c["rel_mse"]["ggml NVFP4"] < c["rel_mse"]["ggml MXFP4"]
    mx, nv, ref_file, w = _clean(tmp_path)
    rep = check_checkpoint(_write(tmp_path / "m.gguf", {GQ: (mx, "MXFP4"), GF: (nv, "NVFP4")}), ref_file)
    assert any(n.startswith("what each rule costs on the reference") and "clip their largest values" in n
               for n in rep.notes), rep.summary()


def test_fp4_tensors_as_fp4sims_quantized_tensors(tmp_path):
    """GGUF MXFP4 and NVFP4 tensors as QuantizedTensors: fs.dequantize gives ggml's values, up to the sign of
    zero (code 8: -0 for fp4sim, +0 for ggml), and fs.gemm multiplies them."""
    from fp4sim.gguf import ggml_nvfp4_quantize, to_gguf_blocks
    w = _weights()["query"]
    f = read_gguf(_write(tmp_path / "m.gguf", {GQ: (_gguf_bytes(w), "MXFP4"),
                                               GF: (to_gguf_blocks(*ggml_nvfp4_quantize(w), "NVFP4"), "NVFP4")}))
    for t in f.fp4.values():
        q = t.quantized()
        y, v = np.asarray(fs.dequantize(q)), t.values()
        assert np.array_equal(y, v) and np.array_equal(np.where(y == 0, 0, y).view(np.uint32),
                                                       np.where(v == 0, 0, v).view(np.uint32))
    g = np.asarray(fs.gemm(f.tensors[GQ].quantized(), f.tensors[GQ].quantized(), accumulate="te_reference"))
    assert g.shape == (384, 384) and np.isfinite(g).all()


def test_the_exponent_takes_log2_in_float32():
    """An amax just below a power of two from 8 on: gguf-py's float32 log2 rounds up to the power's exponent, and
    so does the rule (one above the exact floor(log2 amax)); below 8 the two agree."""
    rows = []
    for k in (2.0, 4.0, 8.0, 1024.0):
        b = np.zeros(32, np.float32)
        b[0] = np.nextafter(np.float32(k), np.float32(0))
        b[1] = -b[0] / 3
        rows.append(b)
    x = np.stack(rows)
    codes, scales = ggml_mxfp4_quantize(x)
    theirs = _gguf_bytes(x).reshape(4, -1, 17)
    assert np.array_equal(scales, theirs[:, :, 0])
    exact = np.floor(np.log2(np.abs(x).max(1).astype(np.float64))) - 2 + 127
    assert list(scales[:, 0] - exact) == [0, 0, 1, 1]


def _retype(path, name, kind):
    """Rewrite the ggml type id of tensor ``name`` in the file's header (its bytes stay): a tensor labelled with
    the other FP4 type."""
    gg = import_or_missing("gguf")
    r = gg.GGUFReader(str(path), "r+")
    t = next(t for t in r.tensors if t.name == name)
    t.field.parts[4][0] = int(gg.GGMLQuantizationType[kind])
    r.data.flush()
    del r
    return path


@pytest.mark.parametrize("true, label", [("NVFP4", "MXFP4"), ("MXFP4", "NVFP4")])
def test_a_tensor_under_the_other_fp4_type_is_named(tmp_path, true, label):
    """NVFP4 blocks labelled MXFP4 leave bytes over in the tensor's region; MXFP4 blocks labelled NVFP4 run into
    the next tensor. Both are named without a reference (from the region's size); with one, the rule whose bytes
    the region holds. The other tensor is still checked, and exact."""
    from fp4sim.validate.checkpoint import check_checkpoint
    mx, nv, ref, w = _clean(tmp_path)
    name, other = (GF, GQ) if true == "NVFP4" else (GQ, GF)
    order = {GQ: (mx, "MXFP4"), GF: (nv, "NVFP4")}
    f = _write(tmp_path / "m.gguf", {name: order[name], other: order[other]})        # the mislabelled one first
    _retype(f, name, label)
    assert read_gguf(f).tensors[name].type == label
    for reference in (None, ref):
        rep = check_checkpoint(f, reference)
        t = rep.tensors[name]
        assert not rep.ok and any(f"{true} blocks under an {label} type" in x for x in t["faults"]), rep.summary()
        assert rep.tensors[other]["ok"], rep.summary()
    rule = "ggml's NVFP4 quantizer" if true == "NVFP4" else "ggml's MXFP4 quantizer"
    assert any(rule in x and "from the reference" in x for x in t["notes"]), rep.summary()
    assert rep.tensors[other]["exact"]


def test_a_truncated_file_names_the_tensor_and_checks_the_others(tmp_path):
    import subprocess
    import sys
    from fp4sim.validate.checkpoint import check_checkpoint
    mx, nv, ref, w = _clean(tmp_path)
    f = _write(tmp_path / "m.gguf", {GQ: (mx, "MXFP4"), GF: (nv, "NVFP4")})
    data = f.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-1000])
    g = read_gguf(cut)
    t = g.tensors[GF]
    assert t.missing == 1000 and t.n_bytes == nv.size and g.tensors[GQ].missing == 0
    with pytest.raises(ValueError, match="truncated: the file ends 1000 bytes"):
        t.codes
    rep = check_checkpoint(cut, ref)
    e = rep.tensors[GF]
    assert any("truncated: the file ends 1000 bytes" in x for x in e["faults"]), rep.summary()
    assert any(f"the {nv.size - 1000} bytes the file holds are ggml's NVFP4 quantizer's" in x for x in e["notes"])
    assert rep.tensors[GQ]["exact"] and rep.tensors[GQ]["ok"]
    # a file cut inside its header is no GGUF file to read
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:40])
    r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "checkpoint", str(head)], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 2 and "head.gguf" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # analyze lists the truncated tensor with its reason and analyses the other
    r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(cut), "--quiet", "--schemes", "nvfp4",
                        "--no-hadamard"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 1 and "truncated" in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("kind", ["MXFP4", "NVFP4"])
def test_transposed_gguf_blocks_are_named(tmp_path, kind):
    from fp4sim.checkpoints.gguf import _BLOCK
    from fp4sim.validate.checkpoint import check_checkpoint
    mx, nv, ref, w = _clean(tmp_path)
    rows, name = (mx, GQ) if kind == "MXFP4" else (nv, GF)
    nbytes = _BLOCK[kind][1]
    R = rows.shape[0]
    t = rows.reshape(R, -1, nbytes).transpose(1, 0, 2).reshape(rows.shape)    # block (r, k) written at k * R + r
    rep = check_checkpoint(_write(tmp_path / "t.gguf", {name: (np.ascontiguousarray(t), kind)}), ref)
    assert any("blocks are transposed" in x for x in rep.tensors[name]["faults"]), rep.summary()


def test_analyze_requantize_reports_what_each_rule_cost(tmp_path):
    """``analyze FILE.gguf --requantize REF``: per FP4 tensor the rule that wrote it, its stored values' relative
    error (against gguf-py's own dequantization of the file's bytes), each rule's error on the same weights (the
    rule that wrote the file costs what the file costs), and the clipped blocks (from the file's scale bytes)."""
    import json
    import subprocess
    import sys
    gg = import_or_missing("gguf")
    gq = import_or_missing("gguf.quants")
    mx, nv, ref, w = _clean(tmp_path)
    f = _write(tmp_path / "m.gguf", {GQ: (mx, "MXFP4"), GF: (nv, "NVFP4")})
    js = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(f), "--requantize", str(ref), "--json", str(js),
                        "--quiet", "--schemes", "nvfp4", "--no-hadamard"], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "What each FP4 rule costs on the reference weights" in r.stdout and "median ratio" in r.stdout, r.stdout
    st = json.loads(js.read_text())["requantize"]
    rows = {t["tensor"]: t for t in st["tensors"]}
    assert set(rows) == {GQ, GF} and not st["not_compared"]
    for name, raw, kind, x in ((GQ, mx, "MXFP4", w["query"]), (GF, nv, "NVFP4", w["ffn"])):
        t = rows[name]
        theirs = gq.dequantize(raw, gg.GGMLQuantizationType[kind]).astype(np.float64)
        a = x.astype(np.float64)
        assert t["stored"] == pytest.approx(((theirs - a) ** 2).sum() / (a * a).sum(), rel=1e-12)
        rule = "ggml MXFP4" if kind == "MXFP4" else "ggml NVFP4"
        assert t["file_rule"] == (["ggml's MXFP4 quantizer"] if kind == "MXFP4" else ["ggml's NVFP4 quantizer"])
        assert t["rel_mse"][rule] == pytest.approx(t["stored"], rel=1e-12)
    # the clipped share under the file's scales, from the file's bytes: amax > 6 x 2^(e - 127)
    e = mx.reshape(w["query"].shape[0], -1, 17)[:, :, 0].astype(np.int64)
    amax = np.abs(w["query"]).reshape(e.shape[0], -1, 32).max(-1)
    assert rows[GQ]["clipped_stored"] == pytest.approx(float((amax > 6 * np.ldexp(1.0, e - 127)).mean()))
    assert rows[GQ]["clipped_stored"] == rows[GQ]["clipped_ggml_mxfp4"] > 0.3
    # a reference that holds only one of the tensors: the other is listed as not compared, and the status says so
    part = _write(tmp_path / "part.gguf", {GQ: w["query"]})
    r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(f), "--requantize", str(part), "--quiet",
                        "--schemes", "nvfp4", "--no-hadamard"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 1 and f"not compared {GF}" in r.stdout, r.stdout + r.stderr
    # bad input: no FP4 tensor among the paths, a reference that is not there, one that matches no tensor
    other = _write(tmp_path / "other.gguf", {"x.weight": w["query"]})
    for args, phrase in (([str(ref), "--requantize", str(ref)], "none of the paths holds an FP4 tensor"),
                         ([str(f), "--requantize", str(tmp_path / "nope")], "no such file"),
                         ([str(f), "--requantize", str(other)], "no FP4 tensor could be compared")):
        r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", *args, "--quiet"], capture_output=True,
                           text=True, cwd=ROOT, timeout=600)
        assert r.returncode == 2 and phrase in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_nvfp4_scales_per_32_follow_te_s_rule():
    """rule_costs' NVFP4 at 4.25 bits is TE's rule with one E4M3 scale per 32 elements: with 16 it is fp4sim's
    nvfp4, codes and scale bytes (the TE-checked quantizer)."""
    from fp4sim.gguf import te_nvfp4_blocks
    for x in (_weights()["ffn"], _weights()["query"], _ties()):
        c, s, s_dec = te_nvfp4_blocks(x, 16)
        q = fs.quantize(x, "nvfp4")
        assert np.array_equal(c, unpack_fp4(np.asarray(q.codes).reshape(x.shape[0], -1)))
        assert np.array_equal(s, np.asarray(q.scales).reshape(s.shape))
    c32, s32, _ = te_nvfp4_blocks(_weights()["ffn"], 32)
    assert s32.shape == (1536, 12)


# --------------------------------------------------------------------- what users holding GGUF files hit
def _with_f32_last(tmp_path):
    """A GGUF file written by gguf-py's writer: an MXFP4 tensor, then an F32 tensor (the file's last)."""
    mx, nv, ref, w = _clean(tmp_path)
    f32 = w["ffn"][:256]
    return _write(tmp_path / "m.gguf", {GQ: (mx, "MXFP4"), GF: f32}), ref, f32


@pytest.mark.parametrize("cut", [1000, "whole"])
def test_a_file_cut_inside_a_tensor_that_is_not_fp4_is_a_fault(tmp_path, cut):
    """Cut 1,000 bytes off a GGUF file whose last tensor is F32 (or cut it off whole): gguf-py's own reader refuses
    the file; validate names the F32 tensor as truncated (with or without a reference), exit 1, and still checks
    the FP4 tensor; analyze skips it with the reason (exit 1) and never reads zeros in place of the missing
    bytes."""
    import subprocess
    import sys
    from fp4sim.validate.checkpoint import check_checkpoint
    gg = import_or_missing("gguf")
    f, ref, f32 = _with_f32_last(tmp_path)
    data = f.read_bytes()
    n = 1000 if cut == 1000 else f32.nbytes             # (its size is a multiple of 32: no padding after it)
    short = tmp_path / "cut.gguf"
    short.write_bytes(data[:-n])
    with pytest.raises(Exception):                                   # the oracle: gguf-py refuses the file
        gg.GGUFReader(str(short))
    t = read_gguf(short).tensors[GF]
    assert t.missing == min(n, f32.nbytes) and t.truncation
    with pytest.raises(ValueError, match=f"{GF}: truncated"):
        t.stored()
    for reference in (None, ref):
        rep = check_checkpoint(short, reference)
        assert not rep.ok and any(x.startswith(f"{GF} (F32, not quantized to FP4): truncated") for x in rep.faults), \
            rep.summary()
        assert rep.tensors[GQ]["ok"] and (reference is None or rep.tensors[GQ]["exact"]), rep.summary()
    r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "checkpoint", str(short)], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 1 and "CONSISTENT" not in r.stdout and "truncated" in r.stdout, r.stdout + r.stderr
    from fp4sim.analyze import analyze
    import json
    ds = analyze([str(short)], schemes=["nvfp4"], hadamard=False, quiet=True)
    skipped = {k["tensor"]: k for k in json.loads(ds.attrs["skipped"])}
    assert list(ds.tensor.values) == [GQ] and "truncated" in skipped[GF]["reason"], skipped
    if cut == "whole":
        assert "none of its" in skipped[GF]["reason"]
    r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(short), "--quiet", "--schemes", "nvfp4",
                        "--no-hadamard"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 1 and "truncated" in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("fault", ["truncated", "mislabelled"])
def test_an_fp4_tensor_whose_bytes_are_not_its_own_is_not_compared(tmp_path, fault):
    """A truncated FP4 tensor, or one under the other FP4 type, is not counted as compared with the reference:
    the headline does not count it among the tensors compared, and the checkpoint's 'not compared' fault names
    it."""
    from fp4sim.validate.checkpoint import check_checkpoint
    mx, nv, ref, w = _clean(tmp_path)
    f = _write(tmp_path / "m.gguf", {GQ: (mx, "MXFP4"), GF: (nv, "NVFP4")})
    if fault == "truncated":
        cut = tmp_path / "cut.gguf"
        cut.write_bytes(f.read_bytes()[:-1000])
        f = cut
    else:
        _retype(f, GF, "MXFP4")
    rep = check_checkpoint(f, ref)
    assert not rep.tensors[GF]["compared"] and rep.tensors[GQ]["exact"], rep.summary()
    assert any(x.startswith(f"1 of 2 quantized weights were not compared with the reference (first: {GF}")
               for x in rep.faults), rep.summary()
    assert "1 of 2 equal to the reference" in rep.summary()


def test_a_tensor_missing_from_the_reference_is_named_once(tmp_path):
    from fp4sim.validate.checkpoint import check_checkpoint
    mx, nv, ref, w = _clean(tmp_path)
    f = _write(tmp_path / "m.gguf", {GQ: (mx, "MXFP4"), "blk.1.attn_q.weight": (mx, "MXFP4")})
    rep = check_checkpoint(f, ref)
    notes = rep.tensors["blk.1.attn_q.weight"]["notes"]
    assert notes == ["no reference tensor blk.1.attn_q.weight: not compared"], notes


@pytest.mark.parametrize("kind", ["MXFP4", "NVFP4"])
def test_a_fault_in_some_blocks_is_counted_and_located(tmp_path, kind):
    """One block's code nibbles swapped and another block's scale byte one off: no rule and no whole-tensor fault
    reproduces the bytes; the fault says how many scale blocks differ from the rule's bytes and where the first
    is."""
    from fp4sim.gguf import block_layout
    from fp4sim.validate.checkpoint import check_checkpoint
    mx, nv, ref, w = _clean(tmp_path)
    rows, name = (mx, GQ) if kind == "MXFP4" else (nv, GF)
    n, nbytes, ns, sub = block_layout(kind)
    b = rows.reshape(rows.shape[0], -1, nbytes).copy()
    b[3, 1, ns + 2] = (b[3, 1, ns + 2] >> 4) | (b[3, 1, ns + 2] << 4)     # row 3, GGUF block 1: two codes
    assert b[3, 1, ns + 2] != rows.reshape(b.shape)[3, 1, ns + 2]
    b[7, 0, 0] += 1                                                        # row 7, first scale of block 0
    rep = check_checkpoint(_write(tmp_path / "b.gguf", {name: (b.reshape(rows.shape), kind)}), ref)
    f = " ".join(rep.tensors[name]["faults"])
    rule = "ggml's MXFP4 quantizer" if kind == "MXFP4" else "ggml's NVFP4 quantizer"
    total = rows.shape[0] * w["query" if kind == "MXFP4" else "ffn"].shape[1] // sub
    assert f"2 of {total} scale blocks differ from the bytes of {rule}" in f, f
    # the swapped byte of row 3 holds elements of the sub-block that byte index ns + 2 falls in
    first = 1 * n + (2 // (sub // 2)) * sub
    assert f"first at row 3, elements {first} to {first + sub - 1}" in f, f


def test_reading_scale_byte_255_warns_of_nothing():
    """E8M0 byte 255 is NaN: values() gives NaN for its block without NumPy's overflow warning."""
    import warnings
    from fp4sim.gguf import GGUFTensor, to_gguf_blocks
    x = _weights()["query"][:2, :64]
    c, s = ggml_mxfp4_quantize(x)
    s = s.copy()
    s[1, 1] = 255
    t = GGUFTensor("t", "MXFP4", (2, 64), to_gguf_blocks(c, s, "MXFP4"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = t.values()
    assert np.isnan(v[1, 32:]).all() and np.isfinite(v[0]).all() and np.isfinite(v[1, :32]).all()


def test_nvfp4_scale_bytes_with_the_sign_bit_read_as_ggml_reads_them():
    """ggml's UE4M3 scales are unsigned: a byte with its sign bit set reads as the byte without it, in gguf-py's
    own dequantizer, in values() and in fs.dequantize of quantized() (which had negated the 16 values); the
    stored bytes (scales) keep the bit, for validate to name."""
    from fp4sim.gguf import GGUFTensor, ggml_nvfp4_quantize, to_gguf_blocks
    gq, gg = import_or_missing("gguf.quants"), import_or_missing("gguf")
    x = _weights()["ffn"][:4, :128]
    c, s = ggml_nvfp4_quantize(x)
    s = s.copy()
    s[0, 1] |= 0x80
    s[2, 5] |= 0x80
    rows = to_gguf_blocks(c, s, "NVFP4")
    t = GGUFTensor("t", "NVFP4", (4, 128), rows)
    theirs = gq.dequantize(rows, gg.GGMLQuantizationType.NVFP4).astype(np.float32).reshape(4, 128)
    ours = np.asarray(fs.dequantize(t.quantized()), np.float32)
    code8 = unpack_fp4(c) == 8                                           # -0 in fp4sim, +0 in ggml: equal values
    assert np.array_equal(t.values(), theirs) and np.array_equal(ours, theirs)
    assert np.array_equal(ours[~code8].view(np.uint32), theirs[~code8].view(np.uint32))
    assert t.scales[0, 1] & 0x80 and t.scales[2, 5] & 0x80
