"""MLX's float quantization modes (mx.quantize with mode mxfp4, nvfp4, mxfp8; MLX 0.32 on the CPU) against
fp4sim's rule for each (fp4sim.checkpoints.rules.mlx_quantize), byte for byte: MLX run by the test itself on
real MiniLM weights and on adversarial blocks (E2M1 ties at several scales, zeros of both signs, all-equal
blocks, amaxes on the scale's rounding boundaries, float32-subnormal blocks, values past E4M3's range), in
float32, bfloat16 and float16."""
from __future__ import annotations

import numpy as np
import pytest

import fp4sim as fs
from fp4sim.checkpoints.rules import MLX_MODES, mlx_quantize
from fp4sim.layout import unpack_fp4
from peers import import_or_missing
from test_checkpoint import SAMPLE

DTYPES = ("float32", "bfloat16", "float16")


def _adversarial():
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    base = np.concatenate([mids, -mids, [-0.1, -0.2, 0.2, -1e-3], [4.0, 7.9, -7.5, 6.0, 3.0],
                           [0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 0.0, -0.0, 1.5]]).astype(np.float32)[:32]
    rows = [base * np.float32(2.0 ** e) for e in (-130, -127, -126, -100, -20, -3, 0, 5, 13, 100)]
    rows += [np.zeros(32, np.float32), np.full(32, -0.0, np.float32)]
    rows += [np.full(32, v, np.float32) for v in (1.75, -1.7421875, 6.0, 7.0, 3.5, 1e-6, 448.0, 500.0)]
    rng = np.random.default_rng(0)
    for a in (1.75, 1.7421875, 1.746, 3.5, 3.49, 7.0, 0.875, 14.0, 448, 449, 6.0, 6.01, 2688, 3000):
        r = rng.standard_normal(32).astype(np.float32)
        rows.append(r / np.abs(r).max() * np.float32(a))
    rows.append((rng.standard_normal(32) * 1e-39).astype(np.float32))
    rows += list((rng.standard_normal((32, 32)) * np.exp(rng.uniform(-20, 20, (32, 1)))).astype(np.float32))
    return np.stack(rows).astype(np.float32)


def _mlx(x, mode, dtype):
    mx = import_or_missing("mlx.core")
    w = mx.array(x).astype(getattr(mx, dtype))
    q, s = mx.quantize(w, mode=mode)[:2]
    return np.array(q).view(np.uint8), np.array(s)


@pytest.mark.parametrize("mode", MLX_MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_rule_is_mlxs_byte_for_byte(mode, dtype):
    import ml_dtypes
    z = np.load(SAMPLE)
    dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    for x in (z["minilm.encoder.layer.0.attention.self.query.weight"],
              z["minilm.encoder.layer.5.intermediate.dense.weight"], _adversarial()):
        x = np.asarray(x, np.float32)
        with np.errstate(over="ignore"):
            x = x[np.isfinite(x.astype(dt).astype(np.float32)).all(1)]         # the rows the dtype holds
        mc, ms = _mlx(x, mode, dtype)
        c, s = mlx_quantize(x, mode, dtype)
        assert np.array_equal(s, ms), (mode, dtype, np.argwhere(s != ms)[:3])
        assert np.array_equal(c, mc), (mode, dtype, np.argwhere(c != mc)[:3])


def test_the_oracle_tells_mlx_from_the_ocp_rule():
    """MLX's MXFP4 scales are the OCP round-up (fp4sim's rceil), but its elements are not round-to-nearest-even:
    a tie goes to the smaller magnitude and a negative value that rounds to zero is +0 — so fp4sim's rceil mode
    reproduces MLX's scale bytes and not its codes on the adversarial blocks (those whose scale is in E8M0's
    range: below it MLX's byte wraps around)."""
    x = _adversarial()
    x = x[np.abs(x).max(1) >= 2.0 ** -100]
    mc, ms = _mlx(x, "mxfp4", "float32")
    q = fs.quantize(x, "mxfp4", scale_mode="rceil")
    assert np.array_equal(np.asarray(q.scales).reshape(ms.shape), ms)
    fc = np.asarray(q.codes).reshape(mc.shape)
    differ = unpack_fp4(fc) != unpack_fp4(mc)
    assert differ.any()
    v = fs.formats.E2M1.values
    a, b = unpack_fp4(fc)[differ], unpack_fp4(mc)[differ]
    assert (np.abs(v[b]) <= np.abs(v[a])).all()                     # MLX's never the larger magnitude


def test_the_rule_refuses_what_mlx_refuses():
    for x, mode, dtype, phrase in ((np.ones((2, 30), np.float32), "mxfp4", "float32", "multiple of 32"),
                                   (np.ones((2, 24), np.float32), "nvfp4", "float32", "multiple of 16"),
                                   (np.full((1, 32), np.nan, np.float32), "mxfp4", "float32", "NaN or Inf"),
                                   (np.ones((1, 32), np.float32), "affine", "float32", "MLX's float modes"),
                                   (np.ones((1, 32), np.float32), "mxfp4", "int8", "is not one of")):
        with pytest.raises(ValueError, match=phrase):
            mlx_quantize(x, mode, dtype)
