"""Block-scaled schemes against the block-by-block reference (fp4sim.reference.blocks) and exact properties.

Coverage: scheme x flavour/scale mode x rounding on randn, heavy-tailed, bf16-valued, odd-shaped and
zero/underflow inputs; codes and scale bytes compared exactly. Peer libraries: tests/test_peers.py.
"""
from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import fp4sim as fs
from fp4sim.layout import unpack_fp4
from fp4sim.reference import blocks as ref
from blockcases import cases, heavy

CASES = cases()
FLAVORS = ["te", "paper", "torchao", "modelopt"]


def _codes(q):
    return unpack_fp4(np.asarray(q.codes).reshape(-1, q.codes.shape[-1]))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("tile", [1, 16])
def test_nvfp4_matches_reference(case, flavor, tile):
    x = CASES[case]
    q = fs.quantize(x, "nvfp4", flavor=flavor, block=(tile, 16))
    codes, scales = ref.nvfp4_ref(x, flavor, tile)
    np.testing.assert_array_equal(q.linear_scales(), scales)
    np.testing.assert_array_equal(_codes(q), codes)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("variant", [dict(flavor="te", row_scaled=True), dict(flavor="paper", row_scaled=True),
                                     dict(flavor="torchao", per_tensor_scale=False)])
def test_nvfp4_variants_match_reference(case, variant):
    x = CASES[case] * np.float32(2.0) ** np.arange(-(CASES[case].shape[0] // 2), CASES[case].shape[0]
                                                   - CASES[case].shape[0] // 2, dtype=np.float32)[:, None]
    q = fs.quantize(x, "nvfp4", **variant)
    codes, scales = ref.nvfp4_ref(x, **variant)
    np.testing.assert_array_equal(q.linear_scales(), scales)
    np.testing.assert_array_equal(_codes(q), codes)
    r = np.random.default_rng(5).integers(0, 256, x.shape, dtype=np.uint8)
    q = fs.quantize(x, "nvfp4", rounding="sr", rbits=r, **variant)
    codes, scales = ref.nvfp4_ref(x, rounding="sr", rb=r, **variant)
    np.testing.assert_array_equal(_codes(q), codes)


def test_nvfp4_variants_match_reference_on_a_million_elements():
    x = (np.random.default_rng(8).standard_normal((1024, 1024)) * np.exp(3 * np.random.default_rng(9)
                                                                          .standard_normal((1024, 1)))).astype(np.float32)
    for variant in (dict(row_scaled=True), dict(flavor="torchao", per_tensor_scale=False)):
        q = fs.quantize(x, "nvfp4", **variant)
        codes, scales = ref.nvfp4_ref(x, **variant)
        assert np.array_equal(q.linear_scales(), scales) and np.array_equal(_codes(q), codes), variant


@pytest.mark.parametrize("flavor", FLAVORS)
def test_nvfp4_sr_matches_reference_with_given_and_seeded_bits(flavor):
    x = CASES["heavy"]
    r = np.random.default_rng(3).integers(0, 256, x.shape, dtype=np.uint8)
    q = fs.quantize(x, "nvfp4", flavor=flavor, rounding="sr", rbits=r)
    codes, scales = ref.nvfp4_ref(x, flavor, 1, rounding="sr", rb=r)
    np.testing.assert_array_equal(_codes(q), codes)
    np.testing.assert_array_equal(q.linear_scales(), scales)
    from fp4sim.rng import philox_bytes
    qs = fs.quantize(x, "nvfp4", flavor=flavor, rounding="sr", seed=77, stream=3)
    codes, _ = ref.nvfp4_ref(x, flavor, 1, rounding="sr", rb=philox_bytes(77, x.size, 3).reshape(x.shape))
    np.testing.assert_array_equal(_codes(qs), codes)


def test_sr_seed_uses_the_original_flat_index_for_any_axis():
    from fp4sim.rng import philox_bytes
    x = heavy((3, 32, 5), 4)
    q = fs.quantize(x, "nvfp4", axis=1, rounding="sr", seed=5)
    rb = philox_bytes(5, x.size).reshape(x.shape)
    q2 = fs.quantize(x, "nvfp4", axis=1, rounding="sr", rbits=rb)
    np.testing.assert_array_equal(q.codes, q2.codes)
    x2 = np.moveaxis(x, 1, -1).reshape(-1, 32)
    codes, _ = ref.nvfp4_ref(x2, "te", 1, rounding="sr", rb=np.moveaxis(rb, 1, -1).reshape(-1, 32))
    np.testing.assert_array_equal(_codes(q), codes)


@pytest.mark.parametrize("shape,axis", [((8, 64), -1), ((5, 37), -1), ((3, 33, 1), 1), ((64, 32), 0),
                                        ((16, 16), 0), ((2, 40, 16), 1), ((4, 6, 32), 0), ((48, 20), 0),
                                        ((3, 5, 7), 1), ((4, 6, 8), 1)])
def test_seeded_sr_generated_in_the_kernel_equals_the_byte_array(shape, axis):
    """Seeded SR draws its Philox bytes inside the NVFP4 / MX kernels when the block axis is last (rows) or has
    a stride that is a multiple of 16 (16 rows per Philox call); other strides use the byte array. Every
    layout against quantize with those bytes given as rbits (itself checked against the reference above) and
    against the reference directly for NVFP4."""
    from fp4sim.rng import philox_bytes
    x = heavy(shape, 11)
    for scheme, kw in [("nvfp4", {}), ("nvfp4_2d", {}), ("nvfp4", {"flavor": "modelopt"}), ("mxfp4", {}),
                       ("mxfp8_e4m3", {})]:
        if scheme == "nvfp4_2d" and len(shape) != 2:
            continue
        for nsr in (8, 3):
            a = fs.quantize(x, scheme, axis=axis, rounding="sr", seed=2**40 + 9, stream=5, sr_bits=nsr, **kw)
            rb = (philox_bytes(2**40 + 9, x.size, 5) & np.uint8((1 << nsr) - 1)).reshape(shape)
            b = fs.quantize(x, scheme, axis=axis, rounding="sr", rbits=rb, sr_bits=nsr, **kw)
            np.testing.assert_array_equal(a.codes, b.codes, err_msg=f"{scheme} {kw} nsr={nsr}")
            np.testing.assert_array_equal(a.scales, b.scales)
            fa = fs.fake_quantize(x, scheme, axis=axis, rounding="sr", seed=2**40 + 9, stream=5, sr_bits=nsr, **kw)
            np.testing.assert_array_equal(fa.view(np.uint32), fs.dequantize(b).view(np.uint32))
            x2 = np.moveaxis(x, axis, -1).reshape(-1, shape[axis])
            rb2 = np.moveaxis(rb, axis, -1).reshape(x2.shape)
            if scheme == "nvfp4" and not kw:
                codes, _ = ref.nvfp4_ref(x2, "te", 1, rounding="sr", n=nsr, rb=rb2)
                np.testing.assert_array_equal(_codes(a), codes)
            elif scheme == "mxfp4":
                codes, _ = ref.mx_ref(x2, fs.E2M1, "rceil", rounding="sr", rb=rb2, n=nsr)
                np.testing.assert_array_equal(_codes(a), codes)


@pytest.mark.parametrize("shape,axis", [((100, 48), 0), ((3, 40, 33), 1), ((40, 3, 16), 0), ((64, 4, 8), 0),
                                        ((35, 37), 0)])
def test_quantize_along_another_axis_reads_the_input_in_chunks_of_rows(monkeypatch, shape, axis):
    """An input blocked along another axis than the last is gathered 16 rows at a time here (the chunk size made
    tiny), so 16x16 tiles, 16-row Philox groups and rows that cross the outer axis start and end inside chunks
    (strides 33 and 37 draw the seeded bytes as an array, also read a chunk at a time): every scheme against the
    reference on the moved input, and fake_quantize against dequantize. Also with the input gathered in chunks
    and the (smaller) random bytes copied whole, and with a Fortran-ordered input copied whole and the bytes
    gathered in chunks."""
    from fp4sim.cpu import backend, transpose
    from fp4sim.rng import philox_bytes
    for mod in (backend, transpose):
        monkeypatch.setattr(mod, "chunk_rows", lambda K, itemsize=4: 16)
    x0 = heavy(shape, 21)
    x0[(0,) * len(shape)] = np.nan
    K = shape[axis]
    mv = np.moveaxis(x0, axis, -1).reshape(-1, K)
    given = np.random.default_rng(2).integers(0, 256, shape, dtype=np.uint8)
    seeded = philox_bytes(99, x0.size, 7).reshape(shape)
    refs = {}                                  # the reference's outputs, the same for the three layouts
    for limit, x in ((0, x0), (x0.size, x0), (0, np.asfortranarray(x0))):
        monkeypatch.setattr(transpose, "CHUNK_BYTES", limit)
        if x.flags.c_contiguous:
            assert isinstance(transpose.moved_rows(x, axis), transpose.MovedRows) and mv.shape[0] > 16
            assert isinstance(transpose.moved_rows(given, axis), transpose.MovedRows) == (limit == 0)
        _check_moved(x, axis, mv, given, seeded, refs)


def _check_moved(x, axis, mv, given, seeded, refs):
    shape = x.shape
    for kw, rb in [({}, None), ({"rounding": "sr", "rbits": given}, given),
                   ({"rounding": "sr", "seed": 99, "stream": 7}, seeded)]:
        rb2 = None if rb is None else np.moveaxis(rb, axis, -1).reshape(mv.shape)
        rnd = kw.get("rounding", "rne")
        for scheme, skw, want in [
                ("nvfp4", {}, lambda: ref.nvfp4_ref(mv, "te", 1, rounding=rnd, rb=rb2)),
                ("nvfp4", {"flavor": "torchao"}, lambda: ref.nvfp4_ref(mv, "torchao", 1, rounding=rnd, rb=rb2)),
                ("nvfp4_2d", {}, lambda: ref.nvfp4_ref(mv, "te", 16, rounding=rnd, rb=rb2)),
                ("nvfp4", {"row_scaled": True}, lambda: ref.nvfp4_ref(mv, "te", 1, rounding=rnd, rb=rb2,
                                                                      row_scaled=True)),
                ("mxfp4", {}, lambda: ref.mx_ref(mv, fs.E2M1, "rceil", rounding=rnd, rb=rb2)),
                ("mxfp8_e4m3", {}, lambda: ref.mx_ref(mv, fs.E4M3, "rceil", rounding=rnd, rb=rb2))]:
            if scheme == "nvfp4_2d" and len(shape) != 2:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)     # the NaN element
                q = fs.quantize(x, scheme, axis=axis, **skw, **kw)
                fq = fs.fake_quantize(x, scheme, axis=axis, **skw, **kw)
                dq = fs.dequantize(q)
            key = (scheme, str(skw), rnd, rb is seeded)
            codes, scales = refs[key] if key in refs else refs.setdefault(key, want())
            got = _codes(q) if scheme != "mxfp8_e4m3" else q.codes.reshape(codes.shape)
            np.testing.assert_array_equal(got, codes, err_msg=f"{scheme} {skw} {kw.keys()}")
            np.testing.assert_array_equal(q.linear_scales(), scales)
            np.testing.assert_array_equal(fq.view(np.uint32), dq.view(np.uint32))


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_seeded_sr_allocates_no_per_element_byte_array(scheme):
    """tracemalloc peak of quantize beyond its outputs: with seed= the Philox bytes are made inside the kernel,
    so SR costs no more memory than RNE: none of the n random bytes for the block axis last; along axis 0 the
    input is gathered a chunk of rows at a time (a quarter of this tensor), not copied whole (4 bytes per
    element), and the bytes are not drawn or moved either. Each Numba thread holds its task's scratch (with SR
    along axis 0 a 16-row Philox group, its bytes and words: 32 bytes per row element, 33 KB here), so the test
    runs on two threads and the bound means the same on a machine of any size."""
    from fp4sim.cpu.transpose import chunk_rows
    from fp4sim.threads import numba_threads
    x = np.random.default_rng(0).standard_normal((1024, 2048)).astype(np.float32)
    with numba_threads(2):
        _check_quantize_peak(x, scheme, chunk_rows(1024) * 1024 * 4)


def _check_quantize_peak(x, scheme, chunk):
    import tracemalloc
    assert chunk <= x.nbytes // 4
    for axis, allowed in ((-1, 0), (0, chunk)):
        for kw in ({}, {"rounding": "sr", "seed": 3}):
            fs.quantize(x, scheme, axis=axis, **kw)          # compile outside the measurement
            extra = []
            for _ in range(3):     # the least of three: a first call's one-off Python objects are not the kernel's
                tracemalloc.start()
                try:
                    q = fs.quantize(x, scheme, axis=axis, **kw)
                    peak = tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
                extra.append(peak - q.codes.nbytes - q.scales.nbytes)
                del q
            assert min(extra) - allowed < x.size // 16, (axis, kw, extra)   # one byte per element would be 16x


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("elem,mode", [(e, m) for e in (fs.E2M1, fs.E2M3, fs.E3M2, fs.INT8)
                                       for m in ("rceil", "floor", "ceil", "even")]
                         + [(fs.E4M3, "rceil"), (fs.E4M3, "floor"), (fs.E5M2, "rceil"), (fs.E5M2, "even")])
def test_mx_matches_reference(case, elem, mode):
    x = CASES[case]
    name = fs.schemes.MX_ELEMS[elem]
    q = fs.quantize(x, name, scale_mode=mode)
    codes, scales = ref.mx_ref(x, elem, mode)
    np.testing.assert_array_equal(q.linear_scales(), scales)
    got = _codes(q) if elem is fs.E2M1 else q.codes.reshape(codes.shape)
    np.testing.assert_array_equal(got, codes)


def test_mx_sr_matches_reference():
    x = CASES["heavy"]
    r = np.random.default_rng(6).integers(0, 256, x.shape, dtype=np.uint8)
    for elem, name in ((fs.E2M1, "mxfp4"), (fs.E4M3, "mxfp8_e4m3"), (fs.E2M3, "mxfp6_e2m3"), (fs.E3M2, "mxfp6_e3m2"),
                       (fs.INT8, "mxint8")):
        q = fs.quantize(x, name, rounding="sr", rbits=r)
        codes, _ = ref.mx_ref(x, elem, "rceil", rounding="sr", rb=r)
        got = _codes(q) if elem is fs.E2M1 else q.codes.reshape(codes.shape)
        np.testing.assert_array_equal(got, codes)


def _specials(R, K, seed):
    """heavy() rows with NaNs (several payloads, both signs), infinities, -0 and subnormals inside blocks, one NaN
    in the last partial block and one block of NaNs only."""
    x = heavy((R, K), seed)
    u = x.view(np.uint32)
    u[0, 3] = 0x7FC00000
    u[1, K - 1] = 0xFF800001           # a signalling-payload NaN with the sign set, in the last (partial) block
    u[2, 16:32] = 0x7FA00000           # a block of NaNs only
    x[3, 5] = -0.0
    x[3, 7] = np.float32(1e-41)
    return x


@pytest.mark.parametrize("K", [64, 37, 101])
def test_tensor_amax_pass_keeps_every_block_amax_in_the_code_array(K):
    """The tensor-amax pass of NVFP4 quantize (CpuKernels.absmax_blocks) also leaves each 16-element block's max
    |x| (NaN ignored) in the first 4 bytes of its 8 code bytes, for the quantize kernel to read before writing the
    codes over it: checked against NumPy's max over the zero-padded, NaN-zeroed blocks, with the tensor amax, the
    row amaxes and the NaN flag."""
    from fp4sim.cpu.backend import CPU
    bk, code_bytes = 16, 8
    x = _specials(6, K, 11)
    amax, has_nan, codes, rows = CPU.absmax_blocks(x)
    nbk = -(-K // bk)
    assert codes.shape == (6, nbk * code_bytes) and codes.dtype == np.uint8
    xp = np.zeros((6, nbk * bk), np.float32)
    xp[:, :K] = np.where(np.isnan(x), np.float32(0.0), np.abs(x))
    want = xp.reshape(6, nbk, bk).max(axis=2)
    got = codes.view(np.uint32)[:, :: code_bytes // 4]
    np.testing.assert_array_equal(got, want.view(np.uint32))
    assert amax.view(np.uint32) == want.max().view(np.uint32)
    np.testing.assert_array_equal(rows.view(np.uint32), want.max(axis=1).view(np.uint32))   # row-scaled's amaxes
    assert has_nan
    y = np.ones((2, K), np.float32)
    assert not CPU.absmax_blocks(y)[1]
    y[0, 3] = np.inf                                        # Inf is no NaN
    assert CPU.absmax_blocks(y)[:2] == (np.inf, False)
    y[0, 3] = 1.0
    y[1, K - 1] = np.nan                                    # the only NaN, in the last (for K = 37, 101: partial) block
    assert CPU.absmax_blocks(y)[:2] == (1.0, True)
    y[0, :16] = [np.nan] + [0.5] * 14 + [3.0]               # a NaN block whose largest element is its last
    _, _, c2, r2 = CPU.absmax_blocks(y)
    assert c2.view(np.uint32)[0, 0] == np.float32(3.0).view(np.uint32) and r2[0] == 3.0
    assert CPU.absmax_blocks(np.asfortranarray(x))[2:] == (None, None)   # not row-contiguous


@pytest.mark.parametrize("scheme,kw", [("nvfp4", {}), ("nvfp4", {"flavor": "torchao"}), ("nvfp4_2d", {}),
                                       ("nvfp4", {"row_scaled": True}), ("nvfp4", {"rounding": "sr", "seed": 4})])
def test_block_amax_from_the_tensor_amax_pass_equals_the_kernels_own(monkeypatch, scheme, kw):
    """Quantize with the block amaxes handed over from the tensor-amax pass (the default for a row-contiguous
    input) and with the kernels reducing every block themselves (that pass turned off) give the same code and
    scale bytes, and both equal the reference, on blocks holding NaN, Inf, -0 and subnormals and a last partial
    block."""
    from fp4sim.cpu.backend import CpuKernels
    x = _specials(40, 101, 12)
    x[5, 20] = np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fused = fs.quantize(x, scheme, **kw)
        fake = fs.fake_quantize(x, scheme, **kw)
        monkeypatch.delattr(CpuKernels, "absmax_blocks")
        own = fs.quantize(x, scheme, **kw)
        fake_own = fs.fake_quantize(x, scheme, **kw)
    np.testing.assert_array_equal(fused.codes, own.codes)
    np.testing.assert_array_equal(np.asarray(fused.scales), np.asarray(own.scales))
    np.testing.assert_array_equal(fake.view(np.uint32), fake_own.view(np.uint32))
    if kw.get("rounding") == "sr":
        return
    codes, scales = ref.nvfp4_ref(x, kw.get("flavor", "te"), 16 if scheme == "nvfp4_2d" else 1,
                                  **({"row_scaled": True} if kw.get("row_scaled") else {}))
    np.testing.assert_array_equal(fused.linear_scales(), scales)
    np.testing.assert_array_equal(_codes(fused), codes)


@pytest.mark.parametrize("K", [64, 37, 101])
@pytest.mark.parametrize("fmt,mode", [("e2m1", "rceil"), ("e2m1", "floor"), ("e4m3", "rceil")])
def test_mx_reads_its_input_once_and_reports_the_tensor_amax(fmt, mode, K):
    """MX quantize reduces each 32-element block (as two 16-element halves) and each row's max |x| and NaN flag
    in the one read of its input (CpuKernels.mx): the tensor amax and NaN flag it returns equal NumPy's max over
    the NaN-zeroed |x|, and the codes and scales equal the reference, on rows with NaN payloads (one only in the
    last partial block, one block of NaNs only), Inf, -0 and subnormals; read a chunk of rows at a time (the
    same tensor quantized along axis 0) it gives the same bytes."""
    from fp4sim import ids
    from fp4sim.cpu.backend import CPU
    elem = fs.E2M1 if fmt == "e2m1" else fs.E4M3
    x = _specials(40, K, 12)
    x[5, K // 2] = -np.inf
    nz = np.where(np.isnan(x), np.float32(0.0), np.abs(x))
    z = np.zeros((1, 1), np.uint8)
    codes, scales, _, (amax, has_nan) = CPU.mx(x, z, False, 0, 8, ids.SCALE_MODE_IDS[mode], elem, False)
    assert amax.view(np.uint32) == nz.max().view(np.uint32) and has_nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)       # the reference's Inf * 0 in the Inf row's block
        want_codes, want_scales = ref.mx_ref(x, elem, mode)
    np.testing.assert_array_equal(scales, want_scales)
    got = unpack_fp4(codes)[:, :K] if elem is fs.E2M1 else codes[:, :K]
    np.testing.assert_array_equal(got, want_codes.reshape(40, -1)[:, :K])
    y = heavy((3, K), 2)                                  # no NaN; a NaN only in the last element of the last row
    am, nan = CPU.mx(y, z, False, 0, 8, 0, elem, False)[3]
    assert am == np.abs(y).max() and not nan
    y[2, K - 1] = np.nan
    am2, nan2 = CPU.mx(y, z, False, 0, 8, 0, elem, False)[3]
    assert am2 == np.abs(y[:2]).max().clip(np.abs(y[2, :K - 1]).max()) and nan2
    u = np.full((2, K), 0.5, np.float32)
    u[0, 7] = np.inf                                      # Inf is no NaN
    assert CPU.mx(u, z, False, 0, 8, 0, elem, False)[3] == (np.inf, False)
    u[0, 7], u[1, 0], u[1, 31] = 0.5, np.nan, 3.0         # a NaN block whose largest element is its last
    _, su, _, (au, nu) = CPU.mx(u, z, False, 0, 8, 0, elem, False)
    assert au == 3.0 and nu and su[1, 0] == ref.mx_ref(u, elem, "rceil")[1][1, 0]
    name = "mxfp4" if elem is fs.E2M1 else "mxfp8_e4m3"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        q = fs.quantize(x, name, scale_mode=mode)
        q0 = fs.quantize(np.ascontiguousarray(x.T), name, scale_mode=mode, axis=0)
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(q0.codes).reshape(np.asarray(q.codes).shape))
    np.testing.assert_array_equal(q.linear_scales(), q0.linear_scales().reshape(q.linear_scales().shape))


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_schemes_match_reference(case):
    x = CASES[case]
    for elem, name in ((fs.E4M3, "fp8_e4m3"), (fs.E5M2, "fp8_e5m2"), (fs.E4M3FNUZ, "fp8_e4m3fnuz"),
                       (fs.E5M2FNUZ, "fp8_e5m2fnuz")):
        q = fs.quantize(x, name)
        codes, sinv = ref.fp8_tensor_ref(x, elem)
        np.testing.assert_array_equal(q.codes, codes)
        assert q.scales[0] == sinv
    for tile in (1, 128):
        q = fs.quantize(x, "fp8_blockwise", block=(tile, 128))
        codes, scales = ref.fp8_blockwise_ref(x, tile)
        np.testing.assert_array_equal(q.codes, codes)
        np.testing.assert_array_equal(np.asarray(q.scales).reshape(scales.shape), scales)


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4_2d", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2", "fp8_e4m3",
                                    "fp8_e5m2", "fp8_blockwise", "bf16", "mxfp6_e2m3", "mxfp6_e3m2", "mxint8"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_fake_quantize_equals_dequantize_of_quantize(scheme, axis):
    x = heavy((3, 40, 24), 7)
    for kw in ({}, {"rounding": "sr", "seed": 9}):
        a = fs.fake_quantize(x, scheme, axis=axis, **kw)
        b = fs.dequantize(fs.quantize(x, scheme, axis=axis, **kw))
        assert a.shape == x.shape and a.dtype == np.float32
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("flavor", FLAVORS)
def test_nvfp4_dequantize_follows_the_flavours_formula(flavor):
    x = CASES["heavy"]
    q = fs.quantize(x, "nvfp4", flavor=flavor)
    vals = fs.E2M1.values[_codes(q)][:, : x.shape[1]]
    s = np.repeat(fs.E4M3.values[q.linear_scales()], 16, axis=1)[:, : x.shape[1]]
    g = np.float32(np.abs(x).max())
    f32 = np.float32
    if flavor in ("te", "paper"):   # fl(v * fl(fl(s * amax_g) * fl(1/2688)))
        want = vals * ((s * g) * (f32(1) / f32(2688)))
    else:                           # fl(v * fl(s * fl(amax_g / 2688)))
        want = vals * (s * (g / f32(2688)))
    np.testing.assert_array_equal(fs.dequantize(q), want)


# --------------------------------------------------------------------------------------------- properties
def test_2d_weights_quantize_identically_forward_and_backward():
    w = heavy((48, 80), 11)
    a = fs.dequantize(fs.quantize(w, "nvfp4_2d", axis=1))
    b = fs.dequantize(fs.quantize(w.T.copy(), "nvfp4_2d", axis=1))
    np.testing.assert_array_equal(a, b.T)
    c = fs.dequantize(fs.quantize(w, "nvfp4_2d", axis=0))
    np.testing.assert_array_equal(a, c)
    assert not np.array_equal(a, fs.dequantize(fs.quantize(w, "nvfp4", axis=0)))  # 1x16 is not transposable


@pytest.mark.parametrize("flavor", FLAVORS)
def test_block_amax_element_codes_to_six_when_scale_is_normal(flavor):
    x = heavy((32, 128), 12)
    q = fs.quantize(x, "nvfp4", flavor=flavor)
    codes = _codes(q).reshape(32, 8, 16)
    s = q.linear_scales()
    normal = (s & 0x78) != 0
    xb = np.abs(x.reshape(32, 8, 16))
    amax_pos = xb.argmax(-1)
    amax_code = np.take_along_axis(codes, amax_pos[..., None], -1)[..., 0] & 7
    assert normal.sum() > 100
    if flavor == "torchao":  # its scales are clamped up to 2^-6: such blocks cannot reach +-6
        clamped = s == 0x08
        assert clamped.any() and np.all(amax_code[normal & ~clamped] == 7)
        assert not np.all(amax_code[clamped] == 7)
    else:
        assert np.all(amax_code[normal] == 7)


def test_paper_b4_example_mxfp4_loses_a_binade_nvfp4_keeps_it():
    d = np.float32(3.0) + np.float32(2.0**-20)
    x = np.array([[d] + [0.1] * 31], np.float32)
    m = fs.fake_quantize(x, "mxfp4", scale_mode="rceil")
    assert m[0, 0] == 3.0                       # rceil: scale 1, so 3+d -> 3 and codes 4, 6 go unused
    codes = _codes(fs.quantize(x, "mxfp4"))
    assert codes.max() <= 5
    n = fs.fake_quantize(x[:, :16], "nvfp4")
    assert abs(n[0, 0] - d) < abs(m[0, 0] - d)  # NVFP4's E4M3 scale keeps 3 + delta near 6


def test_rht_is_orthogonal_and_te_signs_match_mask():
    from fp4sim.hadamard import TE_SIGN_MASK, hadamard_matrix, rht_matrix, rht_signs
    s = rht_signs(16, "te")
    assert [i for i in range(16) if s[i] < 0] == [i for i in range(16) if (0xD7E8 >> i) & 1]
    assert list(s) == [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1] and TE_SIGN_MASK == 0xD7E8
    for d in (2, 4, 8, 16, 32, 64, 128):
        H = hadamard_matrix(d)
        np.testing.assert_array_equal(H @ H.T, d * np.eye(d))
        M = rht_matrix(d, signs=7)
        np.testing.assert_allclose(M @ M.T, np.eye(d), atol=1e-15)
    a = heavy((8, 64), 2)
    b = heavy((64, 8), 3).T.copy()
    ya = fs.rht(a, 16, out="fp32")
    yb = fs.rht(b, 16, out="fp32")  # (A M)(M^T B)^T along the shared axis = A B^T
    np.testing.assert_allclose(ya.astype(np.float64) @ yb.T.astype(np.float64),
                               a.astype(np.float64) @ b.T.astype(np.float64), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("d", [2, 4, 8, 16, 32, 128])
@pytest.mark.parametrize("signs", ["te", 3, None])
def test_rht_exact_against_float64_matmul(d, signs):
    if signs == "te" and d != 16:
        pytest.raises(ValueError, fs.rht, np.ones((2, d), np.float32), d, signs)
        return
    import ml_dtypes
    from fp4sim.hadamard import rht_matrix
    x = heavy((6, 256), d)
    M = rht_matrix(d, signs)
    exact = (x.astype(np.float64).reshape(6, -1, d) @ M).reshape(6, 256)  # exact: few binades per chunk
    np.testing.assert_array_equal(fs.rht(x, d, signs, out="fp32"), exact.astype(np.float32))
    # bf16 output is one rounding of the exact value (not float32 first): check with exact fractions
    y = fs.rht(x, d, signs)
    assert np.array_equal(y, y.astype(ml_dtypes.bfloat16).astype(np.float32))
    lo = exact.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    err = np.abs(y.astype(np.float64) - exact)
    assert np.all(err <= np.abs(lo - exact) + 1e-300)  # never worse than the double-rounded value


def test_rht_bf16_rounds_once_at_a_double_rounding_trap():
    # (2*mid + 2^-29) / 2 lies just above the bf16 midpoint mid = 1 + 2^-8, but rounds to mid in float32:
    # rounding float32 first would then tie to even (1.0); rounding once goes up.
    mid = 1.0 + 2.0**-8
    x4 = np.zeros((1, 4), np.float32)
    x4[0, 0] = np.float32(2 * mid)
    x4[0, 1] = np.float32(2.0**-29)  # d=4: c = 1/2 exactly, and all four inputs add to the first output
    y4 = fs.rht(x4, 4, None)
    assert y4[0, 0] == np.float32(1.0 + 2.0**-7)              # once-rounded: above the tie -> up
    assert fs.rht(x4, 4, None, out="fp32")[0, 0] == np.float32(mid)  # float32 alone lands on the tie


def _rht_index_order_oracle(x, d, signs, out):
    """fp4sim.rht's definition in NumPy: the float64 sum in index order i = 0..d-1, times float64(1/sqrt(d)),
    rounded once to float32 (NumPy's cast) or to bfloat16 (scaled, np.rint, scaled back), as bit patterns."""
    from fp4sim.hadamard import hadamard_matrix, rht_signs
    sh = rht_signs(d, signs)[:, None] * hadamard_matrix(d)
    X = x.astype(np.float64).reshape(x.shape[0], -1, d)
    acc = np.zeros(X.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(d):
            acc = acc + X[:, :, i:i + 1] * sh[i][None, None, :]
        v = (acc * np.sqrt(1.0 / d)).reshape(x.shape)
        if out == "fp32":
            return v.astype(np.float32).view(np.uint32)
        fin = np.isfinite(v)
        e = np.frexp(np.where(fin, v, 0.0))[1]
        q = np.maximum(e - 8, -133)                       # bf16 keeps 8 significant bits, quantum >= 2^-133
        r = np.ldexp(np.rint(np.ldexp(np.where(fin, v, 0.0), -q)), q)
        r = np.where(np.abs(r) > float(fs.BF16.max), np.copysign(np.inf, v), r)
        r = np.where(fin, r, v)
        bits = (r.astype(np.float32).view(np.uint32) >> 16) << 16
    return np.where(np.isnan(v), np.uint32(0x7FFF0000), bits).astype(np.uint32)


def _rht_edge_rows(d, seed, s):
    """Chunks around the kernel's fast paths: the butterfly (taken when a chunk's nonzero inputs are finite and
    span at most 29 - log2(d) binades, where the float64 sum is exact in any order) and the bf16 rounding on
    the float64 bits (float32's normal range). ``s``: the sign vector, so that output 0 can add d terms of one
    sign."""
    rng = np.random.default_rng(seed)
    scale = np.sqrt(1.0 / d)
    rows = []

    def chunk(exps, neg=None):
        m = 1.0 + rng.integers(0, 2**23, len(exps)) / 2**23
        c = np.ldexp(m, np.asarray(exps)).astype(np.float32)
        return np.where(rng.random(len(exps)) < 0.5 if neg is None else neg, -c, c)

    for spread in (0, 5, 21, 22, 23, 24, 26, 28, 30, 40, 60, 100):
        for _ in range(6):                       # random signs and exponents across the spread
            top = int(rng.integers(-20, 60))
            ex = rng.integers(top - spread, top + 1, d)
            ex[rng.integers(d)] = top
            ex[rng.integers(d)] = top - spread
            rows.append(chunk(ex))
    for spread in range(20, 33):                 # most terms in the top 4 binades, 1-3 tiny ones: beyond the
        for _ in range(40):                      # bound (25 binades at d=16, 22 at d=128) the index-order sum
            ex = rng.integers(17, 21, d)         # rounds, and differs from the butterfly's from 27 / 25
            ex[rng.integers(0, d, rng.integers(1, 4))] = 20 - spread
            rows.append(chunk(ex))
    lim = 29 - int(np.log2(d))
    k = d // 2 - 1
    for spread in range(lim - 2, lim + 9):       # output 0 = t + sum(B) - sum(B): large partial sums that cancel,
        for _ in range(40):                      # leaving the tiny t; from lim + 4 on, the rounding of the
            B = chunk(np.full(k, 20), neg=np.zeros(k, bool))       # partial sums differs between the
            t = chunk([20 - spread], neg=[False])                   # index-order loop and the butterfly
            u = np.concatenate([B, t, -B[rng.permutation(k)], [0.0]])
            rows.append(np.where(s < 0, -u, u))
    for target in ((2 - 2.0**-9) * 2.0**127, (2 - 2.0**-7) * 2.0**127, 2.0**127, 2.0**-126, 2.0**-126 * (1 - 2.0**-9)):
        v = np.float32(target / (d * scale))     # output 0 = d * v * scale: bf16 overflow by rounding, the
        if np.isfinite(v):                       # largest bf16, the smallest normal, and just below it
            rows.append(np.where(s < 0, -v, v).astype(np.float32))
    for k in (1, 3, 5, 127, 255):                # single inputs: every output is +-x0 * scale, on bf16 ties
        r = np.zeros(d, np.float32)              # (exact where scale is a power of two) with odd and even
        r[0] = np.float32((1 + k * 2.0**-8) / scale)        # lower neighbours
        rows += [r, -r, r * np.float32(2.0**-100)]
    big = chunk(np.full(d, 126))                                      # sums near float32 / bfloat16 overflow
    rows += [big, np.abs(big), chunk(np.full(d, 127)), -np.abs(chunk(np.full(d, 127)))]
    rows += [chunk(np.full(d, -126)), chunk(np.full(d, -127)), chunk(rng.integers(-130, -120, d))]
    sub = (rng.integers(1, 2**23, d) * 2.0**-149).astype(np.float32)   # float32 subnormal inputs
    rows += [sub, -sub, np.where(np.arange(d) % 2 == 0, sub, chunk(np.full(d, -110)))]
    rows += [np.zeros(d, np.float32), np.full(d, -0.0, np.float32)]
    cancel = chunk(np.full(d // 2, 3))
    rows.append(np.concatenate([cancel, cancel]))                     # outputs that cancel to exactly zero
    for special in (np.inf, -np.inf, np.nan):
        r = chunk(rng.integers(-5, 5, d))
        r[rng.integers(d)] = special
        rows.append(r)
    r = chunk(rng.integers(-5, 5, d))
    r[0], r[-1] = np.inf, -np.inf
    rows.append(r)
    return np.concatenate([np.asarray(r, np.float32) for r in rows]).reshape(-1, d)


@pytest.mark.parametrize("d", [2, 4, 8, 16, 32, 64, 128])
def test_rht_fast_paths_equal_the_index_order_sum(d):
    from fp4sim.hadamard import rht_signs
    for signs in (["te"] if d == 16 else []) + [d + 1, None]:
        x = _rht_edge_rows(d, d, rht_signs(d, signs))
        for out in ("bf16", "fp32"):
            got = fs.rht(x, d, signs, out=out).view(np.uint32)
            want = _rht_index_order_oracle(x, d, signs, out)
            bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
            assert bad.size == 0, (signs, out, bad[:5], got.reshape(-1)[bad[:5]], want.reshape(-1)[bad[:5]])
            # along a strided axis (the kernel that works on columns without transposing): chunks as columns
            n = x.shape[0] // 2 * 2
            x3 = np.ascontiguousarray(x[:n].reshape(2, n // 2, d).transpose(0, 2, 1))      # (2, d, n/2)
            got3 = fs.rht(x3, d, signs, axis=1, out=out).view(np.uint32)
            assert np.array_equal(got3, want[:n].reshape(2, n // 2, d).transpose(0, 2, 1)), (signs, out)
            # ... and written with the transformed axis last in memory (the same values in x3's shape)
            got3m = fs.rht(x3, d, signs, axis=1, out=out, memory="axis_last")
            assert np.moveaxis(got3m, 1, -1).flags.c_contiguous
            assert np.array_equal(got3m.view(np.uint32), want[:n].reshape(2, n // 2, d).transpose(0, 2, 1))


def test_rht_axis_last_memory_quantizes_to_the_same_bits():
    """What the Wgrad operands do: the RHT along axis 0 written with that axis last, then quantized along it
    (no moved copy) gives the codes and scales of the C-ordered result, SR bits included (the Philox index
    is the element's index in the tensor's shape, not in memory)."""
    x = heavy((96, 80), 3).T.copy()                                   # (80, 96): K = 80 along axis 0
    y = fs.rht(x, 16, 7, axis=0)
    ym = fs.rht(x, 16, 7, axis=0, memory="axis_last")
    assert ym.flags.f_contiguous and np.array_equal(y.view(np.uint32), ym.view(np.uint32))
    for scheme in ("nvfp4", "nvfp4_2d", "mxfp4"):
        for kw in ({}, {"rounding": "sr", "seed": 11, "stream": 2}):
            a, b = fs.quantize(y, scheme, axis=0, **kw), fs.quantize(ym, scheme, axis=0, **kw)
            assert np.array_equal(a.codes, b.codes) and np.array_equal(a.scales, b.scales), (scheme, kw)
    assert fs.rht(x, 16, 7, axis=1, memory="axis_last").flags.c_contiguous     # the axis is already last
    with pytest.raises(ValueError, match="memory"):
        fs.rht(x, 16, 7, axis=0, memory="F")


def test_pack_unpack_and_swizzle_roundtrip():
    from fp4sim.layout import pack_fp4, swizzle_scales, unswizzle_scales
    c = np.random.default_rng(0).integers(0, 16, (5, 34), dtype=np.uint8)
    p = pack_fp4(c)
    assert p[0, 0] == (c[0, 0] | (c[0, 1] << 4))
    np.testing.assert_array_equal(unpack_fp4(p), c)
    s = np.random.default_rng(1).integers(0, 256, (130, 7), dtype=np.uint8)
    sw = swizzle_scales(s)
    assert sw.size == 256 * 8
    r, col = 129, 5
    assert sw[((r // 128) * 2 + col // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + col % 4] == s[r, col]
    np.testing.assert_array_equal(unswizzle_scales(sw, 130, 7), s)


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4_2d", "mxfp4"])
def test_swizzled_quantize_dequantizes_the_same(scheme):
    x = heavy((40, 96), 5)
    a = fs.quantize(x, scheme)
    b = fs.quantize(x, scheme, scale_layout="swizzled")
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.linear_scales(), b.linear_scales())
    np.testing.assert_array_equal(fs.dequantize(a), fs.dequantize(b))


# --------------------------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("flavor", FLAVORS)
def test_all_zero_tensor(flavor):
    x = np.zeros((2, 32), np.float32)
    x[1, 3] = -0.0
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        q = fs.quantize(x, "nvfp4", flavor=flavor)
    codes, scales = ref.nvfp4_ref(x, flavor)
    np.testing.assert_array_equal(q.linear_scales(), scales)
    np.testing.assert_array_equal(_codes(q), codes)
    want_scale, want_code = {"te": (0, 0), "paper": (0, 0), "torchao": (0xFF, 0xC), "modelopt": (0xFF, 0x7)}[flavor]
    assert np.all(q.linear_scales() == want_scale)
    assert _codes(q)[0, 0] == want_code
    assert (len(w) > 0) == (flavor in ("torchao", "modelopt"))
    if flavor in ("te", "paper"):
        assert _codes(q)[1, 3] == 8  # -0 keeps its sign


def test_global_amax_edge_values():
    x = heavy((4, 64), 8)
    for g in (3e38, 1e-40, float(np.abs(x).max()) * 4):
        for flavor in FLAVORS:
            q = fs.quantize(x, "nvfp4", flavor=flavor, global_amax=g)
            codes, scales = ref.nvfp4_ref(x, flavor, global_amax=g)
            np.testing.assert_array_equal(q.linear_scales(), scales)
            np.testing.assert_array_equal(_codes(q), codes)


def test_nan_and_inf_inside_blocks():
    x = heavy((2, 32), 9)
    x[0, 3] = np.nan
    x[1, 20] = -np.inf
    with pytest.warns(RuntimeWarning, match="not finite"):
        q = fs.quantize(x, "nvfp4")
    c = _codes(q)
    assert c[0, 3] == 7 and c[1, 20] == 15                   # NaN -> +6; -Inf saturates to -6
    codes, scales = ref.nvfp4_ref(x, "te")
    np.testing.assert_array_equal(c, codes)
    np.testing.assert_array_equal(q.linear_scales(), scales)
    with pytest.warns(RuntimeWarning, match="Inf inside an MX block"):
        m = fs.quantize(x, "mxfp4", scale_mode="floor")
    assert m.linear_scales()[1, 0] == 0xFD                   # Inf's exponent field: 2^126
    with pytest.warns(RuntimeWarning):
        assert fs.quantize(x, "mxfp4").linear_scales()[1, 0] == 0xFE


def test_exact_ties_at_amax_six():
    x = np.array([[6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25] + [0.0] * 8], np.float32)
    q = fs.quantize(x, "nvfp4", global_amax=6.0 * 448 / 448)
    codes, _ = ref.nvfp4_ref(x, "te", global_amax=6.0)
    np.testing.assert_array_equal(_codes(q), codes)


def test_shapes_padding_and_errors():
    x = heavy((3, 5, 17), 10)
    q = fs.quantize(x, "nvfp4", axis=1)
    assert q.codes.shape == (3, 17, 8) and q.scales.shape == (3, 17, 1)
    assert fs.dequantize(q).shape == x.shape
    q1 = fs.quantize(np.array([2.5], np.float32), "mxfp4")
    assert fs.dequantize(q1).shape == (1,)
    with pytest.raises(ValueError, match="length 0"):
        fs.quantize(np.zeros((3, 0), np.float32), "nvfp4")
    with pytest.raises(ValueError, match="no elements"):
        fs.quantize(np.zeros((0, 16), np.float32), "nvfp4")
    with pytest.raises(ValueError, match="0-d"):
        fs.quantize(np.float32(1.0), "nvfp4")
    with pytest.raises(ValueError, match="axis=2"):
        fs.quantize(np.ones((2, 16), np.float32), "nvfp4", axis=2)
    with pytest.raises(ValueError, match="scheme="):
        fs.quantize(np.ones((2, 16), np.float32), "nvfp5")
    with pytest.raises(ValueError, match="flavor="):
        fs.quantize(np.ones((2, 16), np.float32), "nvfp4", flavor="cublas")
    with pytest.raises(ValueError, match="scale_mode"):
        fs.quantize(np.ones((2, 16), np.float32), "mxfp4", scale_mode="round")
    with pytest.raises(ValueError, match="block="):
        fs.quantize(np.ones((2, 16), np.float32), "nvfp4", block=(8, 16))
    with pytest.raises(ValueError, match="does not apply"):
        fs.quantize(np.ones((2, 16), np.float32), "mxfp4", flavor="te")
    with pytest.raises(ValueError, match="global_amax"):
        fs.quantize(np.ones((2, 16), np.float32), "nvfp4", global_amax=-1.0)
    with pytest.raises(ValueError, match="global_amax applies"):
        fs.quantize(np.ones((2, 16), np.float32), "mxfp4", global_amax=1.0)
    with pytest.raises(ValueError, match="scale_layout"):
        fs.quantize(np.ones((2, 16), np.float32), "nvfp4", scale_layout="tiled")
    with pytest.raises(TypeError, match="QuantizedTensor"):
        fs.dequantize(np.ones(3))
    with pytest.raises(ValueError, match="multiple of d"):
        fs.rht(np.ones((2, 20), np.float32), 16)
    with pytest.raises(ValueError, match="power of two"):
        fs.rht(np.ones((2, 24), np.float32), 12)
    with pytest.raises(TypeError, match="axis must be an int"):
        fs.rht(np.ones((2, 16), np.float32), 16, axis=1.5)
    with pytest.raises(ValueError, match="0-d"):
        fs.rht(np.float32(1.0), 2)


def test_scale_rounding_helper_equals_e4m3_encode_on_every_nonnegative_pattern_class():
    """The block-scale E4M3 rounding (add-and-subtract trick) against the element encoder, on 1M
    non-negative float32 patterns (every exponent, subnormals, +Inf, NaN)."""
    import numba as nb
    from conftest import float32_sweep
    from fp4sim.cpu.blocks import e4m3_rne_array

    @nb.njit
    def run(v, out):
        e4m3_rne_array(v.copy(), np.empty(v.size, np.uint32), out)

    v = np.abs(float32_sweep())
    out = np.empty(v.size, np.uint8)
    run(v, out)
    want = fs.encode(v, fs.E4M3)
    want[np.isnan(v)] = 0xFF
    np.testing.assert_array_equal(out, want)


def test_seeded_sr_with_fewer_random_bits_uses_the_low_bits_of_each_byte():
    from fp4sim.rng import philox_bytes
    x = heavy((8, 64), 13)
    for n in (3, 8):
        a = fs.quantize(x, "nvfp4", rounding="sr", seed=21, sr_bits=n)
        rb = (philox_bytes(21, x.size) & np.uint8((1 << n) - 1)).reshape(x.shape)
        codes, _ = ref.nvfp4_ref(x, "te", 1, rounding="sr", rb=rb, n=n)
        np.testing.assert_array_equal(_codes(a), codes)


@pytest.mark.parametrize("case", ["randn", "heavy", "bf16", "zero_and_tiny_blocks"])
@pytest.mark.parametrize("tile", [1, 16])
@pytest.mark.parametrize("mode,fast,emax", [("mae", False, 448), ("mse", False, 256), ("mse", True, 448)])
def test_four_over_six_matches_reference(case, tile, mode, fast, emax):
    x = CASES[case]
    q = fs.quantize(x, "nvfp4", block=(tile, 16), four_over_six=mode, four_over_six_fast_math=fast,
                    four_over_six_e4m3_max=emax)
    codes, scales, pick = ref.nvfp4_4over6_ref(x, tile, None, mode, fast, emax)
    np.testing.assert_array_equal(q.linear_scales(), scales)
    np.testing.assert_array_equal(_codes(q), codes)
    np.testing.assert_array_equal(q.extras["map_to_4"], pick)
    q = fs.quantize(x, "nvfp4", block=(tile, 16), four_over_six=mode, four_over_six_fast_math=fast,
                    four_over_six_e4m3_max=emax, four_over_six_ties="map_to_4")
    codes, scales, pick = ref.nvfp4_4over6_ref(x, tile, None, mode, fast, emax, ties_map4=True)
    np.testing.assert_array_equal(q.linear_scales(), scales)
    np.testing.assert_array_equal(q.extras["map_to_4"], pick)


@pytest.mark.parametrize("case", ["randn", "heavy", "bf16", "zero_and_tiny_blocks"])
@pytest.mark.parametrize("mode,fast,emax", [("mae", False, 448), ("mse", False, 256), ("mae", True, 256)])
def test_row_scaled_four_over_six_matches_reference(case, mode, fast, emax):
    x = CASES[case]
    rows = x * np.float32(2.0) ** np.arange(-(x.shape[0] // 2), x.shape[0] - x.shape[0] // 2,
                                            dtype=np.float32)[:, None]   # rows over many binades
    q = fs.quantize(rows, "nvfp4", row_scaled=True, four_over_six=mode, four_over_six_fast_math=fast,
                    four_over_six_e4m3_max=emax)
    codes, scales, pick = ref.nvfp4_4over6_ref(rows, 1, None, mode, fast, emax, row_scaled=True)
    np.testing.assert_array_equal(q.scales, scales)
    np.testing.assert_array_equal(_codes(q), codes)
    np.testing.assert_array_equal(q.extras["map_to_4"], pick)
    want = np.abs(np.nan_to_num(rows)).max(1).astype(np.float32)
    assert q.global_amax.dtype == np.float32 and np.array_equal(q.global_amax, want)
    for r in (0, rows.shape[0] // 2, rows.shape[0] - 1):  # each row = that row alone as its own 4over6 tensor
        one = fs.quantize(rows[r:r + 1], "nvfp4", four_over_six=mode, four_over_six_fast_math=fast,
                          four_over_six_e4m3_max=emax, global_amax=want[r])
        assert np.array_equal(one.codes[0], q.codes[r]) and np.array_equal(one.scales[0], q.scales[r])
        y1 = fs.dequantize(one)[0]
        assert np.array_equal(y1.view(np.uint32), fs.dequantize(q)[r].view(np.uint32))


def test_row_scaled_four_over_six_takes_given_row_amaxes_and_refuses_2d():
    x = CASES["heavy"]
    g = (np.abs(x).max(1) * np.float32(4.0)).astype(np.float32)
    q = fs.quantize(x, "nvfp4", row_scaled=True, four_over_six="mse", global_amax=g)
    codes, scales, _ = ref.nvfp4_4over6_ref(x, 1, g, "mse", row_scaled=True)
    np.testing.assert_array_equal(_codes(q), codes)
    np.testing.assert_array_equal(q.scales, scales)
    with pytest.raises(ValueError, match="1x16"):
        fs.quantize(x, "nvfp4_2d", row_scaled=True, four_over_six="mae")


@pytest.mark.parametrize("shape,axis", [((300, 257), 0), ((3, 70, 50), 1), ((5, 64, 33, 7), 1), ((9, 40, 33), 0),
                                        ((16, 16), 0)])
def test_tiled_axis_move_copies_exactly(shape, axis):
    from fp4sim.cpu.transpose import axis_last
    rng = np.random.default_rng(1)
    for a in (heavy(shape, 2), rng.integers(0, 256, shape).astype(np.uint8)):
        want = np.ascontiguousarray(np.moveaxis(a, axis, -1))
        got = axis_last(a, axis)
        assert got.flags.c_contiguous and got.shape == want.shape and got.dtype == want.dtype
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    if len(shape) == 2:                            # a transposed view moved back is contiguous: no copy
        v = heavy(shape[::-1], 3).T
        assert np.shares_memory(axis_last(v, 0), v)


def test_one_amax_te_constants_equal_the_vector_rule():
    """nvfp4_constants_rows takes a scalar path for one te / paper amax (Python float arithmetic rounded once
    to float32); the vector path (float32 NumPy operations) is the rule. Every binade, random mantissas, the
    encode-scale clamp at FLT_MAX, zeros, inf and NaN payloads: the same bits."""
    from fp4sim.planning import nvfp4_constants_rows
    rng = np.random.default_rng(4)
    bits = (np.arange(256, dtype=np.uint32)[:, None] << 23) | rng.integers(0, 1 << 23, (256, 40), dtype=np.uint32)
    specials = np.array([0, 1, 2, 0x00800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF,
                         0x80000000, 0x3F800000, 0x4528_0000, 0x0001_2345], np.uint32)
    amax = np.concatenate([bits.reshape(-1), specials]).view(np.float32)
    for flavor in ("te", "paper"):
        for e4m3_max in (448, 256):
            with np.errstate(all="ignore"):
                vec = nvfp4_constants_rows(flavor, np.stack([amax, amax], 1).reshape(-1), True, e4m3_max)
            for i in range(0, amax.size, 7):
                one = nvfp4_constants_rows(flavor, amax[i], True, e4m3_max)
                for got, want in zip(one, vec):
                    w = want[2 * i: 2 * i + 1]
                    assert got.shape == w.shape and np.array_equal(got.view(np.uint32), w.view(np.uint32)), \
                        (flavor, e4m3_max, hex(amax[i:i + 1].view(np.uint32)[0]), got, w)


# ------------------------------------------------------------------------------ crafted boundaries of the kernels
def _sr_threshold_lattice(block, sign):
    """Blocks of ``block`` elements: element 0 is +-6 (so the block scale is exactly 1), the rest are E2M1's normal
    range |x| in [1, 6) on the 8-bit SR lattice, lo + h * k / 256, each with a random byte r at the threshold
    (floor(delta * 256) + r == 256: must round up) or one below it (255: must stay at lo). Returns x, the bytes,
    and the expected E2M1 codes worked out here from the rule."""
    mags = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    vals, rb, want = [], [], []
    for i in range(2, 7):                                  # lo = 1, 1.5, 2, 3, 4 (normal binades of E2M1)
        lo, h = mags[i], mags[i + 1] - mags[i]
        for k in range(1, 256):
            for up in (True, False):
                vals.append(lo + h * k / 256)              # exact in float32: h * k / 256 has at most 9 bits
                rb.append(256 - k if up else 255 - k)
                want.append(i + 1 if up else i)
    per = block - 1
    nblk = -(-len(vals) // per)
    pad = nblk * per - len(vals)
    vals += [0.0] * pad
    rb += [0] * pad
    want += [0] * pad
    x = np.empty((nblk, block), np.float32)
    x[:, 0] = 6.0
    x[:, 1:] = np.array(vals, np.float32).reshape(nblk, per)
    r = np.zeros((nblk, block), np.uint8)
    r[:, 1:] = np.array(rb, np.uint8).reshape(nblk, per)
    codes = np.full((nblk, block), 7, np.uint8)
    codes[:, 1:] = np.array(want, np.uint8).reshape(nblk, per)
    if sign < 0:
        x, codes = -x, codes | np.uint8(8)
    return x, r, codes


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_sr_rounds_up_exactly_at_the_threshold_in_the_normal_range(scheme, sign):
    """SR's rule is inclusive: up iff floor(delta * 2^n) + r >= 2^n. On lattice inputs in E2M1's normal range
    (|x| >= 1 after scaling, where the kernels add r to the float's bits below the quantum and truncate) with r at
    the threshold the element must round up, and with r one below it stay: codes worked out by hand, and the
    reference agrees. An exclusive threshold (> 2^n) keeps every threshold element at lo."""
    block = 16 if scheme == "nvfp4" else 32
    x, r, want = _sr_threshold_lattice(block, sign)
    kw = {"global_amax": 2688.0} if scheme == "nvfp4" else {}    # S_enc = 1: the block scale 1 is the factor
    q = fs.quantize(x, scheme, rounding="sr", rbits=r, **kw)
    assert np.all(q.linear_scales() == (0x38 if scheme == "nvfp4" else 127))   # E4M3 1.0 / UE8M0 2^0
    got = _codes(q)
    bad = np.argwhere(got != want)
    assert bad.size == 0, (f"{len(bad)} of {want.size} codes differ, first at {tuple(bad[0])}: x="
                           f"{x[tuple(bad[0])]!r} r={r[tuple(bad[0])]} -> {got[tuple(bad[0])]} (want "
                           f"{want[tuple(bad[0])]})")
    if scheme == "nvfp4":
        codes, _ = ref.nvfp4_ref(x, "te", 1, global_amax=2688.0, rounding="sr", rb=r)
    else:
        codes, _ = ref.mx_ref(x, fs.E2M1, "rceil", rounding="sr", rb=r)
    np.testing.assert_array_equal(codes, want)
    fq = fs.fake_quantize(x, scheme, rounding="sr", rbits=r, **kw)
    np.testing.assert_array_equal(fq, fs.E2M1.values[want])


def _te_paper_boundary_amaxes(g):
    """Block amaxes b < g at which TE's order, E4M3(b * fl(S_enc * fl(1/6))), and the paper's order,
    E4M3(fl(b / 6) * S_enc), give different bytes for the tensor amax g (S_enc = fl(2688 / g)): float32
    neighbours of each E4M3 midpoint divided by the te constant, kept where ml_dtypes' E4M3 cast of the two
    float32 products differs."""
    f = np.float32
    s_enc = f(2688.0) / f(g)
    te_c = f(s_enc * (f(1) / f(6)))
    vals = np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    found = []
    for m in (vals[1:] + vals[:-1]) / 2:
        b0 = np.array([m / float(te_c)], np.float32).view(np.int32)[0]
        cand = (b0 + np.arange(-8, 9)).astype(np.int32).view(np.float32)
        te, pa = _te_byte(cand, g), _paper_byte(cand, g)
        found += [c for c, t, p in zip(cand, te, pa) if t != p and c < g]
    return np.array(found, np.float32)


def _te_byte(b, g):
    f = np.float32
    c = f(f(f(2688.0) / f(g)) * (f(1) / f(6)))
    return (np.asarray(b, f) * c).astype(f).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _paper_byte(b, g):
    f = np.float32
    return ((np.asarray(b, f) / f(6)).astype(f) * f(f(2688.0) / f(g))).astype(f).astype(
        ml_dtypes.float8_e4m3fn).view(np.uint8)


def _te_paper_tensor(g, R=64, K=64, seed=0):
    """(R, K) with tensor amax g at [0, 0] and, in every 16x16 tile, one boundary amax b (from
    _te_paper_boundary_amaxes) in each of its 16 rows' blocks, the rest of the tile below b: every 1x16 block and
    every 16x16 tile but the one holding g has an amax where te and paper part ways."""
    bs = _te_paper_boundary_amaxes(g)
    rng = np.random.default_rng(seed)
    x = np.empty((R, K), np.float32)
    nt = (R // 16) * (K // 16)
    pick = bs[np.linspace(len(bs) // 3, len(bs) - 1, nt).astype(int)]     # scales spread over the normal range
    for t in range(nt):
        ti, tj = divmod(t, K // 16)
        b = pick[t]
        tile = (b * rng.uniform(-0.95, 0.95, (16, 16))).astype(np.float32)
        tile[np.arange(16), rng.integers(0, 16, 16)] = b * np.where(rng.random(16) < 0.5, -1, 1)
        x[ti * 16:(ti + 1) * 16, tj * 16:(tj + 1) * 16] = tile
    x[0, 0] = g
    return x


@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_te_and_paper_block_scales_part_ways_through_every_nvfp4_kernel_path(monkeypatch, rounding):
    """Every 1x16 block and 16x16 tile holds an amax where TE's order, b * fl(S_enc * fl(1/6)), and the paper's,
    fl(b / 6) * S_enc, give different E4M3 bytes (checked here with ml_dtypes' cast of the float32 products).
    Each NVFP4 kernel path must give TE's bytes under flavor='te' and the paper's under flavor='paper':
    1x16 and 16x16 with the block axis last, along axis 0 (the transposed input, read in chunks of moved rows,
    the chunk made tiny), quantize and fake_quantize, RNE and SR; and the codes as the reference's."""
    from fp4sim.cpu import backend, transpose
    g = np.float32(95.09591)
    x = _te_paper_tensor(g)
    xt = np.ascontiguousarray(x.T)
    r = np.random.default_rng(4).integers(0, 256, x.shape, dtype=np.uint8)
    kw = {"rounding": "sr", "rbits": r} if rounding == "sr" else {}
    kwt = {"rounding": "sr", "rbits": np.ascontiguousarray(r.T)} if rounding == "sr" else {}
    a16 = np.abs(x).reshape(64, 4, 16).max(-1)                               # 1x16 block amaxes
    a256 = a16.reshape(4, 16, 4).max(1)                                      # 16x16 tile amaxes
    for tile, amax in ((1, a16), (16, a256)):
        te, pa = _te_byte(amax, g), _paper_byte(amax, g)
        differ = te != pa
        assert differ.sum() >= differ.size - 1, "the crafted tensor lost its boundary amaxes"
        for flavor, want in (("te", te), ("paper", pa)):
            codes, scales = ref.nvfp4_ref(x, flavor, tile, rounding=rounding, rb=r if rounding == "sr" else None)
            np.testing.assert_array_equal(scales, want)                      # the reference, against the formula
            scheme = "nvfp4" if tile == 1 else "nvfp4_2d"
            for name, inp, axis, k in (("axis -1", x, -1, kw), ("axis 0", xt, 0, kwt)):
                for chunked in (False, True):
                    if chunked:
                        for mod in (backend, transpose):
                            monkeypatch.setattr(mod, "chunk_rows", lambda K, itemsize=4: 16)
                        monkeypatch.setattr(transpose, "CHUNK_BYTES", 0)
                    q = fs.quantize(inp, scheme, flavor=flavor, axis=axis, **k)
                    where = f"{scheme} {flavor} {rounding} {name}{' chunked' if chunked else ''}"
                    np.testing.assert_array_equal(q.linear_scales(), want, err_msg=where)
                    np.testing.assert_array_equal(_codes(q), codes, err_msg=where)
                    fq = fs.fake_quantize(inp, scheme, flavor=flavor, axis=axis, **k)
                    np.testing.assert_array_equal(fq.view(np.uint32), fs.dequantize(q).view(np.uint32),
                                                  err_msg=where)
                    monkeypatch.undo()


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_sr_never_moves_an_exactly_representable_input(scheme):
    """Under SR an input that is exactly an E2M1 value after scaling keeps its code for every random byte (only
    inexact inputs may go up): every magnitude, both signs, all 256 bytes, block factor 1."""
    block = 16 if scheme == "nvfp4" else 32
    mags = fs.E2M1.values[:8].astype(np.float32)
    row = np.resize(np.concatenate([mags, -mags]), block).astype(np.float32)
    row[0] = 6.0
    x = np.tile(row, (256, 1))
    want = np.tile(fs.encode(row, fs.E2M1), (256, 1))
    r = np.repeat(np.arange(256, dtype=np.uint8)[:, None], block, axis=1)
    kw = {"global_amax": 2688.0} if scheme == "nvfp4" else {}
    q = fs.quantize(x, scheme, rounding="sr", rbits=r, **kw)
    np.testing.assert_array_equal(_codes(q), want)


def _four_over_six_adversarial():
    rng = np.random.default_rng(11)
    g = (rng.standard_normal((37, 53)) * np.exp2(rng.integers(-30, 30, (37, 1)))).astype(np.float32)
    bad = g.copy()
    bad[rng.random(g.shape) < 0.08] = np.nan
    bad[2, 3], bad[20, 40] = np.inf, -np.inf
    nans = np.full((17, 16), np.nan, np.float32)
    nans[3, 5] = 1.0
    return {"ragged rows and K": g, "NaN and Inf": bad, "all-NaN blocks": nans,
            "subnormal": (g * np.float32(1e-40)).astype(np.float32), "zeros": np.zeros((18, 33), np.float32)}


@pytest.mark.parametrize("case", list(_four_over_six_adversarial()))
@pytest.mark.parametrize("tile", [1, 16])
def test_four_over_six_kernel_on_adversarial_blocks(case, tile):
    """The Numba 4over6 kernel (no fast_math) against the block-by-block reference and the NumPy statement of
    the rule, bit for bit, on ragged shapes (R not a multiple of 16, K of 16), NaN / Inf, all-NaN blocks,
    subnormal and zero tensors, both error measures, both tie rules and a given second-level amax of 0 and
    Inf."""
    from fp4sim.cpu.backend import CpuKernels, SRPlan
    from fp4sim.cpu.four_over_six import nvfp4_4over6, nvfp4_4over6_numpy

    def encode(v, fmt):
        return CpuKernels.encode(np.ascontiguousarray(v, np.float32), fmt, 0, True, 8, SRPlan(0))
    x = _four_over_six_adversarial()[case]
    amax = np.float32(np.nanmax(np.abs(x))) if not np.isnan(x).all() else np.float32(0)
    for g in (amax, np.float32(0), np.float32(np.inf)):
        for mode in ("mse", "mae"):
            for ties in (False, True):
                got = nvfp4_4over6(x, tile, g, 448, mode, False, ties, encode)
                want = nvfp4_4over6_numpy(x, tile, g, 448, mode, False, ties, encode)
                for a, b in zip(got, want):
                    assert a.dtype == b.dtype and np.array_equal(a, b), (g, mode, ties)
    variants = [(mode, ties, emax, False) for mode in ("mse", "mae") for ties in ("map_to_6", "map_to_4")
                for emax in (448, 256)] + ([("mse", "map_to_6", 448, True)] if tile == 1 else [])
    for mode, ties, emax, rows in variants:
        q = fs.quantize(x, "nvfp4", block=(tile, 16), four_over_six=mode, four_over_six_ties=ties,
                        four_over_six_e4m3_max=emax, row_scaled=rows)
        codes, scales, pick = ref.nvfp4_4over6_ref(x, tile, None, mode, False, emax, ties == "map_to_4", rows)
        np.testing.assert_array_equal(q.linear_scales(), scales)
        np.testing.assert_array_equal(_codes(q), codes)
        np.testing.assert_array_equal(q.extras["map_to_4"], pick)


@pytest.mark.parametrize("scheme,block", [("mxfp8_e4m3", None), ("mxfp8_e5m2", None), ("fp8_e4m3", None),
                                          ("fp8_e5m2", None), ("fp8_blockwise", (1, 128)),
                                          ("fp8_blockwise", (128, 128))])
def test_byte_code_dequantize_is_the_table_times_the_block_scale(scheme, block):
    """dequantize of the one-byte formats (one Numba pass): every code (NaN and Inf codes included) times its
    block's scale as one float32 product, the scales adversarial (every UE8M0 byte for MX, NaN, Inf, subnormal
    and huge blockwise scales), ragged K and rows not a multiple of the tile. Oracle: ml_dtypes's decoding of the
    codes and scale bytes, the product taken in NumPy; where a code is NaN the output is NaN."""
    import dataclasses
    rng = np.random.default_rng(21)
    R, K = 300, 520                       # K: not a multiple of 32 or 128; R: not a multiple of 128
    kw = {} if block is None else {"block": block}
    q = fs.quantize(heavy((R, K), 4), scheme, **kw)
    elem = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[q.scheme.elem.name]
    codes = rng.integers(0, 256, q.codes.shape, dtype=np.uint8)
    codes[0, :256] = np.arange(256)
    vals = codes[:, :K].view(elem).astype(np.float32)
    if scheme.startswith("mx"):
        sc = rng.integers(0, 256, q.scales.shape, dtype=np.uint8)
        sc.reshape(-1)[:256] = np.arange(256)
        fac = np.repeat(sc.reshape(R, -1).view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, axis=1)[:, :K]
    elif scheme.startswith("fp8_e"):
        sc = np.array([3.0e-39], np.float32)          # a subnormal decode scale
        fac = np.full((R, K), sc[0], np.float32)
    else:
        sc = (rng.standard_normal(q.scales.shape) * 2.0 ** rng.integers(-140, 120, q.scales.shape)).astype(np.float32)
        sc.reshape(-1)[:4] = [np.nan, np.inf, 1e-45, 3e38]
        t = block[0]
        fac = np.repeat(np.repeat(sc.reshape(-(-R // t), -1), t, axis=0)[:R], 128, axis=1)[:, :K]
    q2 = dataclasses.replace(q, codes=codes, scales=sc)
    got = fs.dequantize(q2)
    assert got.dtype == np.float32 and got.shape == (R, K)
    with np.errstate(invalid="ignore", over="ignore"):
        want = vals * fac
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    # and the bits, NaNs included, of the table product the kernel replaced
    with np.errstate(invalid="ignore", over="ignore"):
        table = q.scheme.elem.values[codes[:, :K]] * fac
    np.testing.assert_array_equal(got.view(np.uint32), table.view(np.uint32))
