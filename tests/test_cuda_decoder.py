"""GPU: the CUDA decoder ops against their NumPy twins, and GPT-2 generation against HF on the
same GPU and against the NumPy backend."""

import numpy as np
import pytest

from ftengine.backends import numpy_ops as ref
from ftengine.backends.cuda import runtime, sampling
from ftengine.backends.cuda.gemm import GEMV_COLS, GEMV_WIDE_BLOCKS_PER_SM, NORM_BLOCKS_PER_SM, NORM_ITEMS
from ftengine.checkpoint import load_gpt2_weights
from ftengine.config import load_gpt2_config
from ftengine.decoding.beam import beam_search
from ftengine.decoding.generate import GenerationParams, stream_tokens
from ftengine.errors import DeviceError
from ftengine.models.gpt2 import GPT2Runner
from tests.test_cuda_ops import DTYPES, assert_close, assert_close_host, ints, poisoned, quantize
from tests.tolerances import GPU_FP32_REL
from weights.fixtures import write_gpt2_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cu():
    from ftengine.backends.cuda import ops
    return ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e", [768, 1024, 200])
def test_embed_layernorm_residual_gather(cu, rng, dtype, e):
    t, v, p = 37, 300, 64
    ids, pos = rng.integers(0, v, t), rng.integers(0, p, t)
    (wte, wteh), (wpe, wpeh) = quantize(cu, rng.standard_normal((v, e)), dtype), quantize(cu, rng.standard_normal((p, e)), dtype)
    out, expected = poisoned(cu, (t, e), dtype), np.empty((t, e), np.float32)
    cu.embed_positions(out, ints(cu, ids), ints(cu, pos), wte, wpe)
    ref.embed_positions(expected, ids, pos, wteh, wpeh)
    assert_close(cu, out, expected, dtype)
    unplaced = int(ids[3])  # M2M100's pad: no position
    cu.embed_positions(out, ints(cu, ids), ints(cu, pos), wte, wpe, unplaced=unplaced)
    ref.embed_positions(expected, ids, pos, wteh, wpeh, unplaced=unplaced)
    assert_close(cu, out, expected, dtype)
    np.testing.assert_array_equal(expected[ids == unplaced], wteh[ids[ids == unplaced]])
    (x, xh), (g, gh), (b, bh), (r, rh) = (quantize(cu, rng.standard_normal(s), dtype) for s in ((t, e), (e,), (e,), (t, e)))
    cu.layernorm(x, x, g, b, eps=1e-5)  # in place, as the final LayerNorm runs
    ref.layernorm(expected, xh, gh, bh, eps=1e-5)
    assert_close(cu, x, expected, dtype)
    x, xh = quantize(cu, rng.standard_normal((t, e)), dtype)
    cu.add_bias_residual(r, x, b, r)
    ref.add_bias_residual(expected, xh, bh, rh)
    assert_close(cu, r, expected, dtype)
    rows = np.array([5, 0, 36, 5])
    gathered = poisoned(cu, (4, e), dtype)
    cu.gather_rows(gathered, x, ints(cu, rows))
    assert_close(cu, gathered, xh[rows], dtype)
    (x, xh), (h, hh) = (quantize(cu, rng.standard_normal((t, e)), dtype) for _ in range(2))
    bias, biash = quantize(cu, rng.standard_normal(e), dtype)
    normed, expected_normed = poisoned(cu, (t, e), dtype), np.empty((t, e), np.float32)
    cu.residual_layernorm(h, normed, x, bias, g, b, eps=1e-5)
    ref.residual_layernorm(hh, expected_normed, xh, biash, gh, bh, eps=1e-5)
    assert_close(cu, h, hh, dtype)
    assert_close(cu, normed, expected_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e", [768, 200])
def test_rms_layernorm_and_residual(cu, rng, dtype, e):
    """T5's RMS norm (rms=True) in layernorm and residual_layernorm against the NumPy twin."""
    t = 37
    (x, xh), (h, hh) = (quantize(cu, rng.standard_normal((t, e)) + 0.5, dtype) for _ in range(2))
    (g, gh), (bias, biash) = (quantize(cu, rng.standard_normal(e), dtype) for _ in range(2))
    zeros, zerosh = quantize(cu, np.zeros(e), dtype)
    out, expected = poisoned(cu, (t, e), dtype), np.empty((t, e), np.float32)
    cu.layernorm(out, x, g, zeros, eps=1e-6, rms=True)
    ref.layernorm(expected, xh, gh, zerosh, eps=1e-6, rms=True)
    assert_close(cu, out, expected, dtype)
    normed, expected_normed = poisoned(cu, (t, e), dtype), np.empty((t, e), np.float32)
    cu.residual_layernorm(h, normed, x, bias, g, zeros, eps=1e-6, rms=True)
    ref.residual_layernorm(hh, expected_normed, xh, biash, gh, zerosh, eps=1e-6, rms=True)
    assert_close(cu, h, hh, dtype)
    assert_close(cu, normed, expected_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n, skinny, blas", [
    (8, 768, 768, 2, 1), (13, 3072, 768, 8, 4), (32, 800, 200, 2, 1), (20, 96, 1000, 2, 1), (9, 1536, 64, 4, 1),
    (7, 768, 768, 1, 1), (33, 768, 768, 1, 1), (16, 256, 100, 1, 1), (300, 3072, 768, 1, 2), (6, 2064, 96, 1, 2),
    (5, 2056, 40, 1, 1), (1100, 2048, 768, 1, 1), (7, 3072, 768, 1, 4)])
def test_matmul_residual_layernorm(cu, rng, dtype, m, k, n, skinny, blas):
    """A product read by residual + LayerNorm: with K split into slices (16-bit operands; partial
    sums from gemv.cu where split_k gives `skinny` > 1, else from cuBLAS's strided batch where
    blas_split_k gives `blas` > 1, added up by residual_layernorm) or (slices of K not whole
    16-byte vectors, too many outputs, fewer or more rows than a split takes, N not a multiple of
    8, float32) matmul then residual_layernorm; against the NumPy twin fed the product as the
    storage type holds it."""
    skinny, blas = (1, 1) if dtype == "fp32" else (skinny, blas)
    storage = cu.storage_dtype(dtype)
    assert (cu.split_k(m, n, k, storage), cu.blas_split_k(m, n, k, storage)) == (skinny, blas)
    splits = max(skinny, blas)
    # operands on a grid of 1/4 in [-2, 2]: every sum of their products is exact in float32, so the
    # product as stored is the exact one rounded, whatever the order or the slices of its sums
    (x, xh), (w, wh) = (quantize(cu, rng.integers(-8, 9, s) / 4, dtype) for s in ((m, k), (n, k)))
    (h, hh), (bias, biash), (g, gh), (b, bh) = (quantize(cu, rng.standard_normal(s), dtype)
                                                for s in ((m, n), (n,), (n,), (n,)))
    product, partials = poisoned(cu, (m, n), dtype), cu.empty((max(1, cu.partials_size(m, n)),), np.float32)
    normed, expected_normed = poisoned(cu, (m, n), dtype), np.empty((m, n), np.float32)
    cu.matmul_residual_layernorm(h, normed, x, w, bias, g, b, eps=1e-5, product=product, partials=partials)
    stored = quantize(cu, xh.astype(np.float64) @ wh.T.astype(np.float64), dtype)[1]
    ref.residual_layernorm(hh, expected_normed, stored, biash, gh, bh, eps=1e-5)
    assert_close(cu, h, hh, dtype)
    assert_close(cu, normed, expected_normed, dtype)
    if splits > 1:
        with pytest.raises(DeviceError, match=r"partials holds 7 float32 values; a split product"):
            cu.matmul_residual_layernorm(h, normed, x, w, bias, g, b, eps=1e-5, product=product, partials=partials[:7])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n, slices, post, rms, act", [
    (4, 512, 2048, 1, False, False, None), (4, 1024, 2048, 1, False, False, None),
    (4, 512, 6000, 1, False, False, None), (1, 512, 2048, 4, True, False, "relu"),
    (3, 384, 1000, 2, False, True, "gelu"), (2, 200, 300, 1, True, False, "identity"),
    (4, 2048, 64, 2, False, False, "silu"), (5, 256, 512, 1, False, False, None)])
def test_norm_matmul(cu, rng, dtype, m, k, n, slices, post, rms, act):
    """A residual + LayerNorm that a product left pending, run with the product after it (norm_matmul):
    up to NORM_PROLOGUE_ROWS rows in that product's kernel (gemv_norm.cu: the stream moves to
    hidden_out), pre- and post-LayerNorm, RMS, each epilogue, a product as stored or as float partial
    sums of K slices; else (5 rows, fp32 rows past NORM_ITEMS' vectors, more than one group of columns
    a block) as a LayerNorm kernel in place, then the product. Against the NumPy twin fed the product,
    and the product's x, as the kernels read them (rounded to the storage type)."""
    slices = 1 if dtype == "fp32" else slices
    sms = cu.context().sm_count
    cols = GEMV_COLS[1] if n >= GEMV_COLS[1] * GEMV_WIDE_BLOCKS_PER_SM * sms else GEMV_COLS[0]
    fused = (m <= cu.NORM_PROLOGUE_ROWS and k <= 32 * NORM_ITEMS[-1] * (4 if dtype == "fp32" else 8)
             and -(-n // cols) <= NORM_BLOCKS_PER_SM * sms)
    (h, hh), (rb, rbh), (g, gh), (b, bh), (bias, biash) = (quantize(cu, rng.standard_normal(s), dtype)
                                                           for s in ((m, k), (k,), (k,), (k,), (n,)))
    if rms:
        b, bh = quantize(cu, np.zeros(k), dtype)
    w, wh = quantize(cu, rng.standard_normal((n, k)) / 16, dtype)
    if slices == 1:
        parts, stored = quantize(cu, rng.standard_normal((m, k)), dtype)
    else:  # the kernels add the slices in order, then round the sum to the storage type
        split = rng.standard_normal((slices, m, k)).astype(np.float32)
        parts, summed = cu.to_device(split, np.float32), split[0].copy()
        for s in split[1:]:
            summed += s
        stored = quantize(cu, summed, dtype)[1]
    out, spare, normed = poisoned(cu, (m, n), dtype), poisoned(cu, (m, k), dtype), poisoned(cu, (m, k), dtype)
    expected, expected_hidden, expected_normed = (np.empty(s, np.float32) for s in ((m, n), (m, k), (m, k)))
    options = dict(act=act, eps=1e-5, rms=rms, post=post)
    held = cu.norm_matmul(out, w, bias, parts=parts, res_bias=rb, hidden=h, hidden_out=spare, normed=normed, gamma=g,
                          beta=b, **options)
    ref.norm_matmul(expected, wh, biash, parts=stored, res_bias=rbh, hidden=hh, hidden_out=expected_hidden,
                    normed=expected_normed, gamma=gh, beta=bh, **options)
    assert held is (spare if fused else h)
    assert_close(cu, held, expected_hidden, dtype)
    x = quantize(cu, expected_hidden, dtype)[1]
    if not post:  # the LayerNorm of the sum as stored
        ref.layernorm(expected_normed, x, gh, bh, eps=1e-5, rms=rms)
        x = quantize(cu, expected_normed, dtype)[1]
    ref.matmul_act(expected, x, wh, biash, act=act)
    assert_close(cu, out, expected, dtype)


def test_prefetch_l2_runs_on_a_joined_branch_of_the_graph(cu, rng):
    """prefetch_l2 inside a GraphCache capture forks branches (sm_90+: one launch per four arrays)
    that the capture joins (the graph is built and replays, results unchanged), for passes of
    PREFETCH_ROWS rows only (1 row: none) and arrays that come to PREFETCH_L2_SHARE of the L2 at
    most (more: none of them); outside a capture it launches nothing; an array not 16-byte aligned
    is refused."""
    x, xh = quantize(cu, rng.standard_normal((4, 256)), "fp16")
    w, wh = quantize(cu, rng.standard_normal((300, 256)) / 16, "fp16")
    big = cu.empty((int(runtime.PREFETCH_L2_SHARE * cu.context().l2_bytes) + 16,), np.uint8)
    out = poisoned(cu, (4, 300), "fp16")
    graphs = cu.GraphCache()
    calls = [([w, x], 1), ([w, x], 4), ([w] * 5, 4), ([big, w], 4), ([w, x, big, w], 4)]
    forked = []  # branches each prefetch_l2 call added, per call

    def launches():
        for arrays, rows in calls:
            before = len(cu.context().branch_ends)
            cu.prefetch_l2(arrays, rows=rows)
            forked.append(len(cu.context().branch_ends) - before)
        cu.matmul(out, x, w)
    for _ in range(2):
        graphs.run("product", launches)
        assert_close(cu, out, xh @ wh.T, "fp16")
    d = int(cu.context().dependent_launch)
    assert cu.context().l2_bytes > 0 and forked[-5:] == [0, d, 2 * d, 0, 0]  # the captured calls'
    assert cu.context().branch_ends == []
    cu.prefetch_l2([w, x], rows=4)
    assert cu.context().branch_ends == []
    with pytest.raises(DeviceError, match="array 1 does not start on a 16-byte boundary"):
        cu.prefetch_l2([w, x.ravel()[1:]], rows=4)


def test_prefetch_kv_runs_on_a_joined_branch_of_the_graph(cu, rng):
    """prefetch_kv inside a GraphCache capture forks a branch (sm_90+) that the capture joins, for
    steps of KV_PREFETCH_ROWS rows only, and not for cache rows of D not whole 16-byte units; the
    decode attention after it equals the reference over the caches as stored; outside a capture it
    launches nothing."""
    heads, d, length, rows = 3, 32, 64, 4
    big = max(runtime.KV_PREFETCH_ROWS) + 1
    shape = (big, heads, length, d)
    (k, k_ref), (v, v_ref) = (quantize(cu, rng.standard_normal(shape), "fp16") for _ in range(2))
    odd = cu.empty((big, heads, length, 3), np.float16)
    pos = np.array([0, 7, 63, 30] + [5] * (big - rows))
    d_pos = ints(cu, pos)
    qkv, qkvh = quantize(cu, rng.standard_normal((rows, 3 * heads * d)), "fp16")
    bias, biash = quantize(cu, 0.3 * rng.standard_normal(3 * heads * d), "fp16")
    out = poisoned(cu, (rows, heads * d), "fp16")
    graphs = cu.GraphCache()
    forked = []  # branches each prefetch_kv call added

    def launches():
        for caches, n in (((k, v), rows), ((k, v), big), ((odd, odd), rows)):
            before = len(cu.context().branch_ends)
            cu.prefetch_kv(*caches, d_pos[:n])
            forked.append(len(cu.context().branch_ends) - before)
        cu.decode_attention(out, qkv, bias, k, v, d_pos[:rows], heads=heads)
    graphs.run("step", launches)
    assert forked[-3:] == [int(cu.context().dependent_launch), 0, 0]  # the captured calls'
    assert cu.context().branch_ends == []
    stored_k, stored_v = cu.to_host(k).astype(np.float32), cu.to_host(v).astype(np.float32)
    expected = np.empty((rows, heads * d), np.float32)
    ref.cached_attention(expected, qkvh, biash, stored_k, stored_v, np.arange(rows), pos[:rows], heads=heads)
    assert_close(cu, out, expected, "fp16")
    cu.prefetch_kv(k, v, d_pos[:rows])
    assert cu.context().branch_ends == []


def test_write_kv_cache_beside_runs_on_a_branch_joined_by_join_beside(cu, rng):
    """write_kv_cache(beside=True) inside a GraphCache capture forks a branch (sm_90+) that
    join_beside joins: an attention over the caches after the join reads every key and value it
    wrote; outside a capture it writes on the stream. Both equal the NumPy reference."""
    heads, d, length = 2, 32, 16
    seq, pos = np.array([0, 1, 1, -1, 0]), np.array([3, 0, 1, 0, 4])
    qkv, qkvh = quantize(cu, rng.standard_normal((5, 3 * heads * d)), "fp16")
    bias, biash = quantize(cu, 0.3 * rng.standard_normal(3 * heads * d), "fp16")
    k_ref, v_ref = (np.zeros((2, heads, length, d), np.float32) for _ in range(2))
    ref.write_kv_cache(k_ref, v_ref, qkvh, biash, seq, pos, heads=heads)
    keep = seq >= 0
    expected = np.empty((keep.sum(), heads * d), np.float32)
    ref.cached_attention(expected, qkvh[keep], biash, k_ref, v_ref, seq[keep], pos[keep], heads=heads)
    d_seq, d_pos, kept_seq, kept_pos = ints(cu, seq), ints(cu, pos), ints(cu, seq[keep]), ints(cu, pos[keep])
    kept_qkv, _ = quantize(cu, qkvh[keep], "fp16")
    for captured in (True, False):
        k, v = (cu.to_device(np.zeros((2, heads, length, d), np.float32), np.float16) for _ in range(2))
        out = poisoned(cu, (keep.sum(), heads * d), "fp16")
        forked = []

        def launches():
            cu.write_kv_cache(k, v, qkv, bias, d_seq, d_pos, heads=heads, beside=True)
            forked.append(len(cu.context().beside_ends))
            cu.join_beside()
            cu.cached_attention(out, kept_qkv, bias, k, v, kept_seq, kept_pos, heads=heads)
        if captured:
            cu.GraphCache().run("prefill", launches)
            assert forked[-1] == int(cu.context().dependent_launch)
        else:
            launches()
            assert forked == [0]
        assert cu.context().beside_ends == []
        assert_close(cu, k, k_ref, "fp16")
        assert_close(cu, v, v_ref, "fp16")
        assert_close(cu, out, expected, "fp16")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, d", [(12, 64), (4, 32), (2, 128), (3, 80)])
def test_kv_cache_and_attention_every_cache_length(cu, rng, dtype, heads, d):
    """One sequence of 1024 tokens at positions 0..1023 covers every cache length 1..1024; a
    second call adds decode-style tokens of three sequences at scattered positions."""
    e, length, batch = heads * d, 1024, 3
    cache_shape = (batch, heads, length, d)
    k, v = cu.empty(cache_shape, cu.storage_dtype(dtype)), cu.empty(cache_shape, cu.storage_dtype(dtype))
    k_ref, v_ref = np.zeros(cache_shape, np.float32), np.zeros(cache_shape, np.float32)
    bias, biash = quantize(cu, 0.3 * rng.standard_normal(3 * e), dtype)
    calls = [(np.zeros(length, int), np.arange(length)),
             (np.array([1, 2, 1, 2]), np.array([0, 0, 1, 1]))]
    for seq, pos in calls:
        t = len(seq)
        qkv, qkvh = quantize(cu, rng.standard_normal((t, 3 * e)), dtype)
        cu.write_kv_cache(k, v, qkv, bias, ints(cu, seq), ints(cu, pos), heads=heads)
        ref.write_kv_cache(k_ref, v_ref, qkvh, biash, seq, pos, heads=heads)
        for stored, expected_cache in ((cu.to_host(k), k_ref), (cu.to_host(v), v_ref)):
            stored = stored.astype(np.float32)
            assert_close_host(stored[seq, :, pos], expected_cache[seq, :, pos], dtype)
            expected_cache[seq, :, pos] = stored[seq, :, pos]  # attention below reads the caches as stored
        out, expected = poisoned(cu, (t, e), dtype), np.empty((t, e), np.float32)
        cu.cached_attention(out, qkv, bias, k, v, ints(cu, seq), ints(cu, pos), heads=heads)
        ref.cached_attention(expected, qkvh, biash, k_ref, v_ref, seq, pos, heads=heads)
        assert_close(cu, out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, d", [(16, 64), (3, 80)])
def test_cross_attention_reads_queries_alone(cu, rng, dtype, heads, d):
    """A cross-attention's queries alone ((T, E), not Q, K, V) over a memory of 4 sources: each row
    attends as the reference does with those queries as the Q columns of a (T, 3E) input; a width
    that is neither is refused, and so are queries alone where the step writes its keys."""
    e, length, sources = heads * d, 40, 4
    shape = (sources, heads, length, d)
    (k, k_ref), (v, v_ref) = (quantize(cu, rng.standard_normal(shape), dtype) for _ in range(2))
    seq, last = np.array([0, 0, 1, 3, 3, 2, 1]), np.array([31, 31, 0, 39, 39, 17, 0])
    qkv, qkvh = quantize(cu, rng.standard_normal((len(seq), 3 * e)), dtype)
    bias, biash = quantize(cu, 0.3 * rng.standard_normal(e), dtype)
    queries, _ = quantize(cu, qkvh[:, :e], dtype)
    out, expected = poisoned(cu, (len(seq), e), dtype), np.empty((len(seq), e), np.float32)
    cu.cached_attention(out, queries, bias, k, v, ints(cu, seq), ints(cu, last), heads=heads)
    ref.cached_attention(expected, qkvh, np.concatenate([biash, np.zeros(2 * e, np.float32)]), k_ref, v_ref, seq,
                         last, heads=heads)
    assert_close(cu, out, expected, dtype)
    with pytest.raises(DeviceError, match=rf"attention input of {2 * e} columns: expected {3 * e} .* or {e} "):
        cu.cached_attention(out, qkv[:, :2 * e], bias, k, v, ints(cu, seq), ints(cu, last), heads=heads)
    with pytest.raises(DeviceError, match=rf"attention input of {e} columns: expected {3 * e} \(Q, K, V of "
                                          rf"{heads} heads of {d}\)$"):
        cu.decode_attention(out, queries, bias, k, v, ints(cu, last[:sources]), heads=heads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_tokens_write_no_cache_row_and_mark_nothing(cu, rng, dtype):
    """A prefill's padding tokens (sequence -1) leave every cache row and the seen bitmap as they
    were; the real tokens among them are written as the reference writes them."""
    heads, d, length, batch, vocab = 4, 64, 32, 3, 50
    e, shape = heads * d, (batch, heads, length, d)
    (k, k_ref), (v, v_ref) = (quantize(cu, rng.standard_normal(shape), dtype) for _ in range(2))
    seq, pos = np.array([0, 0, 2, -1, -1, 1, -1]), np.array([0, 1, 0, 0, 0, 5, 0])
    qkv, qkvh = quantize(cu, rng.standard_normal((len(seq), 3 * e)), dtype)
    bias, biash = quantize(cu, 0.3 * rng.standard_normal(3 * e), dtype)
    cu.write_kv_cache(k, v, qkv, bias, ints(cu, seq), ints(cu, pos), heads=heads)
    ref.write_kv_cache(k_ref, v_ref, qkvh, biash, seq, pos, heads=heads)
    for stored, expected in ((cu.to_host(k), k_ref), (cu.to_host(v), v_ref)):
        assert_close_host(stored.astype(np.float32), expected, dtype)
    tokens = rng.integers(0, vocab, len(seq))
    seen = cu.to_device(np.zeros((batch, vocab), np.uint8))
    expected_seen = np.zeros((batch, vocab), np.uint8)
    cu.mark_seen(seen, ints(cu, tokens), ints(cu, seq))
    ref.mark_seen(expected_seen, tokens, seq)
    assert expected_seen.sum() == 4 and np.array_equal(cu.to_host(seen), expected_seen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, d", [(12, 64), (4, 32), (2, 128), (3, 80)])
def test_decode_attention_through_a_cache_indirection(cu, rng, dtype, heads, d):
    """A decode step of 6 rows at positions up to 1023, keys read through a random indirection
    table (beams sharing their parents' cache rows): the new keys and values land in each row's
    own cache, and the output equals the reference attention over the caches as stored."""
    e, length, rows = heads * d, 1024, 6
    shape = (rows, heads, length, d)
    (k, k_ref), (v, v_ref) = (quantize(cu, rng.standard_normal(shape), dtype) for _ in range(2))
    pos = np.array([0, 1, 5, 300, 1023, 777])
    indir = rng.integers(0, rows, (rows, length))
    written = dict(zip(pos.tolist(), range(rows)))  # a position being written is read from its own row only
    for p, r in written.items():
        others = indir[:, p] == r
        indir[others, p] = (r + 1) % rows
    indir[np.arange(rows), pos] = np.arange(rows)
    qkv, qkvh = quantize(cu, rng.standard_normal((rows, 3 * e)), dtype)
    bias, biash = quantize(cu, 0.3 * rng.standard_normal(3 * e), dtype)
    out = poisoned(cu, (rows, e), dtype)
    cu.decode_attention(out, qkv, bias, k, v, ints(cu, pos), ints(cu, indir), heads=heads)
    written_k, written_v = k_ref.copy(), v_ref.copy()
    ref.write_kv_cache(written_k, written_v, qkvh, biash, np.arange(rows), pos, heads=heads)
    untouched = np.ones(shape, bool)
    untouched[np.arange(rows), :, pos] = False
    for stored, expected_cache, before in ((cu.to_host(k), written_k, k_ref), (cu.to_host(v), written_v, v_ref)):
        stored = stored.astype(np.float32)
        assert_close_host(stored[np.arange(rows), :, pos], expected_cache[np.arange(rows), :, pos], dtype)
        np.testing.assert_array_equal(stored[untouched], before[untouched])  # nothing else written
        before[np.arange(rows), :, pos] = stored[np.arange(rows), :, pos]
    expected = np.empty((rows, e), np.float32)
    ref.cached_attention(expected, qkvh, biash, k_ref, v_ref, np.arange(rows), pos, heads=heads, indir=indir)
    assert_close(cu, out, expected, dtype)


def _hf(path, dtype="fp32"):
    import torch
    from transformers import GPT2LMHeadModel
    torch.backends.cuda.matmul.allow_tf32 = False
    m = GPT2LMHeadModel.from_pretrained(str(path), attn_implementation="eager").eval().cuda()
    return m.to({"fp32": torch.float32, "fp16": torch.float16}[dtype])


def _hf_greedy(model, prompt, n):
    import torch
    ids = torch.tensor([prompt]).cuda()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


def _generate(path, ops, dtype, prompts, graphs=True, **kwargs):
    config = load_gpt2_config(path)
    runner = GPT2Runner(config, load_gpt2_weights(path, config), ops, dtype=dtype, max_batch=len(prompts),
                        max_len=config.n_positions, graphs=graphs)
    params = GenerationParams(**kwargs).checked(vocab_size=config.vocab_size)
    new = [[] for _ in prompts]
    for step in stream_tokens(runner, prompts, params):
        for b, t in step:
            new[b].append(t)
    return new


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return write_gpt2_checkpoint(tmp_path_factory.mktemp("gpt2"), seed=8, n_embd=256, n_layer=4, n_head=4,
                                 n_positions=256)


def _prompts(n_vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_vocab - 1, n).tolist() for n in (1, 5, 17, 3, 40, 9, 2, 28)]


def test_greedy_fp32_token_exact_with_hf(cu, gpt2):
    prompts = _prompts(257)
    ours = _generate(gpt2, cu, "fp32", prompts, max_new_tokens=32, min_new_tokens=32)
    hf = _hf(gpt2)
    for b, p in enumerate(prompts):
        assert ours[b] == _hf_greedy(hf, p, 32), b


def test_greedy_fp16_mostly_equal_to_hf(cu, gpt2):
    """fp16 rounding may flip a near-tie, after which a sequence differs: at least 95% of the
    tokens must still equal HF fp16's; the first divergence is reported on failure."""
    prompts = _prompts(257, seed=1)
    ours = _generate(gpt2, cu, "fp16", prompts, max_new_tokens=32, min_new_tokens=32)
    hf = _hf(gpt2, "fp16")
    theirs = [_hf_greedy(hf, p, 32) for p in prompts]
    equal = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, theirs)]
    assert equal >= 0.95 * 32 * len(prompts), f"first divergence per prompt: {first}"


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_seeded_sampling_same_across_runs_and_graphs(cu, gpt2, dtype):
    prompts = _prompts(257, seed=2)[:4]
    kwargs = dict(max_new_tokens=24, do_sample=True, top_k=40, top_p=0.9, temperature=0.9, seed=77)
    a = _generate(gpt2, cu, dtype, prompts, **kwargs)
    assert a == _generate(gpt2, cu, dtype, prompts, **kwargs)
    assert a == _generate(gpt2, cu, dtype, prompts, graphs=False, **kwargs)


def test_step_graphs_serve_other_seeds_lengths_and_eos_ids(cu, gpt2):
    """A decode step's graph is keyed by what its launches take (GenerationParams.graph_key): a
    generation with another seed, max_new_tokens or eos ids (as many) replays the step graph
    captured by the first, and streams the tokens of a runner without graphs; beam search with
    other eos ids, max_new_tokens and num_return_sequences replays its graph too, and gives the
    hypotheses and scores (to the bit) of a new runner that captures its own and of one without
    graphs."""
    config = load_gpt2_config(gpt2)
    weights = load_gpt2_weights(gpt2, config)

    def runner(graphs):
        return GPT2Runner(config, weights, cu, dtype="fp32", max_batch=4, max_len=config.n_positions, graphs=graphs)
    shared, direct = runner(True), runner(False)
    prompts = _prompts(257, seed=5)[:4]
    streams = []
    for seed, new, eos in ((1, 12, 5), (2, 20, 9), (3, 7, 5)):
        params = GenerationParams(max_new_tokens=new, do_sample=True, top_k=40, seed=seed,
                                  eos_token_ids=(eos,)).checked(vocab_size=config.vocab_size)
        streams.append(list(stream_tokens(shared, prompts, params)))
        assert streams[-1] == list(stream_tokens(direct, prompts, params)), seed
    assert streams[1][:7] != streams[2]  # the seeds draw apart: a seed baked into the graph would show
    assert [key[:2] for key in shared.graphs.graphs] == [("step", 4)]
    beams = [GenerationParams(max_new_tokens=new, num_beams=2, num_return_sequences=n, eos_token_ids=(eos,)).checked(
        vocab_size=config.vocab_size) for new, n, eos in ((6, 1, 5), (9, 2, 9))]
    for params in beams:
        found = beam_search(shared, prompts[:2], params)
        assert found == beam_search(runner(True), prompts[:2], params) == beam_search(direct, prompts[:2], params)
    assert [key[:2] for key in shared.graphs.graphs] == [("step", 4), ("beam", 2)]


def test_cuda_and_numpy_sample_the_same_tokens_fp32(cu, gpt2):
    prompts = _prompts(257, seed=3)[:3]
    kwargs = dict(max_new_tokens=16, do_sample=True, top_p=0.95, seed=5)
    assert _generate(gpt2, cu, "fp32", prompts, **kwargs) == _generate(gpt2, ref, "fp32", prompts, **kwargs)


def test_prefill_graphs_replay_new_prompts_of_a_captured_shape(cu, gpt2):
    """Prefills are padded to bucketed shapes and replayed from graphs: prompts of a shape seen
    before (other lengths, other ids) give the NumPy backend's last-token logits, and a decode
    step after each reads a cache the padding did not touch."""
    config = load_gpt2_config(gpt2)
    weights = load_gpt2_weights(gpt2, config)
    runner = GPT2Runner(config, weights, cu, dtype="fp32", max_batch=4, max_len=config.n_positions)
    reference = GPT2Runner(config, weights, ref, dtype="fp32", max_batch=4, max_len=config.n_positions)
    rng = np.random.default_rng(11)
    shapes = ([5, 17], [7, 13], [1, 2, 3], [64], [40, 30, 20], [6, 8])  # (64, 2, 32) three times
    for lengths in shapes:
        prompts = [rng.integers(0, config.vocab_size - 1, n).tolist() for n in lengths]
        tokens, positions = rng.integers(0, config.vocab_size - 1, len(prompts)), np.array(lengths)
        for r in (runner, reference):
            r.prefill(prompts)
        got, expected = runner.logits(len(prompts)), reference.logits(len(prompts))
        scale = max(1.0, float(np.abs(expected).max()))
        assert np.abs(got - expected).max() / scale <= GPU_FP32_REL, lengths
        for r in (runner, reference):
            r.decode(tokens, positions)
        got, expected = runner.logits(len(prompts)), reference.logits(len(prompts))
        assert np.abs(got - expected).max() / max(1.0, float(np.abs(expected).max())) <= GPU_FP32_REL, lengths
    assert sorted(runner.prefill_graphs.graphs) == [(64, 1, 64), (64, 2, 32), (64, 4, 32), (128, 4, 64)]


def _stream(path, ops, prompts, **kwargs):
    config = load_gpt2_config(path)
    runner = GPT2Runner(config, load_gpt2_weights(path, config), ops, dtype="fp32", max_batch=len(prompts),
                        max_len=config.n_positions)
    return list(stream_tokens(runner, prompts, GenerationParams(**kwargs).checked(vocab_size=config.vocab_size)))


def test_cuda_and_numpy_streams_agree_when_sequences_finish_early(cu, gpt2):
    """Greedy fp32 with eos ids that the prompts produce at different steps: the per-step streams
    (which prompts still run, and their tokens) are the same on both backends, so the finished
    flags kept on the device stop each sequence where the host-side reference does."""
    prompts = _prompts(257, seed=4)[:6]
    eos = tuple({tokens[2] for tokens in _generate(gpt2, ref, "fp32", prompts[:2], max_new_tokens=3,
                                                   repetition_penalty=1.1)})
    kwargs = dict(max_new_tokens=30, repetition_penalty=1.1, eos_token_ids=eos)
    ours = _stream(gpt2, cu, prompts, **kwargs)
    assert ours == _stream(gpt2, ref, prompts, **kwargs)
    assert len(ours[3]) < len(prompts) and len(ours) > 4  # prompts 0 and 1 stopped at step 3, others ran on


CHOICES = [dict(), dict(repetition_penalty=1.3), dict(min_new_tokens=5), dict(do_sample=True),
           dict(no_repeat_ngram_size=1), dict(no_repeat_ngram_size=3, do_sample=True, top_k=5),
           dict(do_sample=True, temperature=0.7), dict(do_sample=True, top_k=1), dict(do_sample=True, top_k=40),
           dict(do_sample=True, top_k=1024), dict(do_sample=True, top_p=0.9), dict(do_sample=True, top_p=0.3),
           dict(do_sample=True, top_k=50, top_p=0.8, temperature=1.3, repetition_penalty=1.2, min_new_tokens=3)]


@pytest.fixture(params=["cluster", "slices"])
def sampling_path(request, cu, monkeypatch):
    """Sampling's two GPU paths: choose_sample, one kernel with a thread-block cluster per row
    (sm_90+), and the kernels over vocabulary slices (choose_prepare, choose_level, choose_draw)
    that other GPUs run."""
    ctx = cu.context()
    if request.param == "cluster" and not ctx.clusters:
        pytest.skip("thread-block clusters need sm_90+")
    monkeypatch.setattr(ctx, "clusters", request.param == "cluster")
    return request.param


@pytest.mark.parametrize("opts", CHOICES)
def test_choose_tokens_matches_numpy(cu, rng, opts, sampling_path):
    """Token choice on the GPU equals the NumPy reference (itself checked against HF's
    processors) for each mode and sampling path: same processors, same Philox uniforms, same
    inverse CDF."""
    b, v = 16, 50257
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    logits[0, 3] = logits[1, 50256] = 50.0   # eos ids that win unless min_new_tokens masks them
    logits[2, 7] = np.nan                    # reported as -1, never sampled
    seen = (rng.random((b, v)) < 0.01).astype(np.uint8)
    # histories with repeats (a short alphabet): n-gram bans hit the likeliest tokens too
    seq = rng.integers(0, 6, (b, 64)).astype(np.int32)
    seq[:, ::3] = np.argsort(-logits, axis=1)[:, :22]
    lengths = rng.integers(1, 65, b).astype(np.int32)
    params = GenerationParams(max_new_tokens=8, seed=11, eos_token_ids=(3, 50256), **opts).checked(vocab_size=v)
    eos = np.array(params.eos_token_ids, np.int32)
    state = cu.to_device(np.zeros((b, cu.CHOICE_STATE_WORDS), np.uint64))
    for step in (0, 6):
        out = cu.to_device(np.full(b, -7, np.int32))
        cu.choose_tokens(out, cu.to_device(logits), cu.to_device(seen), cu.to_device(eos), ints(cu, [step]),
                         scratch=cu.empty((b, v), np.float32), state=state, params=params,
                         seed=cu.to_device(params.seed_words()), seq=ints(cu, seq), lengths=ints(cu, lengths))
        expected = np.empty(b, np.int32)
        ref.choose_tokens(expected, logits, seen, eos, np.array([step]), scratch=None, state=None, params=params,
                          seed=params.seed_words(), seq=seq, lengths=lengths)
        np.testing.assert_array_equal(cu.to_host(out), expected)
        assert expected[2] == -1
        assert not cu.to_host(state).any()  # left zero for the next call


def chosen_like_numpy(cu, logits, params, state=None):
    """choose_tokens on the GPU for float32 logits (B, V) at step 0 with nothing seen (state: a
    fresh one unless given), asserted equal to NumPy's choice; the tokens."""
    rows, v = logits.shape
    state = cu.to_device(np.zeros((rows, cu.CHOICE_STATE_WORDS), np.uint64)) if state is None else state
    out = cu.to_device(np.full(rows, -7, np.int32))
    seen = np.zeros((rows, v), np.uint8)
    cu.choose_tokens(out, cu.to_device(logits), cu.to_device(seen), ints(cu, [0]), ints(cu, [1]),
                     scratch=cu.empty((rows, v), np.float32), state=state, params=params,
                     seed=cu.to_device(params.seed_words()))
    expected = np.empty(rows, np.int32)
    ref.choose_tokens(expected, logits, seen, np.array([0]), np.array([1]), scratch=None, state=None, params=params,
                      seed=params.seed_words())
    np.testing.assert_array_equal(cu.to_host(out), expected)
    return expected


SLICED_CHOICES = [dict(), dict(do_sample=True, top_k=40), dict(do_sample=True, top_k=3000),
                  dict(do_sample=True, top_k=60, temperature=0.8), dict(do_sample=True, top_p=0.95),
                  dict(do_sample=True, top_k=200, top_p=0.5), dict(do_sample=True, top_k=64, top_p=0.9),
                  dict(do_sample=True, top_k=65)]


@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("opts", SLICED_CHOICES)
def test_choose_tokens_over_slices_matches_numpy(cu, rng, rows, opts, sampling_path):
    """Each row's vocabulary split over 50 blocks (1 row), 16 (16 rows) or one (300 rows), or
    (sampling, cluster path) over a cluster of 8: the same tokens as NumPy. Greedy and top-k rows
    have scores on a grid of 1/8, so that the largest score and the k-th one are shared by tokens
    of several slices (ties at top-k's threshold are kept, as HF keeps them); one row has 9 scores
    above a floor of -1e30 (top-k keeps the floor's ties, of probability 0). Top-p rows have
    distinct scores: the reference sorts ties by index, the GPU keeps or drops a tied group whole."""
    v = 50257
    logits = (rng.standard_normal((rows, v)) * 2).astype(np.float32)
    if not opts.get("top_p"):
        logits = np.round(logits * 8) / 8
    logits[0, 9:] = -1e30
    params = GenerationParams(max_new_tokens=4, seed=3, **opts).checked(vocab_size=v)
    state = cu.to_device(np.zeros((rows, cu.CHOICE_STATE_WORDS), np.uint64))
    expected = chosen_like_numpy(cu, logits, params, state)
    assert 0 <= expected[0] < 9
    assert not cu.to_host(state).any()


@pytest.mark.parametrize("opts", [dict(do_sample=True, top_k=40), dict(do_sample=True, top_p=0.9),
                                  dict(do_sample=True, top_k=30000, top_p=0.5)])
def test_choose_tokens_where_every_token_shares_the_first_digit(cu, rng, opts, sampling_path):
    """Rows whose every score has the same top 11 key bits, so that every token stays a candidate
    past the selects' first digit (more than the cluster kernel's lists hold: its last two digits
    look at the whole slice again): all scores equal (a tie top-k keeps whole), and distinct scores
    within [1, 1.025) in random order."""
    v = 50257
    logits = np.empty((3, v), np.float32)
    logits[0] = 1.5
    for row in (1, 2):
        logits[row] = (1.0 + rng.permutation(v) * 4 * 2.0 ** -23).astype(np.float32)
    if opts.get("top_p"):
        logits = logits[1:]  # the reference orders ties by index, the GPU keeps or drops a tied group whole
    chosen_like_numpy(cu, logits, GenerationParams(max_new_tokens=4, seed=5, **opts).checked(vocab_size=v))


@pytest.mark.parametrize("few", [255, 256, 257])
@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_choose_tokens_around_the_cluster_kernels_few_candidates(cu, rng, few, top_p, sampling_path):
    """Rows whose top-k threshold lies among `few` distinct scores sharing their first digit (all
    in [1, 1.25), the rest far below): up to SAMPLE_FEW (256) of them the cluster kernel's selects
    find the key from every block's candidates at once, past it digit by digit; with top-p after
    top-k, its select looks at top-k's survivors only. The same tokens as NumPy either way."""
    v, rows = 50257, 4
    logits = (rng.standard_normal((rows, v)) - 10).astype(np.float32)
    for r in range(rows):
        logits[r, rng.choice(v, few, replace=False)] = 1.0 + rng.permutation(few) / (4 * few)
    params = GenerationParams(max_new_tokens=4, seed=9, do_sample=True, top_k=few // 2 + 3,
                              top_p=top_p).checked(vocab_size=v)
    expected = chosen_like_numpy(cu, logits, params)
    assert (logits[np.arange(rows), expected] >= 1.0).all()


def test_gpu_sampled_frequencies_match_the_distribution(cu, sampling_path):
    """Chi-square of 50,000 GPU draws (one row each) from a fixed 12-token distribution, on each
    sampling path."""
    probs = np.array([0.3, 0.2, 0.1, 0.1, 0.08, 0.07, 0.05, 0.04, 0.03, 0.02, 0.01, 0.0])
    scores = np.log(np.maximum(probs, 1e-30)).astype(np.float32)
    scores[-1] = -1e30  # probability 0, yet a finite logit (a non-finite one is reported, not sampled)
    n = 50_000
    params = GenerationParams(max_new_tokens=1, do_sample=True, seed=2024).checked(vocab_size=12)
    out = cu.to_device(np.zeros(n, np.int32))
    cu.choose_tokens(out, cu.to_device(np.tile(scores, (n, 1))), cu.to_device(np.zeros((n, 12), np.uint8)),
                     cu.to_device(np.array([11], np.int32)), ints(cu, [0]), scratch=cu.empty((n, 12), np.float32),
                     state=cu.to_device(np.zeros((n, cu.CHOICE_STATE_WORDS), np.uint64)), params=params,
                     seed=cu.to_device(params.seed_words()))
    counts = np.bincount(cu.to_host(out), minlength=12)
    assert counts[-1] == 0
    expected = probs[:-1] * n
    assert (((counts[:-1] - expected) ** 2) / expected).sum() < 31.26  # 10 degrees of freedom, p = 0.001


def test_choose_tokens_sends_sampling_to_one_cluster_kernel_where_it_fits(cu, rng, monkeypatch):
    """On sm_90+, sampling runs choose_sample alone (a cluster of 8 blocks per row of GPT-2's
    vocabulary, 4 of a 6000-token one; its instantiation with sample_few where top-k is set);
    greedy runs choose_prepare; a slice past the block's shared memory takes the sliced kernels.
    Each gives NumPy's tokens."""
    ctx = cu.context()
    if not ctx.clusters:
        pytest.skip("thread-block clusters need sm_90+")
    assert cu.sample_clusters(50257) == (8, 6283) and cu.sample_clusters(6000) == (4, 1500)
    assert cu.sample_clusters(12) == (1, 12)
    launched, real = [], sampling._launch

    def recording(file, name, *args, **kwargs):
        launched.append(name)
        real(file, name, *args, **kwargs)
    monkeypatch.setattr(sampling, "_launch", recording)
    b, v = 5, 50257
    logits = (rng.standard_normal((b, v)) * 2).astype(np.float32)
    chosen_like_numpy(cu, logits, GenerationParams(max_new_tokens=2, seed=7, do_sample=True,
                                                   top_p=0.9).checked(vocab_size=v))
    assert launched == ["choose_sample<false>"]  # no top-k: the kernel without sample_few
    launched.clear()
    expected_kernels = {
        (False, None): ["choose_prepare"],
        (True, None): ["choose_sample<true>"],
        (True, 32 * 1024): ["choose_prepare"] + ["choose_level"] * 3 + ["choose_draw"],
    }
    for (sample, optin), kernels in expected_kernels.items():
        if optin is not None:
            monkeypatch.setattr(ctx, "shared_mem_optin", optin)
        params = GenerationParams(max_new_tokens=2, seed=7, do_sample=sample, top_k=40 if sample else 0).checked(
            vocab_size=v)
        launched.clear()
        chosen_like_numpy(cu, logits, params)
        assert launched == kernels


@pytest.mark.parametrize("options", [dict(), dict(num_beams=3, num_return_sequences=2),
                                     dict(do_sample=True, seed=5, top_k=30)])
def test_gpu_waves_give_the_tokens_of_one_wave(tmp_path, options):
    """3 x max_batch sequences in waves of max_batch: greedy and beams give each prompt's tokens as
    when it runs alone; seeded sampling gives each wave's tokens as the same prompts in one call
    (a draw depends on the prompt's place in its wave); the default max_batch is in range."""
    from ftengine.generator import MAX_DEFAULT_BATCH, Generator
    gen = Generator.from_pretrained(write_gpt2_checkpoint(tmp_path / "gpt2", seed=4), device="cuda", dtype="fp32")
    beams = options.get("num_beams", 1)
    max_batch = 2 * beams
    prompts = [f"gpu wave {i}" + " more" * (i % 3) for i in range(6)]
    waves = gen.generate(prompts, max_new_tokens=9, max_batch=max_batch, **options)
    per_wave = max_batch // beams
    for start in range(0, len(prompts), per_wave):
        group = prompts[start:start + per_wave] if options.get("do_sample") else None
        for i, prompt in enumerate(prompts[start:start + per_wave]):
            alone = gen.generate(group, max_new_tokens=9, **options)[i] if group else \
                gen.generate([prompt], max_new_tokens=9, **options)[0]
            got = waves[start + i]
            assert got.prompt == prompt
            assert [c.token_ids for c in got.candidates] == [c.token_ids for c in alone.candidates]
    assert 1 <= gen.default_max_batch(128) <= MAX_DEFAULT_BATCH


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, d", [(12, 64), (2, 32)])
def test_decode_attention_with_a_relative_position_bias(cu, rng, dtype, heads, d):
    """T5's causal relative position bias (a table of 32 buckets x heads, each key's bucket by
    its distance back from the query) in a decode step against the NumPy twin."""
    from ftengine.models.bert import relative_position_buckets
    e, length, rows = heads * d, 256, 5
    shape = (rows, heads, length, d)
    (k, k_ref), (v, v_ref) = (quantize(cu, rng.standard_normal(shape), dtype) for _ in range(2))
    pos = np.array([0, 1, 9, 100, 255])
    table = rng.standard_normal((32, heads)).astype(np.float32)
    buckets = relative_position_buckets(length, 32, 128, causal=True)
    qkv, qkvh = quantize(cu, rng.standard_normal((rows, 3 * e)), dtype)
    bias, biash = quantize(cu, 0.3 * rng.standard_normal(3 * e), dtype)
    out = poisoned(cu, (rows, e), dtype)
    cu.decode_attention(out, qkv, bias, k, v, ints(cu, pos), heads=heads,
                        rel_bias=(cu.to_device(table, np.float32), ints(cu, buckets), length))
    expected = np.empty((rows, e), np.float32)
    ref.decode_attention(expected, qkvh, biash, k_ref, v_ref, pos, heads=heads, rel_bias=(table, buckets, length))
    assert_close(cu, out, expected, dtype)
