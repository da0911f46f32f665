"""Level 1 (GPU): every CUDA op against its NumPy twin on fresh random inputs, odd sizes
included, output buffers poisoned (NaN) before each call; tolerances from tests/tolerances.py."""

import json
from pathlib import Path

import numpy as np
import pytest

from ftengine.backends import numpy_ops as ref
from ftengine.backends.cuda import algos, attention, families, gemm, pooling
from ftengine.backends.cuda.pooling import POOL_WARPS
from ftengine.errors import DeviceError
from tests.tolerances import OPS

pytestmark = pytest.mark.gpu
DTYPES = ["fp32", "fp16", "bf16"]
HIDDEN = [384, 768, 1024, 200]


@pytest.fixture(scope="module")
def cu():
    from ftengine.backends.cuda import ops
    return ops


def quantize(cu, x, dtype):
    """(device array in `dtype`, the host float32 values it holds) for a float32 host array."""
    dev = cu.to_device(np.asarray(x, np.float32), cu.storage_dtype(dtype))
    return dev, cu.to_host(dev).astype(np.float32)


def poisoned(cu, shape, dtype):
    """A new device array filled with NaN, on the stream the ops launch on (ctx.stream does not wait
    for CuPy's default stream: a fill there could land during or after the op under test)."""
    import cupy
    storage = np.dtype(cu.storage_dtype(dtype))
    out = cu.empty(shape, storage)
    with cu.context().stream:
        if storage == np.uint16:
            out.view(cupy.uint16).fill(0x7FC0)  # bf16 NaN
        else:
            out.fill(np.nan)
    return out


def assert_close(cu, out, expected, dtype):
    assert_close_host(cu.to_host(out).astype(np.float32), expected, dtype)


def assert_close_host(got, expected, dtype):
    assert not np.isnan(got).any(), "some outputs were never written (NaN poison left)"
    tol = OPS[dtype]
    bound = tol["atol"] + tol["rtol"] * np.abs(expected)
    worst = np.max(np.abs(got - expected) - bound)
    assert worst <= 0, f"max |err| {np.abs(got - expected).max():.3g} exceeds {dtype} tolerance"


def ints(cu, a):
    return cu.to_device(np.asarray(a, np.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", HIDDEN)
def test_embed_layernorm(cu, rng, dtype, h):
    t, v, p, tv = 37, 101, 64, 2
    ids, pos, types = rng.integers(0, v, t), rng.integers(0, p, t), rng.integers(0, tv, t)
    tables = [quantize(cu, rng.standard_normal(shape), dtype) for shape in ((v, h), (p, h), (tv, h))]
    gamma, beta = (quantize(cu, rng.standard_normal(h), dtype) for _ in range(2))
    out = poisoned(cu, (t, h), dtype)
    cu.embed_layernorm(out, ints(cu, ids), ints(cu, types), ints(cu, pos), *(d for d, _ in tables),
                       gamma[0], beta[0], eps=1e-12)
    expected = np.empty((t, h), np.float32)
    ref.embed_layernorm(expected, ids, types, pos, *(hst for _, hst in tables), gamma[1], beta[1], eps=1e-12)
    assert_close(cu, out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", HIDDEN)
@pytest.mark.parametrize("alias", [False, True])
@pytest.mark.parametrize("t", [53, 1029])
def test_add_bias_residual_layernorm(cu, rng, dtype, h, alias, t):
    """A block a row, and from LN_WARP_MIN_ROWS rows a warp a row where the row is short (1029 rows:
    the last block's warps past the rows), against the NumPy twin."""
    (x, xh), (b, bh), (r, rh), (g, gh), (be, beh) = (
        quantize(cu, rng.standard_normal(s), dtype) for s in ((t, h), (h,), (t, h), (h,), (h,)))
    out = r if alias else poisoned(cu, (t, h), dtype)
    expected = np.empty((t, h), np.float32)
    ref.add_bias_residual_layernorm(expected, xh, bh, rh, gh, beh, eps=1e-5)
    cu.add_bias_residual_layernorm(out, x, b, r, g, be, eps=1e-5)
    assert_close(cu, out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n, splits", [(128, 3072, 768, 4), (300, 3072, 768, 2), (13, 2064, 96, 2),
                                             (7, 2048, 64, 4), (3, 3072, 768, 1), (1100, 2048, 768, 1),
                                             (40, 3072, 100, 1), (40, 1536, 384, 1)])
@pytest.mark.parametrize("alias", [False, True])
def test_matmul_bias_residual_layernorm(cu, rng, dtype, m, k, n, splits, alias):
    """A product read by bias + residual + LayerNorm (BERT's FFN down): with K split into `splits`
    slices (16-bit operands: cuBLAS's float partial sums, added up by the split LayerNorm kernel)
    or (too few rows, too many outputs, N not a multiple of 8, K too short, float32) matmul then
    add_bias_residual_layernorm; against the NumPy twin fed the product as the storage type holds
    it. The output may be the residual itself."""
    splits = 1 if dtype == "fp32" else splits
    assert cu.blas_split_k(m, n, k, cu.storage_dtype(dtype)) == splits
    # operands on a grid of 1/4 in [-2, 2]: every sum of their products is exact in float32, so the
    # product as stored is the exact one rounded, whatever the order or the slices of its sums
    (x, xh), (w, wh) = (quantize(cu, rng.integers(-8, 9, s) / 4, dtype) for s in ((m, k), (n, k)))
    (r, rh), (bias, biash), (g, gh), (b, bh) = (quantize(cu, rng.standard_normal(s), dtype)
                                                for s in ((m, n), (n,), (n,), (n,)))
    product, partials = poisoned(cu, (m, n), dtype), cu.empty((max(1, cu.partials_size(m, n)),), np.float32)
    out = r if alias else poisoned(cu, (m, n), dtype)
    cu.matmul_bias_residual_layernorm(out, x, w, bias, r, g, b, eps=1e-5, product=product, partials=partials)
    stored = quantize(cu, xh.astype(np.float64) @ wh.T.astype(np.float64), dtype)[1]
    expected = np.empty((m, n), np.float32)
    ref.add_bias_residual_layernorm(expected, stored, biash, rh, gh, bh, eps=1e-5)
    assert_close(cu, out, expected, dtype)
    if splits > 1:
        with pytest.raises(DeviceError, match=r"partials holds 7 float32 values; a split product"):
            cu.matmul_bias_residual_layernorm(out, x, w, bias, r, g, b, eps=1e-5, product=product,
                                              partials=partials[:7])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("m, k, n, fused", [(8200, 1536, 384, True), (8192, 384, 384, True), (9000, 776, 328, True),
                                            (8300, 200, 200, True), (8191, 384, 384, False), (8200, 768, 768, False)])
@pytest.mark.parametrize("alias", [False, True])
def test_matmul_bias_residual_layernorm_wgmma(cu, rng, dtype, m, k, n, fused, alias):
    """The product + bias + residual + LayerNorm in one kernel (gemm_sm90.cu matmul_wgmma_ln, compute
    capability 9.0: a cluster of blocks across each row, from WGMMA_LN_MIN_ROWS rows, rows of up to
    LN_CLUSTER_MAX tiles; else matmul then add_bias_residual_layernorm: fused False): rows, columns
    and K that are not multiples of its tiles, the output the residual itself or not, against the
    NumPy twin fed the exact product (operands on a grid of 1/4: every float32 sum of their
    products is exact), as the fused kernel does not round it first; captured in a graph (a
    programmatic dependent launch in a cluster), the same bits as launched directly."""
    if not cu.context().wgmma:
        pytest.skip("the wgmma product runs on compute capability 9.0 only")
    (x, xh), (w, wh) = (quantize(cu, rng.integers(-8, 9, s) / 4, dtype) for s in ((m, k), (n, k)))
    (r, rh), (bias, biash), (g, gh), (b, bh) = (quantize(cu, rng.standard_normal(s), dtype)
                                                for s in ((m, n), (n,), (n,), (n,)))
    product, partials = poisoned(cu, (m, n), dtype), cu.empty((max(1, cu.partials_size(m, n)),), np.float32)
    out = r if alias else poisoned(cu, (m, n), dtype)
    assert cu.wgmma_ln_fits(out, x, w, r) == fused
    exact = (xh.astype(np.float64) @ wh.T.astype(np.float64)).astype(np.float32)
    expected = np.empty((m, n), np.float32)
    ref.add_bias_residual_layernorm(expected, exact if fused else quantize(cu, exact, dtype)[1], biash, rh, gh, bh,
                                    eps=1e-5)
    residual_copy = cu.to_host(r)
    cu.matmul_bias_residual_layernorm(out, x, w, bias, r, g, b, eps=1e-5, product=product, partials=partials)
    assert_close(cu, out, expected, dtype)
    if alias:
        r, _ = quantize(cu, residual_copy, dtype)
        captured = r
    else:
        captured = poisoned(cu, (m, n), dtype)
    stream = cu.context().stream
    stream.begin_capture()
    try:
        cu.matmul_bias_residual_layernorm(captured, x, w, bias, r, g, b, eps=1e-5, product=product,
                                          partials=partials)
    finally:
        graph = stream.end_capture()
    graph.launch(stream=stream)
    np.testing.assert_array_equal(cu.to_host(captured), cu.to_host(out))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["erf", "tanh"])
@pytest.mark.parametrize("inter", [1536, 3072, 4096, 803])
def test_add_bias_gelu(cu, rng, dtype, form, inter):
    t = 29
    (x, xh), (b, bh) = (quantize(cu, 3 * rng.standard_normal(s), dtype) for s in ((t, inter), (inter,)))
    out = poisoned(cu, (t, inter), dtype)
    expected = np.empty((t, inter), np.float32)
    ref.add_bias_gelu(expected, xh, bh, form=form)
    cu.add_bias_gelu(out, x, b, form=form)
    assert_close(cu, out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["identity", "relu", "silu"])
@pytest.mark.parametrize("n", [37, 2048, 58101])
def test_add_bias_act(cu, rng, dtype, act, n):
    t = 9
    (x, xh), (b, bh) = (quantize(cu, 3 * rng.standard_normal(s), dtype) for s in ((t, n), (n,)))
    out = poisoned(cu, (t, n), dtype)
    expected = np.empty((t, n), np.float32)
    ref.add_bias_act(expected, xh, bh, act=act)
    cu.add_bias_act(out, x, b, act=act)
    assert_close(cu, out, expected, dtype)


SPLITS = [(1, 1, 12, 64), (3, 17, 6, 64), (2, 128, 16, 64), (5, 33, 4, 50), (64, 8, 12, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, seq, heads, d", SPLITS)
def test_split_and_merge_heads(cu, rng, dtype, batch, seq, heads, d):
    h = heads * d
    (qkv, qkvh), (b, bh) = (quantize(cu, rng.standard_normal(s), dtype) for s in ((batch * seq, 3 * h), (3 * h,)))
    outs = [poisoned(cu, (batch * heads, seq, d), dtype) for _ in range(3)]
    expected = [np.empty((batch * heads, seq, d), np.float32) for _ in range(3)]
    cu.add_qkv_bias_split_heads(*outs, qkv, b, batch=batch, seq=seq, heads=heads)
    ref.add_qkv_bias_split_heads(*expected, qkvh, bh, batch=batch, seq=seq, heads=heads)
    for o, e in zip(outs, expected):
        assert_close(cu, o, e, dtype)
    ctx, ctxh = quantize(cu, rng.standard_normal((batch * heads, seq, d)), dtype)
    merged = poisoned(cu, (batch * seq, h), dtype)
    expected_merged = np.empty((batch * seq, h), np.float32)
    cu.merge_heads(merged, ctx, batch=batch, seq=seq, heads=heads)
    ref.merge_heads(expected_merged, ctxh, batch=batch, seq=seq, heads=heads)
    assert_close(cu, merged, expected_merged, dtype)


SOFTMAX = [(1, 1), (3, 7), (2, 32), (4, 33), (2, 128), (1, 255), (2, 256), (1, 512), (1, 1000), (1, 1500), (64, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, seq", SOFTMAX)
def test_masked_softmax(cu, rng, dtype, batch, seq):
    heads = 3
    lengths = rng.integers(1, seq + 1, batch)
    lengths[0] = seq
    scores, sh = quantize(cu, 4 * rng.standard_normal((batch * heads, seq, seq)), dtype)
    out = poisoned(cu, scores.shape, dtype)
    expected = np.empty(sh.shape, np.float32)
    ref.masked_softmax(expected, sh, lengths, heads=heads)
    cu.masked_softmax(out, scores, ints(cu, lengths), heads=heads)
    assert_close(cu, out, expected, dtype)
    cu.masked_softmax(scores, scores, ints(cu, lengths), heads=heads)  # in place, as the model runs it
    assert_close(cu, scores, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_row_is_zero_not_nan(cu, rng, dtype):
    seq, heads = 40, 2
    lengths = np.array([0, 5])
    scores, sh = quantize(cu, rng.standard_normal((2 * heads, seq, seq)), dtype)
    out = poisoned(cu, scores.shape, dtype)
    cu.masked_softmax(out, scores, ints(cu, lengths), heads=heads)
    got = cu.to_host(out).astype(np.float32)
    assert (got[:heads] == 0).all()
    expected = np.empty(sh.shape, np.float32)
    ref.masked_softmax(expected, sh, lengths, heads=heads)
    assert_close(cu, out, expected, dtype)


GEMMS = [(1, 384, 1152), (37, 768, 768), (128, 1024, 4096), (5, 200, 803), (512, 3072, 768)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n", GEMMS)
def test_matmul(cu, rng, dtype, m, k, n):
    (x, xh), (w, wh) = (quantize(cu, rng.standard_normal(s) / np.sqrt(k) ** 0.5, dtype) for s in ((m, k), (n, k)))
    out = poisoned(cu, (m, n), dtype)
    cu.matmul(out, x, w)
    expected = (xh.astype(np.float64) @ wh.T.astype(np.float64)).astype(np.float32)
    assert_close(cu, out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n", GEMMS)
@pytest.mark.parametrize("form", ["erf", "tanh"])
def test_matmul_bias_gelu_many_rows(cu, rng, dtype, m, k, n, form):
    """Past the gemv's rows: the tanh form in cuBLASLt's GELU_BIAS epilogue, the erf form in the
    wgmma product (compute capability 9.0, 16-bit types) or as a product then the bias + GELU
    kernel; both against the NumPy twin on the same values."""
    (x, xh), (w, wh) = (quantize(cu, rng.standard_normal(s) / np.sqrt(k) ** 0.5, dtype) for s in ((m, k), (n, k)))
    bias, biash = quantize(cu, rng.standard_normal(n), dtype)
    out, expected = poisoned(cu, (m, n), dtype), np.empty((m, n), np.float32)
    cu.matmul_bias_gelu(out, x, w, bias, form=form)
    ref.matmul_bias_gelu(expected, xh.astype(np.float64), wh.astype(np.float64), biash, form=form)
    assert_close(cu, out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n", [(1, 512, 2048), (3, 200, 803), (8, 256, 16500), (32, 384, 16400), (129, 256, 700)])
@pytest.mark.parametrize("act", ["identity", "relu", "silu"])
def test_matmul_bias_act(cu, rng, dtype, m, k, n, act):
    """The bias + activation in the epilogue of the few-row kernels (gemv.cu: gemv up to GEMV_ROWS
    rows, skinny_mma for 4-32 rows of 16-bit types from SKINNY_MIN_COLUMNS columns), else the product
    then add_bias_act; against the NumPy twin on the same values."""
    (x, xh), (w, wh) = (quantize(cu, rng.standard_normal(s) / np.sqrt(k) ** 0.5, dtype) for s in ((m, k), (n, k)))
    bias, biash = quantize(cu, rng.standard_normal(n), dtype)
    out, expected = poisoned(cu, (m, n), dtype), np.empty((m, n), np.float32)
    cu.matmul_bias_act(out, x, w, bias, act=act)
    ref.matmul_bias_act(expected, xh.astype(np.float64), wh.astype(np.float64), biash, act=act)
    assert_close(cu, out, expected, dtype)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("m", [1, 4, 16, 128])
def test_matmul_bias_act_float_logits(cu, rng, dtype, m):
    """An LM head's logits and their bias (final_logits_bias and banned tokens) in float32 from
    16-bit rows and weights, Marian-base's 58,101 columns: every path of matmul_bias_act."""
    k, n = 512, 58101
    (x, xh), (w, wh) = (quantize(cu, rng.standard_normal(s) / np.sqrt(k) ** 0.5, dtype) for s in ((m, k), (n, k)))
    biash = rng.standard_normal(n).astype(np.float32)
    biash[7] -= 1.0e9
    out, expected = poisoned(cu, (m, n), "fp32"), np.empty((m, n), np.float32)
    cu.matmul_bias_act(out, x, w, cu.to_device(biash), act="identity")
    ref.matmul_bias_act(expected, xh.astype(np.float64), wh.astype(np.float64), biash, act="identity")
    assert_close(cu, out, expected, "fp32")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("m, k, n, tile", [(4099, 768, 3072, 256), (8200, 384, 1544, 256), (3100, 200, 4200, 256),
                                           (1000, 376, 3000, 128), (129, 384, 1544, 64), (5, 384, 1544, 64),
                                           (300, 72, 136, 64), (37, 264, 1000, 64), (64, 64, 520, 64),
                                           (33, 768, 3072, 64), (129, 768, 3072, None)])
def test_matmul_bias_gelu_wgmma(cu, rng, dtype, m, k, n, tile):
    """The erf form's fused wgmma product (gemm_sm90.cu, compute capability 9.0; 256-column tiles
    from WGMMA_GELU_MIN_OUTPUTS outputs on, narrower below for K <= WGMMA_NARROW_MAX_K or at most
    WGMMA_SPLIT_ROWS rows (K split between its warpgroups: odd and even step counts, one step), else
    cuBLASLt and the pass: tile None): rows, columns and K that are not multiples of its tiles,
    against the NumPy twin; captured in a graph (a programmatic dependent launch), the same bits as
    launched directly."""
    if not cu.context().wgmma:
        pytest.skip("the wgmma product runs on compute capability 9.0 only")
    (x, xh), (w, wh) = (quantize(cu, rng.standard_normal(s) / np.sqrt(k) ** 0.5, dtype) for s in ((m, k), (n, k)))
    bias, biash = quantize(cu, rng.standard_normal(n), dtype)
    out, expected = poisoned(cu, (m, n), dtype), np.empty((m, n), np.float32)
    assert gemm._wgmma_tile(out, x, w, bias) == tile
    cu.matmul_bias_gelu(out, x, w, bias, form="erf")
    ref.matmul_bias_gelu(expected, xh.astype(np.float64), wh.astype(np.float64), biash, form="erf")
    assert_close(cu, out, expected, dtype)
    captured = poisoned(cu, (m, n), dtype)
    stream = cu.context().stream
    stream.begin_capture()
    try:
        cu.matmul_bias_gelu(captured, x, w, bias, form="erf")
    finally:
        graph = stream.end_capture()
    graph.launch(stream=stream)
    np.testing.assert_array_equal(cu.to_host(captured), cu.to_host(out))


def test_matmul_algorithm_timed_once_per_shape_and_shared_by_threads(cu, rng):
    """A new product shape of TRIAL_MIN_ROWS rows or more gets its cuBLASLt algorithm timed on its
    first call outside a capture; every thread then runs that one algorithm, so two threads'
    results are identical bit for bit."""
    import threading
    m, k, n = algos.TRIAL_MIN_ROWS + 3, 256, 320
    (x, xh), (w, wh) = (quantize(cu, rng.standard_normal(s) / np.sqrt(k) ** 0.5, "fp16") for s in ((m, k), (n, k)))
    x_host, w_host = cu.to_host(x), cu.to_host(w)
    results = {}

    def run(name):  # each thread has its own stream and cuBLASLt handle
        xs, ws = cu.to_device(x_host, np.float16), cu.to_device(w_host, np.float16)
        out = poisoned(cu, (m, n), "fp16")
        cu.matmul(out, xs, ws)
        results[name] = cu.to_host(out)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = [key for key in algos._ALGOS if key[2:5] == (n, m, k)]
    assert len(keys) == 1
    assert np.array_equal(results[0], results[1])
    assert_close_host(results[0], (xh.astype(np.float64) @ wh.T.astype(np.float64)).astype(np.float32), "fp16")


def recorded_trials(cu, monkeypatch) -> list:
    """The plan keys of the trials (algos._choose_algo) run from now on in the test."""
    trials = []
    choose = algos._choose_algo
    monkeypatch.setattr(algos, "_choose_algo", lambda ctx, key, product: trials.append(key) or choose(ctx, key, product))
    return trials


def checked_product(cu, rng, m, k, n) -> bytes:
    """cu.matmul of fresh fp16 (m, k) x (n, k)^T operands, checked against NumPy; the bytes of the
    algorithm it ran."""
    (x, xh), (w, wh) = (quantize(cu, rng.standard_normal(s) / np.sqrt(k) ** 0.5, "fp16") for s in ((m, k), (n, k)))
    out = poisoned(cu, (m, n), "fp16")
    cu.matmul(out, x, w)
    assert_close(cu, out, (xh.astype(np.float64) @ wh.T.astype(np.float64)).astype(np.float32), "fp16")
    return bytes(next(algo for key, algo in algos._ALGOS.items() if key[2:5] == (n, m, k)))


def test_matmul_shapes_of_one_row_bucket_share_one_trial(cu, rng, monkeypatch):
    """The first shape of a row bucket (rows up to the next power of two) is timed; a later shape of
    the same bucket runs the algorithm chosen for it, without a trial of its own, and computes
    the right product."""
    k, n = 192, 288
    trials = recorded_trials(cu, monkeypatch)
    first, second = [checked_product(cu, rng, m, k, n) for m in (algos.TRIAL_MIN_ROWS + 5, algos.TRIAL_MIN_ROWS + 1000)]
    assert [key[3] for key in trials] == [algos.TRIAL_MIN_ROWS + 5]
    assert first == second


def as_new_process(cu, monkeypatch):
    """algos.py's algorithm choices as a new process finds them: none in memory, no file read."""
    for name in ("_ALGOS", "_BUCKET_ALGOS", "_ALGO_FILES"):
        monkeypatch.setattr(algos, name, {})


def test_matmul_algorithm_kept_on_disk_for_the_next_process(cu, rng, monkeypatch, tmp_path):
    """The algorithm timed for a row bucket's first shape goes into the GPU's algorithm file, for
    that shape and for its bucket; a later process runs it for that shape and for another shape of
    the bucket without a trial, and computes the right products."""
    from ftengine.backends.cuda.algo_cache import ENV
    monkeypatch.setenv(ENV, str(tmp_path))
    k, n = 160, 224
    as_new_process(cu, monkeypatch)
    trials = recorded_trials(cu, monkeypatch)
    first = checked_product(cu, rng, algos.TRIAL_MIN_ROWS + 9, k, n)
    assert len(trials) == 1
    cache = algos._algo_file(cu.context())[0]
    assert cache.path.parent == tmp_path
    saved = json.loads(cache.path.read_text())["algorithms"]
    assert sorted(json.loads(name)[0] for name in saved) == ["bucket", "shape"]
    assert set(saved.values()) == {first.hex()}
    as_new_process(cu, monkeypatch)
    trials.clear()
    for m in (algos.TRIAL_MIN_ROWS + 700, algos.TRIAL_MIN_ROWS + 9):
        assert checked_product(cu, rng, m, k, n) == first
    assert trials == []


def test_matmul_algorithm_file_not_ours_is_timed_again_and_replaced(cu, rng, monkeypatch, tmp_path, capsys):
    """A broken algorithm file is said once on stderr, the shape is timed as with no file, and the
    file is written again holding that choice."""
    from ftengine.backends.cuda.algo_cache import ENV
    monkeypatch.setenv(ENV, str(tmp_path))
    as_new_process(cu, monkeypatch)
    cache = algos._algo_file(cu.context())[0]
    cache.path.write_text('{"fingerprint": {"sms": 1')
    as_new_process(cu, monkeypatch)
    trials = recorded_trials(cu, monkeypatch)
    chosen = checked_product(cu, rng, algos.TRIAL_MIN_ROWS + 11, 96, 352)
    assert len(trials) == 1
    assert f"ignoring the algorithm cache {cache.path}" in capsys.readouterr().err
    assert set(json.loads(cache.path.read_text())["algorithms"].values()) == {chosen.hex()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_of_operands_not_256_byte_aligned(cu, rng, dtype):
    """A view starting inside an allocation (here one row in: 400 bytes in fp32, 200 in 16-bit)
    goes through cuBLAS's GemmEx; cuBLASLt's plans assume 256-byte aligned operands."""
    m, k, n = 37, 100, 96
    (x, xh), (w, wh) = (quantize(cu, rng.standard_normal(s) / np.sqrt(k) ** 0.5, dtype) for s in ((m + 1, k), (n, k)))
    assert x[1:].data.ptr % 256 != 0
    out = poisoned(cu, (m, n), dtype)
    cu.matmul(out, x[1:], w)
    assert_close(cu, out, (xh[1:].astype(np.float64) @ wh.T.astype(np.float64)).astype(np.float32), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n", [(1, 768, 2304), (3, 200, 77), (8, 3072, 768), (4, 768, 50257), (2, 768, 50257),
                                     (2, 7, 5)])
def test_few_row_matmul_and_fused_bias_gelu(cu, rng, dtype, m, k, n):
    """Few rows (decode steps: the weight-streaming kernel up to GEMV_ROWS, cuBLAS past it): plain,
    into float32 (LM-head logits), and with bias + GELU, both forms."""
    (x, xh), (w, wh) = (quantize(cu, rng.standard_normal(s) / np.sqrt(k) ** 0.5, dtype) for s in ((m, k), (n, k)))
    expected = (xh.astype(np.float64) @ wh.T.astype(np.float64)).astype(np.float32)
    for out_dtype in dict.fromkeys((dtype, "fp32")):
        out = poisoned(cu, (m, n), out_dtype)
        cu.matmul(out, x, w)
        assert_close(cu, out, expected, dtype)
    bias, biash = quantize(cu, rng.standard_normal(n), dtype)
    for form in ("erf", "tanh"):
        out, fused = poisoned(cu, (m, n), dtype), np.empty((m, n), np.float32)
        cu.matmul_bias_gelu(out, x, w, bias, form=form)
        ref.matmul_bias_gelu(fused, xh, wh, biash, form=form)
        assert_close(cu, out, fused, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [2, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_either_column_tile(cu, rng, dtype, cols, m):
    """gemv.cu gemv with each of its column tiles (gemm.GEMV_COLS), on columns that are not a multiple
    of it: plain, into float32, with bias + GELU."""
    assert cols in gemm.GEMV_COLS
    k, n = 776, 1031
    (x, xh), (w, wh) = (quantize(cu, rng.standard_normal(s) / np.sqrt(k) ** 0.5, dtype) for s in ((m, k), (n, k)))
    expected = (xh.astype(np.float64) @ wh.T.astype(np.float64)).astype(np.float32)
    for out_dtype in dict.fromkeys((dtype, "fp32")):
        out = poisoned(cu, (m, n), out_dtype)
        gemm._gemv(out, x, w, None, 0, cols)
        assert_close(cu, out, expected, dtype)
    bias, biash = quantize(cu, rng.standard_normal(n), dtype)
    out, fused = poisoned(cu, (m, n), dtype), np.empty((m, n), np.float32)
    gemm._gemv(out, x, w, bias, 1 + cu.GELU_FORMS["erf"], cols)
    ref.matmul_bias_gelu(fused, xh, wh, biash, form="erf")
    assert_close(cu, out, fused, dtype)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("m, k, n", [(2, 32, 33), (5, 96, 50), (8, 800, 777), (9, 256, 1000), (17, 3072, 64),
                                     (32, 768, 1031)])
def test_skinny_tensor_core_product(cu, rng, dtype, m, k, n):
    """The tensor-core skinny kernel (gemv.cu skinny_mma; every tile configuration: up to 8, up to
    16 and up to 32 rows) on shapes that are not multiples of its tiles, K from one 32-wide chunk to many:
    plain, into float32 (LM-head logits), and with bias + GELU, both forms."""
    (x, xh), (w, wh) = (quantize(cu, rng.standard_normal(s) / np.sqrt(k) ** 0.5, dtype) for s in ((m, k), (n, k)))
    expected = (xh.astype(np.float64) @ wh.T.astype(np.float64)).astype(np.float32)
    for out_dtype in (dtype, "fp32"):
        out = poisoned(cu, (m, n), out_dtype)
        gemm._skinny(out, x, w, None, 0)
        assert_close(cu, out, expected, dtype)
    bias, biash = quantize(cu, rng.standard_normal(n), dtype)
    for form in ("erf", "tanh"):
        out, fused = poisoned(cu, (m, n), dtype), np.empty((m, n), np.float32)
        gemm._skinny(out, x, w, bias, 1 + cu.GELU_FORMS[form])
        ref.matmul_bias_gelu(fused, xh, wh, biash, form=form)
        assert_close(cu, out, fused, dtype)


def test_matmul_sends_the_skinny_kernel_only_what_it_fits(cu, rng):
    """SKINNY_MIN_ROWS .. SKINNY_ROWS rows of 16-bit x against SKINNY_MIN_COLUMNS columns or more, K a
    multiple of 32, 16-byte aligned: the skinny kernel; fewer rows (the gemv is faster), more rows, fewer columns,
    float32, a weight of another dtype, another K or a misaligned view: not; each routed product
    equals NumPy's."""
    k, n = 256, gemm.SKINNY_MIN_COLUMNS + 7
    w16, wh = quantize(cu, rng.standard_normal((n, k)) / 4, "fp16")
    w32, _ = quantize(cu, wh, "fp32")
    x16, xh = quantize(cu, rng.standard_normal((gemm.SKINNY_ROWS + 2, k)) / 4, "fp16")
    x32, _ = quantize(cu, xh, "fp32")
    assert gemm._skinny_fits(x16[:gemm.SKINNY_MIN_ROWS], w16) and gemm._skinny_fits(x16[:gemm.SKINNY_ROWS], w16)
    assert not gemm._skinny_fits(x16[:gemm.SKINNY_MIN_ROWS - 1], w16)
    assert not gemm._skinny_fits(x16[:gemm.SKINNY_ROWS + 1], w16)
    assert not gemm._skinny_fits(x16[:8], w16[:gemm.SKINNY_MIN_COLUMNS - 1])
    assert not gemm._skinny_fits(x32[:8], w32)
    assert not gemm._skinny_fits(x16[:8], quantize(cu, wh, "bf16")[0])
    x_odd_k, w_odd_k = (quantize(cu, rng.standard_normal(s), "fp16")[0] for s in ((8, k - 16), (n, k - 16)))
    assert not gemm._skinny_fits(x_odd_k, w_odd_k)
    flat = cu.empty((8 * k + 1,), np.float16)
    assert not gemm._skinny_fits(flat[1:].reshape(8, k), w16)
    for m in (1, 2, 3, 4, 9, gemm.SKINNY_ROWS, gemm.SKINNY_ROWS + 1):
        out = poisoned(cu, (m, n), "fp32")
        cu.matmul(out, x16[:m], w16)
        assert_close(cu, out, (xh[:m].astype(np.float64) @ wh.T.astype(np.float64)).astype(np.float32), "fp16")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_b", [True, False])
@pytest.mark.parametrize("nb, m, k, p", [(36, 128, 64, 128), (7, 33, 50, 33), (1, 1, 64, 1), (24, 512, 64, 512)])
def test_batched_matmul(cu, rng, dtype, transpose_b, nb, m, k, p):
    a, ah = quantize(cu, rng.standard_normal((nb, m, k)) / 4, dtype)
    b, bh = quantize(cu, rng.standard_normal((nb, p, k) if transpose_b else (nb, k, p)) / 4, dtype)
    out = poisoned(cu, (nb, m, p), dtype)
    cu.batched_matmul(out, a, b, transpose_b=transpose_b, alpha=0.125)
    expected = np.empty((nb, m, p), np.float32)
    ref.batched_matmul(expected, ah.astype(np.float64), bh.astype(np.float64), transpose_b=transpose_b, alpha=0.125)
    assert_close(cu, out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, seq, h", [(1, 1, 384), (3, 17, 768), (64, 9, 200), (2, 512, 1024)])
@pytest.mark.parametrize("skip", [0, 4])  # a prompt's tokens left out (some sequences no longer than it)
@pytest.mark.parametrize("warps", POOL_WARPS)  # each block size pooling.cu has, whatever pooling._pool_warps picks
def test_pool_and_normalize(cu, rng, monkeypatch, dtype, batch, seq, h, skip, warps):
    monkeypatch.setattr(pooling, "_pool_warps", lambda blocks: warps)
    modes = ("cls", "max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken")
    lengths = rng.integers(1, seq + 1, batch)
    hidden, hh = quantize(cu, rng.standard_normal((batch * seq, h)), dtype)
    out = poisoned(cu, (batch, len(modes) * h), "fp32")  # pooled vectors are float32
    expected = np.empty((batch, len(modes) * h), np.float32)
    cu.pool(out, hidden, ints(cu, lengths), seq=seq, modes=modes, skip=skip)
    ref.pool(expected, hh, lengths, seq=seq, modes=modes, skip=skip)
    assert_close(cu, out, expected, "fp32")


@pytest.mark.parametrize("batch, d", [(1, 384), (3, 768), (64, 200), (2, 5 * 1024)])
def test_l2_normalize(cu, rng, batch, d):
    x, xh = quantize(cu, rng.standard_normal((batch, d)), "fp32")
    normed = poisoned(cu, (batch, d), "fp32")
    cu.l2_normalize(normed, x)
    expected = np.empty((batch, d), np.float32)
    ref.l2_normalize(expected, xh)
    assert_close(cu, normed, expected, "fp32")


# ---------------------------------------------------------------- padding-free layout

def _offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


VARLEN = [  # (lengths, heads)
    ([1], 12),
    ([7], 2),
    ([64, 65, 1, 129], 3),
    (list(range(1, 33)), 2),                      # every sequence a different length
    ([512, 300], 4),
    ([2048, 1024, 3], 2),                         # longer than BERT's 512 positions
    (lambda rng: rng.integers(1, 129, 128).tolist(), 2),  # batch 128
    ([512] * 23 + [300], 12),                     # many blocks of 512-token sequences
    ([1024] * 3 + [1500, 7], 12),                 # the wide tiles (VARLEN_TILES) at head dim <= 64
]


@pytest.fixture(params=["default", "mma"])
def attention_path(request, cu, monkeypatch):
    """The kernel path varlen_attention takes: its own choice, and ("mma") the mma.sync kernel where
    the GPU would choose the wgmma one (sm_90), so that both are tested there."""
    if request.param == "mma":
        if not cu.context().wgmma:
            pytest.skip("the mma.sync kernel is the default path on this GPU")
        monkeypatch.setattr(cu.context(), "wgmma", False)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("case", range(len(VARLEN)))
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_attention(cu, rng, dtype, d, case, causal, attention_path):
    if attention_path == "mma" and (d not in attention.VARLEN_WG_HEAD_DIMS or dtype == "fp32"):
        pytest.skip("the wgmma kernel takes head dims 64 and 32 in 16-bit types only")
    lengths, heads = VARLEN[case]
    lengths = lengths(rng) if callable(lengths) else lengths
    h = heads * d
    t = sum(lengths) + 5  # five tokens of batch padding past the last sequence
    cu_seqlens = _offsets(lengths)
    qkv, qkvh = quantize(cu, rng.standard_normal((t, 3 * h)), dtype)
    bias, biash = quantize(cu, 0.5 * rng.standard_normal(3 * h), dtype)
    out = poisoned(cu, (t, h), dtype)
    cu.varlen_attention(out, qkv, bias, ints(cu, cu_seqlens), heads=heads, max_seqlen=max(lengths), causal=causal)
    expected = np.empty((t, h), np.float32)
    ref.varlen_attention(expected, qkvh, biash, cu_seqlens, heads=heads, max_seqlen=max(lengths), causal=causal)
    assert_close(cu, out, expected, dtype)
    first = cu.to_host(out).copy()
    cu.varlen_attention(out, qkv, bias, ints(cu, cu_seqlens), heads=heads, max_seqlen=max(lengths), causal=causal)
    np.testing.assert_array_equal(cu.to_host(out), first)  # repeated runs are identical


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("misaligned", [False, True])
def test_varlen_attention_zeroes_many_padding_rows(cu, rng, dtype, misaligned, attention_path):
    """Every block shares zeroing the rows past the last sequence: 1,000 of them (more than the
    grid's threads store at once), in 16-byte units, or an element at a time where the output
    starts 4 bytes past a 16-byte boundary (the kernels store pairs of 16-bit values); the
    sequences' rows equal the reference."""
    if attention_path == "mma" and dtype == "fp32":
        pytest.skip("the wgmma kernel takes 16-bit types only")
    lengths, heads, d = [40, 70, 3], 2, 64
    h, t = heads * d, sum(lengths) + 1000
    cu_seqlens = _offsets(lengths)
    qkv, qkvh = quantize(cu, rng.standard_normal((t, 3 * h)), dtype)
    bias, biash = quantize(cu, 0.5 * rng.standard_normal(3 * h), dtype)
    storage = poisoned(cu, (t * h + 2,), dtype)
    skip = 4 // storage.itemsize if misaligned else 0
    out = storage[skip:skip + t * h].reshape(t, h)
    assert (out.data.ptr % 16 != 0) == misaligned
    cu.varlen_attention(out, qkv, bias, ints(cu, cu_seqlens), heads=heads, max_seqlen=max(lengths))
    expected = np.empty((t, h), np.float32)
    ref.varlen_attention(expected, qkvh, biash, cu_seqlens, heads=heads, max_seqlen=max(lengths))
    assert not expected[sum(lengths):].any()
    assert_close(cu, out, expected, dtype)


def test_varlen_attention_routes_head_dims_64_and_32_to_wgmma_on_sm90(cu, rng, monkeypatch):
    """On sm_90 the plain fp16/bf16 attention at head dims 64 and 32 runs a wgmma kernel: at head dim
    64 the TMA one where the longest sequence passes two key tiles (VARLEN_WG_TMA_MIN_SEQ); head dim
    128, windows, relative biases and fp32 keep the mma.sync / SIMT kernels."""
    if not cu.context().wgmma:
        pytest.skip("the wgmma kernel runs on compute capability 9.0 only")
    launches = []
    launch = attention._launch
    monkeypatch.setattr(attention, "_launch", lambda file, name, *a, **k: launches.append(name) or launch(file, name, *a, **k))
    longest = attention.VARLEN_WG_TMA_MIN_SEQ
    for dtype, d, window, max_seqlen in [("fp16", 64, 0, 70), ("bf16", 64, 0, 64), ("fp16", 32, 0, 70),
                                         ("bf16", 32, 0, 70), ("fp16", 128, 0, 70), ("fp16", 64, 8, 70),
                                         ("fp32", 64, 0, 70), ("fp16", 64, 0, longest), ("bf16", 64, 0, 512),
                                         ("fp16", 64, 0, longest - 1), ("fp16", 32, 0, 512), ("fp16", 64, 8, 512)]:
        cu_seqlens = ints(cu, [0, max_seqlen, max_seqlen + 5])
        qkv, _ = quantize(cu, rng.standard_normal((max_seqlen + 5, 3 * 2 * d)), dtype)
        bias, _ = quantize(cu, rng.standard_normal(3 * 2 * d), dtype)
        out = poisoned(cu, (max_seqlen + 5, 2 * d), dtype)
        cu.varlen_attention(out, qkv, bias, cu_seqlens, heads=2, max_seqlen=max_seqlen, window=window)
    assert launches[:4] == ["varlen_attention_wgmma<__half, 64>", "varlen_attention_wgmma<__nv_bfloat16, 64>",
                            "varlen_attention_wgmma<__half, 32>", "varlen_attention_wgmma<__nv_bfloat16, 32>"]
    assert launches[4].startswith("varlen_attention_mma<__half, 128, false,")
    assert launches[5].startswith("varlen_attention_mma<__half, 64, true,")
    assert launches[6:11] == ["varlen_attention_simt<64>", "varlen_attention_wgmma_tma<__half>",
                              "varlen_attention_wgmma_tma<__nv_bfloat16>", "varlen_attention_wgmma<__half, 64>",
                              "varlen_attention_wgmma<__half, 32>"]
    assert launches[11].startswith("varlen_attention_mma<__half, 64, true,")


def test_varlen_attention_takes_the_short_tiles_for_short_plain_16_bit_batches(cu, rng, monkeypatch):
    """Plain fp16/bf16 attention at head dims 32 and 64 whose longest sequence is at most
    VARLEN_SHORT_SEQ tokens (causal too) runs the short tiles, on every GPU; a longer one, head dim
    128, a window, a relative bias or fp32 does not."""
    launches = []
    launch = attention._launch
    monkeypatch.setattr(attention, "_launch", lambda file, name, *a, **k: launches.append(name) or launch(file, name, *a, **k))
    short = attention.VARLEN_SHORT_SEQ
    cases = [("fp16", 32, 0, False, False, short, True), ("bf16", 64, 0, False, True, 17, True),
             ("fp16", 64, 0, False, False, 1, True), ("fp16", 64, 0, False, False, short + 1, False),
             ("fp16", 128, 0, False, False, 16, False), ("fp16", 64, 8, False, False, 16, False),
             ("fp16", 32, 0, True, False, 16, False), ("fp32", 32, 0, False, False, 16, False)]
    for dtype, d, window, biased, causal, max_seqlen, _ in cases:
        cu_seqlens = ints(cu, [0, max_seqlen, max_seqlen + 1])
        qkv, _ = quantize(cu, rng.standard_normal((max_seqlen + 1, 3 * 2 * d)), dtype)
        bias, _ = quantize(cu, rng.standard_normal(3 * 2 * d), dtype)
        out = poisoned(cu, (max_seqlen + 1, 2 * d), dtype)
        rel_bias = (cu.to_device(np.zeros((3, 2), np.float32)), ints(cu, [0] * 64), 32) if biased else None
        cu.varlen_attention(out, qkv, bias, cu_seqlens, heads=2, max_seqlen=max_seqlen, causal=causal, window=window,
                            rel_bias=rel_bias)
    assert len(launches) == len(cases)
    for (dtype, d, *_, expected), name in zip(cases, launches):
        ctype = {"fp16": "__half", "bf16": "__nv_bfloat16", "fp32": "float"}[dtype]
        assert (name == attention.varlen_mma_name(ctype, d, False, "short")) == expected, (dtype, d, name)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_the_short_tiles_give_the_bits_of_the_kernel_they_replace(cu, rng, monkeypatch, dtype, d, causal):
    """A sequence of at most VARLEN_SHORT_SEQ tokens gets the same bits from the short tiles as from
    the kernel a batch with a longer sequence runs (wgmma on sm_90, else the narrow tiles): its
    result does not depend on its batch mates' lengths."""
    lengths = rng.integers(1, attention.VARLEN_SHORT_SEQ + 1, 40).tolist() + [attention.VARLEN_SHORT_SEQ]
    heads, t = 3, sum(lengths) + 3
    cu_seqlens = ints(cu, _offsets(lengths))
    qkv, _ = quantize(cu, rng.standard_normal((t, 3 * heads * d)), dtype)
    bias, _ = quantize(cu, 0.5 * rng.standard_normal(3 * heads * d), dtype)
    outputs = []
    for short in (attention.VARLEN_SHORT_SEQ, 0):
        monkeypatch.setattr(attention, "VARLEN_SHORT_SEQ", short)
        out = poisoned(cu, (t, heads * d), dtype)
        cu.varlen_attention(out, qkv, bias, cu_seqlens, heads=heads, max_seqlen=max(lengths), causal=causal)
        outputs.append(cu.to_host(out))
    np.testing.assert_array_equal(*outputs)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[40, 300, 70, 129, 1], [20, 31, 7, 32, 1]])
def test_varlen_attention_keeps_each_sequence_to_itself(cu, rng, dtype, d, causal, lengths, attention_path):
    """Infinite keys and values in one sequence (an overflowed activation) reach no other: the TMA
    kernel copies whole key tiles, rows of the next sequence among them, and must give them no
    weight and zero their values; the other sequences' rows equal the reference's, all finite. The
    second batch's sequences are short (the short tiles)."""
    heads = 2
    h, t = heads * d, sum(lengths)
    cu_seqlens = _offsets(lengths)
    first, stop = lengths[0], lengths[0] + lengths[1]
    clean = rng.standard_normal((t, 3 * h))
    bad = clean.copy()
    bad[first:stop, h:] = np.inf   # sequence 1's keys and values
    bad[stop - 1, 2 * h:] = np.nan
    qkv, _ = quantize(cu, bad, dtype)
    _, qkvh = quantize(cu, clean, dtype)
    bias, biash = quantize(cu, 0.5 * rng.standard_normal(3 * h), dtype)
    out = poisoned(cu, (t, h), dtype)
    cu.varlen_attention(out, qkv, bias, ints(cu, cu_seqlens), heads=heads, max_seqlen=max(lengths), causal=causal)
    expected = np.empty((t, h), np.float32)
    ref.varlen_attention(expected, qkvh, biash, cu_seqlens, heads=heads, max_seqlen=max(lengths), causal=causal)
    others = np.r_[0:first, stop:t]
    assert_close_host(cu.to_host(out).astype(np.float32)[others], expected[others], dtype)


def test_prepare_kernels_compiles_the_wgmma_attention_for_its_head_dims_only(cu, monkeypatch):
    """A runner's warm-up compiles attention_sm90.cu where the GPU runs it, for fp16/bf16 models of
    head dims 64 and 32 only (the ones it takes: a model of another head dim never launches it),
    whose attention is plain (windows and a relative bias take the fused attention's general variant)."""
    if not cu.context().wgmma:
        pytest.skip("the wgmma kernel runs on compute capability 9.0 only")
    compiled = []
    monkeypatch.setattr(families, "prepare", lambda files, types, only: compiled.append(tuple(files)))
    for dtype, head_dim in [("fp16", 64), ("bf16", 64), ("fp16", 32), ("bf16", 128), ("fp32", 64)]:
        cu.prepare_kernels(("attention_varlen.cu",), dtype, head_dims=(head_dim,))
    cu.prepare_kernels(("attention_varlen.cu",), "fp16", head_dims=(64,), general=(True,))  # never takes it
    assert compiled == [("attention_varlen.cu", "attention_sm90.cu", "convert.cu", "prefetch.cu")] * 3 + \
        [("attention_varlen.cu", "convert.cu", "prefetch.cu")] * 3


def test_prepare_kernels_compiles_the_attention_its_runner_launches_only(cu, monkeypatch):
    """Of the fused attention, a runner's warm-up compiles the kernels of its head dims (a seq2seq
    model's encoder and decoder may differ) and variants (plain; general: windows, relative bias),
    on sm_90 the wgmma kernel in place of the plain variant at the head dims it takes; any other
    compiles at its first launch."""
    asked = []
    monkeypatch.setattr(families, "prepare", lambda files, types, only: asked.append(only))
    cu.prepare_kernels(("attention_varlen.cu",), "fp16", head_dims=(32, 128))
    cu.prepare_kernels(("attention_varlen.cu",), "fp16", head_dims=(64,), general=(True,))
    cu.prepare_kernels(("attention_varlen.cu",), "fp16", head_dims=(64,), general=(False, True))
    plain, general, both = asked
    wg = cu.context().wgmma
    mma = lambda d, g: {attention.varlen_mma_name("__half", d, g, t) for t in (("narrow", "wide") if d <= 64 else ("narrow",))}  # noqa: E731
    short = lambda d: {attention.varlen_mma_name("__half", d, False, "short")}  # noqa: E731
    assert plain["attention_varlen.cu"] == mma(128, False) | short(32) | (set() if wg else mma(32, False))
    assert plain["attention_sm90.cu"] == ({"varlen_attention_wgmma<__half, 32>"} if wg else set())
    assert general["attention_varlen.cu"] == mma(64, True) and not general["attention_sm90.cu"]
    assert both["attention_varlen.cu"] == mma(64, True) | short(64) | (set() if wg else mma(64, False))
    assert both["attention_sm90.cu"] == ({"varlen_attention_wgmma<__half, 64>", "varlen_attention_wgmma_tma<__half>"}
                                         if wg else set())


def test_prepare_kernels_compiles_the_wgmma_product_for_the_erf_form_only(cu, monkeypatch):
    """gemm_sm90.cu is compiled for fp16/bf16 runners whose matmul_bias_gelu takes the erf form (the
    only form it serves) or that call matmul_bias_residual_layernorm (ln_product), not for the tanh
    form (GPT-2), a runner without those calls, or fp32."""
    if not cu.context().wgmma:
        pytest.skip("the wgmma product runs on compute capability 9.0 only")
    compiled = []
    monkeypatch.setattr(families, "prepare", lambda files, types, only: compiled.append(tuple(files)))
    for dtype, form, ln in [("fp16", "erf", False), ("bf16", "erf", False), ("fp16", "tanh", True), ("bf16", None, True),
                            ("fp16", "tanh", False), ("bf16", None, False), ("fp32", "erf", True)]:
        cu.prepare_kernels(("activation.cu",), dtype, head_dims=(64,), gelu_product=form, ln_product=ln)
    assert compiled == [("activation.cu", "gemm_sm90.cu", "convert.cu", "prefetch.cu")] * 4 + \
        [("activation.cu", "convert.cu", "prefetch.cu")] * 3


CACHED_MODULE_RUN = """
import hashlib
import numpy as np
from ftengine.backends.cuda import kernels, ops
compiles = []
compile_ = kernels.CachedModule._compile
kernels.CachedModule._compile = staticmethod(lambda *a: compiles.append(a[-1][-1]) or compile_(*a))
rng = np.random.default_rng(0)
qkv = ops.to_device(rng.standard_normal((150, 3 * 128)).astype(np.float32), np.float16)
bias = ops.to_device(rng.standard_normal(3 * 128).astype(np.float32), np.float16)
out = ops.empty((150, 128), np.float16)
ops.varlen_attention(out, qkv, bias, ops.to_device(np.array([0, 100, 150], np.int32)), heads=2, max_seqlen=100)
print(",".join(sorted(compiles)), hashlib.sha256(ops.to_host(out).tobytes()).hexdigest())
"""


def test_modules_are_compiled_once_then_loaded_from_the_cache(cu, tmp_path):
    """The modules a run uses (the conversion's, and the attention's: on sm_90 the wgmma one, for
    the arch-specific target sm_90a) are compiled by the first process and written to the kernel
    cache; the next process loads them from there, compiles nothing, and computes the same output
    bit for bit."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "CUPY_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
    runs = [subprocess.run([sys.executable, "-c", CACHED_MODULE_RUN], env=env, capture_output=True, text=True,
                           timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    (first_compiles, first), (second_compiles, second) = (r.stdout.split(" ") for r in runs)
    sm = f"--gpu-architecture=sm_{cu.context().cupy.cuda.Device().compute_capability}"
    arch = ["--gpu-architecture=sm_90a"] if cu.context().wgmma else []
    assert sorted(set(first_compiles.split(","))) == sorted([sm, *arch]) and second_compiles == "" and first == second
    cubins = {p.name.split("_")[1] + "_" + p.name.split("_")[2] for p in tmp_path.glob("ftengine_*.cubin")}
    assert cubins == {a.split("=")[1] for a in [sm, *arch]}
    assert len(list(tmp_path.glob("ftengine_*.json"))) == len(list(tmp_path.glob("ftengine_*.cubin"))) >= 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths, h", [([1], 384), ([3, 17, 1, 40], 768), ([9] * 64, 200)])
@pytest.mark.parametrize("skip", [0, 3])
@pytest.mark.parametrize("warps", POOL_WARPS)
def test_pool_packed(cu, rng, monkeypatch, dtype, lengths, h, skip, warps):
    monkeypatch.setattr(pooling, "_pool_warps", lambda blocks: warps)
    modes = ("cls", "max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken")
    lengths = list(lengths) + [0, 0]  # two empty sequences: batch padding
    t = sum(lengths) + 3
    cu_seqlens = _offsets(lengths)
    hidden, hh = quantize(cu, rng.standard_normal((t, h)), dtype)
    out = poisoned(cu, (len(lengths), len(modes) * h), "fp32")
    cu.pool_packed(out, hidden, ints(cu, cu_seqlens), modes=modes, skip=skip)
    expected = np.empty((len(lengths), len(modes) * h), np.float32)
    ref.pool_packed(expected, hh, cu_seqlens, modes=modes, skip=skip)
    assert_close(cu, out, expected, "fp32")


# ModernBERT's local layers (window) and MPNet's relative bias inside the fused kernel, lengths 1..4096
WINDOWED = [([1, 63, 64, 65, 200], 16), ([4096, 130, 1], 64), ([1000, 2047], 200), ([300, 5], 1),
            ([600] * 39 + [257], 48), ([1100] * 15 + [1030], 40)]  # the last: the wide tiles (head dim <= 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("lengths, window", WINDOWED)
@pytest.mark.parametrize("relative", [False, True])
def test_varlen_attention_window_and_relative_bias(cu, rng, dtype, d, lengths, window, relative):
    from ftengine.models.bert import relative_position_buckets
    heads = 2
    h = heads * d
    t = sum(lengths) + 3
    cu_seqlens = _offsets(lengths)
    qkv, qkvh = quantize(cu, rng.standard_normal((t, 3 * h)), dtype)
    bias, biash = quantize(cu, 0.5 * rng.standard_normal(3 * h), dtype)
    rel_dev = rel_host = None
    if relative:
        max_len = max(lengths) + 7
        table = 2 * rng.standard_normal((32, heads)).astype(np.float32)
        buckets = relative_position_buckets(max_len, 32)
        rel_dev = (cu.to_device(table), ints(cu, buckets), max_len)
        rel_host = (table, buckets, max_len)
        window = 0 if window == 1 else window  # also the bias alone
    out = poisoned(cu, (t, h), dtype)
    cu.varlen_attention(out, qkv, bias, ints(cu, cu_seqlens), heads=heads, max_seqlen=max(lengths), window=window,
                        rel_bias=rel_dev)
    expected = np.empty((t, h), np.float32)
    ref.varlen_attention(expected, qkvh, biash, cu_seqlens, heads=heads, max_seqlen=max(lengths), window=window,
                         rel_bias=rel_host)
    assert_close(cu, out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq, window", [(40, 3), (300, 64), (1100, 16)])
def test_masked_softmax_window(cu, rng, dtype, seq, window):
    heads, lengths = 2, np.array([seq, seq // 2 + 1, 1])
    scores, sh = quantize(cu, 4 * rng.standard_normal((3 * heads, seq, seq)), dtype)
    out = poisoned(cu, scores.shape, dtype)
    cu.masked_softmax(out, scores, ints(cu, lengths), heads=heads, window=window)
    expected = np.empty(sh.shape, np.float32)
    ref.masked_softmax(expected, sh, lengths, heads=heads, window=window)
    assert_close(cu, out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, d", [(12, 64), (4, 32), (2, 128), (3, 16)])
def test_rotary_qkv(cu, rng, dtype, heads, d):
    from ftengine.models.bert import rotary_tables
    t, h = 37, heads * d
    positions = rng.integers(0, 4096, t)
    cos, sin = rotary_tables(4096, d, 160000.0)
    x, xh = quantize(cu, rng.standard_normal((t, 3 * h)), dtype)
    bias, biash = quantize(cu, rng.standard_normal(3 * h), dtype)
    cu.rotary_qkv(x, bias, ints(cu, positions), cu.to_device(cos), cu.to_device(sin), heads=heads)
    ref.rotary_qkv(xh, biash, positions, cos, sin, heads=heads)
    assert_close(cu, x, xh, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["erf", "tanh"])
@pytest.mark.parametrize("inter", [1152, 2560, 37])
def test_gated_gelu(cu, rng, dtype, form, inter):
    x, xh = quantize(cu, 3 * rng.standard_normal((29, 2 * inter)), dtype)
    bias, biash = quantize(cu, rng.standard_normal(2 * inter), dtype)
    out = poisoned(cu, (29, inter), dtype)
    cu.gated_gelu(out, x, bias, form=form)
    expected = np.empty((29, inter), np.float32)
    ref.gated_gelu(expected, xh, biash, form=form)
    assert_close(cu, out, expected, dtype)


@pytest.mark.parametrize("activation", ["identity", "tanh", "relu", "gelu"])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("m, k, n", [(1, 768, 768), (37, 384, 3), (64, 200, 1000)])
def test_dense_head_layer(cu, rng, activation, norm, m, k, n):
    x, w, b = (rng.standard_normal(s) for s in ((m, k), (n, k), (n,)))
    w = w / np.sqrt(k)
    gamma, beta = 1 + 0.2 * rng.standard_normal(n), rng.standard_normal(n)
    x, w, b, gamma, beta = (a.astype(np.float32) for a in (x, w, b, gamma, beta))
    out = poisoned(cu, (m, n), "fp32")
    up = cu.to_device
    cu.dense(out, up(x), up(w), up(b), activation=activation, norm=(up(gamma), up(beta), 1e-5) if norm else ())
    expected = np.empty((m, n), np.float32)
    ref.dense(expected, x, w, b, activation=activation, norm=(gamma, beta, 1e-5) if norm else ())
    assert_close(cu, out, expected, "fp32")


def test_a_graph_of_dependent_kernels_gives_numpys_values(cu, rng):
    """Kernels captured into a graph launch as programmatic dependent launches on sm_90+, through
    launch_ex's own argument passing: a chain of 300 kernels, each adding to what the one
    before wrote, replayed from a graph equals NumPy's sums exactly (small integers: every sum is
    exact in float32), as do the same launches made directly. (That every kernel waits for the
    one before it is checked in its source: test_kernels_compile.py.)"""
    xh = rng.integers(-4, 5, (4, 768)).astype(np.float32)
    biash = rng.integers(-2, 3, 768).astype(np.float32)
    x, bias = cu.to_device(xh), cu.to_device(biash)
    expected = np.zeros((4, 768), np.float32)
    for _ in range(300):
        ref.add_bias_residual(expected, xh, biash, expected)
    stream = cu.context().stream
    graphed, direct = (cu.to_device(np.zeros((4, 768), np.float32)) for _ in range(2))
    stream.begin_capture()
    for _ in range(300):
        cu.add_bias_residual(graphed, x, bias, graphed)
    stream.end_capture().launch(stream=stream)
    for _ in range(300):
        cu.add_bias_residual(direct, x, bias, direct)
    for out in (graphed, direct):
        np.testing.assert_array_equal(cu.to_host(out), expected)


def test_host_copies_both_ways(cu):
    """copy_from_host: a matching array (one cudaMemcpyAsync), a strided or other-dtype source
    (converted first), a wrong shape refused; copy_to_host_async through a reused HostSlot, its
    buffer growing, each copy's values its own."""
    rng = np.random.default_rng(3)
    dst = poisoned(cu, (37, 5), "fp32")
    src = rng.standard_normal((37, 5)).astype(np.float32)
    cu.copy_from_host(dst, src)
    np.testing.assert_array_equal(cu.to_host(dst), src)
    wide = rng.standard_normal((37, 10))
    cu.copy_from_host(dst, wide[:, ::2])  # float64, not contiguous
    np.testing.assert_array_equal(cu.to_host(dst), wide[:, ::2].astype(np.float32))
    ids = cu.empty((100,), np.int32)
    cu.copy_from_host(ids, list(range(100)))
    np.testing.assert_array_equal(cu.to_host(ids), np.arange(100))
    with pytest.raises(ValueError):
        cu.copy_from_host(dst, src[:36])
    slot = cu.HostSlot()
    for shape in ((3, 4), (50, 20), (2, 2), (50, 20)):
        values = rng.standard_normal(shape).astype(np.float32)
        pending = cu.copy_to_host_async(cu.to_device(values), slot)
        got = pending.wait()
        np.testing.assert_array_equal(got, values)
        cu.copy_to_host_async(cu.to_device(np.zeros(shape, np.float32)), slot).wait()
        np.testing.assert_array_equal(got, values)  # wait() gave a copy, not the slot's buffer


@pytest.mark.parametrize("storage", [np.float16, np.uint16, np.float32])
@pytest.mark.parametrize("staging", [None, 1000])
def test_to_device_converts_and_lays_out_weights_as_the_host_does(cu, rng, monkeypatch, storage, staging):
    """float32 to a 16-bit type, and transposed views (GPT-2's Conv1D weights), go through the
    device's conversion (convert.cu): the same bits as NumPy's float16 cast and the host's bf16
    words (rounding to nearest even, overflow to infinity, subnormals), in one piece and in
    staging pieces of `staging` elements with a ragged last one."""
    from ftengine.backends.cuda import runtime
    if staging:
        monkeypatch.setattr(runtime, "STAGING_ELEMENTS", staging)
    a = (rng.standard_normal((301, 77)) * np.exp(rng.uniform(-30, 30, (301, 77)))).astype(np.float32)
    a.flat[:12] = [np.inf, -np.inf, 0.0, -0.0, 65504.0, 65520.0, 1e-8, -3e-7, 3.4e38, -3.4e38, 1.5e-45, 2.0 ** -24]
    for host in (a, a.T, a[::2]):  # contiguous, a transposed view, neither (the host's path)
        want = np.ascontiguousarray(host)
        with np.errstate(over="ignore"):
            want = runtime._bf16_words(want) if storage == np.uint16 else want.astype(storage)
        got = cu.to_device(host, storage)
        assert got.dtype == storage and got.shape == want.shape and got.flags.c_contiguous
        np.testing.assert_array_equal(got.get(stream=cu.context().stream).view(np.uint8), want.view(np.uint8))
