"""Level 1 and 3 (GPU), dtype fp8: the e4m3 kernels against their NumPy twins, the FP8 product
against NumPy on the same e4m3 operands, and fp8 embeddings against fp32 (HF-style BERT-base and
the default model); fp8 refused where it does not apply."""

import threading

import numpy as np
import pytest

from ftengine import Encoder
from ftengine.backends import numpy_ops as ref
from ftengine.encoder import default_model_path
from ftengine.errors import ConfigError
from tests.test_cuda_model import CONFIGS, _batch, _hf_hidden, _runner
from tests.test_cuda_ops import assert_close_host, poisoned, quantize
from tests.tolerances import E4M3_HALF_ULP, E4M3_SUBNORMAL_HALF_STEP, EMBEDDING_COSINE_FP8, FP8_PRODUCT_SUM_REL, OPS
from weights.fixtures import write_bert_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cu():
    from ftengine.backends.cuda import ops
    try:
        ops.check_fp8()
    except Exception as e:
        pytest.skip(str(e))
    return ops


def _rows(rng, t, h):
    """Rows of very different magnitudes: a zero row, an outlier row, a tiny row."""
    x = rng.standard_normal((t, h)) * np.exp(rng.uniform(-3, 3, (t, 1)))
    x[0] = 0
    x[1, 3] = 1e3
    x[2] *= 1e-4
    return x


def _quantized(cu, t, h):
    return cu.empty((t, h), np.uint8), poisoned(cu, (t,), "fp32")


def _assert_quantizes(cu, q, scales, y):
    """The kernel's e4m3 rows (q, scales) stand for y (float32, the reference's values) within half
    an e4m3 unit in the last place, plus the fp16 tolerance of y itself; scales = amax / 448."""
    q, scales = cu.to_host(q), cu.to_host(scales)
    tol = OPS["fp16"]
    amax = np.abs(y).max(1)
    expected = np.where(amax > 0, amax / 448, 1)
    assert np.all(np.abs(scales - expected) <= (tol["atol"] + tol["rtol"] * amax) / 448 + 1e-7 * expected)
    got = ref.e4m3_values(q) * scales[:, None]
    bound = (E4M3_HALF_ULP * np.abs(y) + E4M3_SUBNORMAL_HALF_STEP * scales[:, None]
             + (1 + E4M3_HALF_ULP) * (tol["atol"] + tol["rtol"] * np.abs(y)))
    worst = np.abs(got - y) - bound
    assert worst.max() <= 0, f"max excess {worst.max():.3g}"


@pytest.mark.parametrize("t, h", [(37, 768), (5, 3072), (9, 200), (3, 8), (4, 40)])
def test_quantize_rows_matches_numpy_bit_for_bit(cu, rng, t, h):
    x, xh = quantize(cu, _rows(rng, t, h), "fp16")
    q, scales = _quantized(cu, t, h)
    cu.quantize_rows(q, scales, x)
    q_ref, s_ref = np.empty((t, h), np.uint8), np.empty(t, np.float32)
    ref.quantize_rows(q_ref, s_ref, xh)
    np.testing.assert_array_equal(cu.to_host(scales), s_ref)
    np.testing.assert_array_equal(cu.to_host(q), q_ref)


@pytest.mark.parametrize("h", [384, 768, 1024, 200])
def test_add_bias_residual_layernorm_quantize(cu, rng, h):
    """Its fp16 output is the plain kernel's bit for bit; its e4m3 rows stand for the NumPy LayerNorm."""
    t = 53
    (x, xh), (b, bh), (r, rh), (g, gh), (be, beh) = (
        quantize(cu, rng.standard_normal(s), "fp16") for s in ((t, h), (h,), (t, h), (h,), (h,)))
    out, plain = poisoned(cu, (t, h), "fp16"), poisoned(cu, (t, h), "fp16")
    q, scales = _quantized(cu, t, h)
    cu.add_bias_residual_layernorm_quantize(out, q, scales, x, b, r, g, be, eps=1e-5)
    cu.add_bias_residual_layernorm(plain, x, b, r, g, be, eps=1e-5)
    np.testing.assert_array_equal(cu.to_host(out), cu.to_host(plain))
    expected = np.empty((t, h), np.float32)
    ref.add_bias_residual_layernorm(expected, xh, bh, rh, gh, beh, eps=1e-5)
    assert_close_host(cu.to_host(out).astype(np.float32), expected, "fp16")
    _assert_quantizes(cu, q, scales, expected)


@pytest.mark.parametrize("form", ["erf", "tanh"])
@pytest.mark.parametrize("inter", [1536, 3072, 4096, 808, 8192])
def test_add_bias_gelu_quantize(cu, rng, form, inter):
    t = 29
    (x, xh), (b, bh) = (quantize(cu, 3 * rng.standard_normal(s), "fp16") for s in ((t, inter), (inter,)))
    q, scales = _quantized(cu, t, inter)
    cu.add_bias_gelu_quantize(q, scales, x, b, form=form)
    expected = np.empty((t, inter), np.float32)
    ref.add_bias_gelu(expected, xh, bh, form=form)
    _assert_quantizes(cu, q, scales, expected)


@pytest.mark.parametrize("m, k, n", [(1, 768, 2304), (3, 384, 1536), (37, 768, 768), (64, 3072, 768),
                                     (300, 1536, 384), (8195, 768, 3072)])
def test_matmul_fp8(cu, rng, m, k, n):
    """On e4m3 operands with per-row scales, against NumPy's product of the values they stand for:
    the fp16 output's tolerance plus the FP8 accumulator's, relative to sum_k |x_k w_k|."""
    operands = []
    for rows in (m, n):
        q, s = np.empty((rows, k), np.uint8), np.empty(rows, np.float32)
        values = rng.standard_normal((rows, k)) * np.exp(rng.uniform(-1, 1, (rows, 1))) / np.sqrt(k) ** 0.5
        ref.quantize_rows(q, s, values)
        operands.append((q, s))
    (xq, xs), (wq, ws) = operands
    out = poisoned(cu, (m, n), "fp16")
    cu.matmul_fp8(out, cu.to_device(xq), cu.to_device(xs), cu.to_device(wq), cu.to_device(ws))
    expected, magnitude = np.empty((m, n), np.float64), np.empty((m, n), np.float64)
    ref.matmul_fp8(expected, xq, xs.astype(np.float64), wq, ws.astype(np.float64))
    ref.matmul_fp8(magnitude, xq & 0x7F, xs.astype(np.float64), wq & 0x7F, ws.astype(np.float64))  # |x| @ |w|^T
    got = cu.to_host(out).astype(np.float64)
    tol = OPS["fp16"]
    excess = np.abs(got - expected) - (tol["atol"] + tol["rtol"] * np.abs(expected) + FP8_PRODUCT_SUM_REL * magnitude)
    assert excess.max() <= 0, f"max |err| {np.abs(got - expected).max():.3g}"


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_fp8_embeddings_cosine_bert_base(tmp_path, cu, layout):
    """HF-style random BERT-base: pooled, normalised fp8 embeddings against HF fp32's."""
    path = write_bert_checkpoint(tmp_path, seed=12, init="hf", **CONFIGS["bert-base"][0])
    batch = _batch(_runner(path, cu, "fp16", layout).config, np.random.default_rng(8))
    runner = _runner(path, cu, "fp8", layout)
    means = np.stack([x.mean(0) for x in _hf_hidden(path, batch, "fp32")])
    expected = means / np.linalg.norm(means, axis=1, keepdims=True)
    cos = (runner.embed(batch, pooling=("mean",), normalize=True) * expected).sum(1)
    assert cos.min() >= EMBEDDING_COSINE_FP8["bert-base-hf-init"], f"{layout}: cosine {cos.min()}"


TEXTS = ["The quick brown fox jumps over the lazy dog.", "", "a", "SELECT * FROM users WHERE id = 7;",
         "café naïve résumé façade Größe", "A moderately long sentence about semantic search, " * 12,
         "word " * 300, "東京は日本の首都です。"] * 5


def test_fp8_embeddings_cosine_default_model(cu):
    """The default model (all-MiniLM-L6-v2): fp8 against fp32 on the GPU, one call from each of
    four threads at once (each gets its own rows)."""
    try:
        path = default_model_path()
    except ConfigError as e:
        pytest.skip(str(e))
    exact = Encoder.from_pretrained(path, device="cuda", dtype="fp32").encode(TEXTS)
    with Encoder.from_pretrained(path, device="cuda", dtype="fp8") as enc:
        sequential = enc.encode(TEXTS)
        results = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, enc.encode(TEXTS[i:] + TEXTS[:i])))
                   for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    bound = EMBEDDING_COSINE_FP8["all-MiniLM-L6-v2"]
    assert (sequential * exact).sum(1).min() >= bound
    for i, got in results.items():
        assert (got * np.roll(exact, -i, axis=0)).sum(1).min() >= bound, f"thread {i}"


def test_fp8_refuses_models_it_does_not_cover(tmp_path, cu):
    path = write_bert_checkpoint(tmp_path, seed=1, hidden=200, layers=1, heads=4, intermediate=803, max_positions=64)
    with pytest.raises(ConfigError, match="divisible by 16.*hidden_size 200, intermediate_size 803"):
        Encoder.from_pretrained(path, device="cuda", dtype="fp8")
