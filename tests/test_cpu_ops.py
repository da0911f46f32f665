"""The CPU backend's blocked, threaded ops (numpy_ops at sizes where they split work over the
thread pool) against torch's own ops in float32, and their thread safety."""

import numpy as np
import pytest

from ftengine.backends import numpy_ops as ops
from tests.tolerances import OPS

torch = pytest.importorskip("torch")
F = torch.nn.functional
TOL = OPS["fp32"]


def _assert_close(got, expected):
    bound = TOL["atol"] + TOL["rtol"] * np.abs(expected)
    assert (np.abs(got - expected) <= bound).all(), np.abs(got - expected).max()


@pytest.mark.parametrize("form, approximate", [("erf", "none"), ("tanh", "tanh")])
@pytest.mark.parametrize("rows, width", [(700, 1536), (3, 37), (1000, 1)])
def test_add_bias_gelu_and_geglu_match_torch(rng, form, approximate, rows, width):
    x = (3 * rng.standard_normal((rows, 2 * width))).astype(np.float32)
    bias = rng.standard_normal(2 * width).astype(np.float32)
    y = torch.from_numpy(x + bias)
    out = np.full((rows, 2 * width), np.nan, np.float32)
    ops.add_bias_gelu(out, x, bias, form=form)
    _assert_close(out, F.gelu(y, approximate=approximate).numpy())
    ops.add_bias_gelu(x, x, bias, form=form)  # in place, as the model runs it
    np.testing.assert_array_equal(x, out)
    gated = np.full((rows, width), np.nan, np.float32)
    ops.gated_gelu(gated, y.numpy() - bias, bias, form=form)
    _assert_close(gated, (F.gelu(y[:, :width], approximate=approximate) * y[:, width:]).numpy())


@pytest.mark.parametrize("rows, width", [(900, 384), (2, 768)])
def test_add_bias_residual_layernorm_matches_torch(rng, rows, width):
    x, residual = (rng.standard_normal((rows, width)).astype(np.float32) for _ in range(2))
    bias, gamma, beta = (rng.standard_normal(width).astype(np.float32) for _ in range(3))
    out = np.full((rows, width), np.nan, np.float32)
    ops.add_bias_residual_layernorm(out, x, bias, residual, gamma, beta, eps=1e-12)
    expected = F.layer_norm(torch.from_numpy(x + bias + residual), (width,), torch.from_numpy(gamma),
                            torch.from_numpy(beta), eps=1e-12).numpy()
    _assert_close(out, expected)


@pytest.mark.parametrize("window", [0, 20])
def test_varlen_attention_matches_torch_sdpa(rng, window):
    """Sequences on the thread pool, one softmax shift per head (with the per-row fallback when
    a row underflows: one head's scores are made far apart here)."""
    heads, d = 6, 32
    lengths = [130, 1, 77, 200, 64]
    h = heads * d
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = int(cu_seqlens[-1]) + 4
    qkv = rng.standard_normal((t, 3 * h)).astype(np.float32)
    qkv[0, :d] = 20.0 * qkv[1, h:h + d]  # head 0, query 0 aligned with key 1: its score is far above its rows'
    bias = np.zeros(3 * h, np.float32)
    ctx = np.full((t, h), np.nan, np.float32)
    ops.varlen_attention(ctx, qkv, bias, cu_seqlens, heads=heads, max_seqlen=max(lengths), window=window)
    x = torch.from_numpy(qkv + bias).reshape(t, 3, heads, d)
    for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        q, k, v = (x[lo:hi, i].transpose(0, 1) for i in range(3))
        n = hi - lo
        mask = None
        if window:
            pos = torch.arange(n)
            mask = (pos[None, :] - pos[:, None]).abs() <= window
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1).reshape(n, h)
        _assert_close(ctx[lo:hi], expected.numpy())
    assert (ctx[cu_seqlens[-1]:] == 0).all()


def test_matmul_split_over_threads_matches_torch(rng):
    x = (rng.standard_normal((1000, 384)) / 384 ** 0.25).astype(np.float32)
    w = (rng.standard_normal((1536, 384)) / 384 ** 0.25).astype(np.float32)
    out = np.full((1000, 1536), np.nan, np.float32)
    ops.matmul(out, x, w)
    _assert_close(out, (torch.from_numpy(x).double() @ torch.from_numpy(w).double().T).float().numpy())


def test_ops_from_many_threads_equal_one_thread(rng):
    """Callers in several threads share the pool and the BLAS thread limit: the same results (to
    float32 rounding: BLAS may split a product differently with more threads), and the
    process's BLAS setting is as before once all have left."""
    from concurrent.futures import ThreadPoolExecutor
    from threadpoolctl import threadpool_info
    before = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    x = (rng.standard_normal((600, 384)) / 384 ** 0.25).astype(np.float32)
    w = (rng.standard_normal((1152, 384)) / 384 ** 0.25).astype(np.float32)
    cu_seqlens = np.array([0, 250, 600], np.int32)

    def work(_):
        prod = np.empty((600, 1152), np.float32)
        ops.matmul(prod, x, w)
        ctx = np.empty((600, 384), np.float32)
        ops.varlen_attention(ctx, prod, np.zeros(1152, np.float32), cu_seqlens, heads=12, max_seqlen=350)
        return prod, ctx

    expected = work(0)
    with ThreadPoolExecutor(6) as pool:
        for prod, ctx in pool.map(work, range(12)):
            _assert_close(prod, expected[0])
            _assert_close(ctx, expected[1])
    assert [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"] == before
