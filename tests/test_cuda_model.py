"""Level 3 (GPU): the CUDA encoder against HF transformers on the same GPU and against the
NumPy backend, for every dtype and both token layouts; CUDA graphs on and off give identical results."""

import numpy as np
import pytest

from ftengine import Encoder
from ftengine.backends import numpy_ops
from ftengine.backends.cuda import gemm
from ftengine.checkpoint import load_bert_weights
from ftengine.config import load_bert_config
from ftengine.models.bert import Batch, BertRunner, padded_arrays
from tests.tolerances import EMBEDDING_COSINE_LOWP, GPU_FP32_REL, LOWP_ERROR_FACTOR
from weights.fixtures import write_bert_checkpoint

pytestmark = pytest.mark.gpu

CONFIGS = {  # name -> (fixture config, layouts)
    "bert-base": (dict(hidden=768, layers=12, heads=12, intermediate=3072, max_positions=512), ["packed", "padded"]),
    "small-odd": (dict(hidden=200, layers=2, heads=4, intermediate=803, max_positions=160, hidden_act="gelu_new"), ["padded"]),
    "minilm-shaped": (dict(hidden=384, layers=3, heads=12, intermediate=1536, max_positions=512, type_vocab=1), ["packed", "padded"]),
    "head-dim-128": (dict(hidden=256, layers=2, heads=2, intermediate=700, max_positions=512), ["packed"]),
}
CASES = [(name, layout) for name, (_, layouts) in CONFIGS.items() for layout in layouts]
LENGTHS = [128, 1, 77, 3, 128, 64, 31, 100]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = write_bert_checkpoint(tmp_path_factory.mktemp(name), seed=11, **CONFIGS[name][0])
        return made[name]
    return get


def _batch(config, rng, lengths=LENGTHS):
    return Batch.from_lists([rng.integers(0, config.vocab_size, n).tolist() for n in lengths],
                 [rng.integers(0, config.type_vocab_size, n).tolist() for n in lengths])


def _hf_hidden(path, batch, dtype):
    """HF hidden states, one (length, H) float32 array per sequence."""
    import torch
    from transformers import BertModel
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    m = BertModel.from_pretrained(str(path), attn_implementation="eager").eval().cuda()
    m = m.to({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    lengths = batch.lengths
    ids, types, _ = padded_arrays(batch, b=len(lengths), s=int(lengths.max()), pad_id=0)
    mask = (np.arange(ids.shape[1])[None] < lengths[:, None]).astype(np.int64)
    with torch.no_grad():
        out = m(input_ids=torch.from_numpy(ids.astype(np.int64)).cuda(),
                token_type_ids=torch.from_numpy(types.astype(np.int64)).cuda(),
                attention_mask=torch.from_numpy(mask).cuda()).last_hidden_state
    out = out.float().cpu().numpy()
    return [out[i, :n] for i, n in enumerate(lengths)]


def _runner(path, ops, dtype, layout, graphs=True):
    config = load_bert_config(path)
    return BertRunner(config, load_bert_weights(path, config), ops, dtype=dtype,
                      max_batch_tokens=4096, max_seq_len=128, layout=layout, graphs=graphs)


def _max_err(a, b):
    return max(np.abs(x - y).max() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def cu():
    from ftengine.backends.cuda import ops
    return ops


@pytest.mark.parametrize("name, layout", CASES)
def test_fp32_matches_hf_and_numpy(checkpoints, cu, name, layout):
    path = checkpoints(name)
    rng = np.random.default_rng(5)
    runner = _runner(path, cu, "fp32", layout)
    batch = _batch(runner.config, rng)
    ours = runner.hidden_states(batch)
    hf = _hf_hidden(path, batch, "fp32")
    scale = max(1.0, max(np.abs(x).max() for x in hf))
    assert _max_err(ours, hf) / scale <= GPU_FP32_REL, name
    reference = _runner(path, numpy_ops, "fp32", layout).hidden_states(batch)
    assert _max_err(ours, reference) / scale <= GPU_FP32_REL, name


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name, layout", CASES)
def test_low_precision_error_at_most_twice_hf(checkpoints, cu, name, layout, dtype):
    """Stress weights (large, sharp attention): our fp16/bf16 error against HF fp32 is at most
    twice HF's own error in the same dtype."""
    path = checkpoints(name)
    rng = np.random.default_rng(6)
    runner = _runner(path, cu, dtype, layout)
    batch = _batch(runner.config, rng)
    ours = runner.hidden_states(batch)
    exact = _hf_hidden(path, batch, "fp32")
    ours_err = _max_err(ours, exact)
    hf_err = _max_err(_hf_hidden(path, batch, dtype), exact)
    assert ours_err <= LOWP_ERROR_FACTOR * hf_err, f"{name} {layout} {dtype}: ours {ours_err:.3g} vs HF {hf_err:.3g}"


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_low_precision_embeddings_cosine(tmp_path, cu, dtype, layout):
    """HF-style random weights (what a real model looks like): pooled, normalised fp16/bf16
    embeddings keep cosine >= 0.9999 with HF fp32's."""
    path = write_bert_checkpoint(tmp_path, seed=12, init="hf", **CONFIGS["bert-base"][0])
    rng = np.random.default_rng(8)
    runner = _runner(path, cu, dtype, layout)
    batch = _batch(runner.config, rng)
    means = np.stack([x.mean(0) for x in _hf_hidden(path, batch, "fp32")])
    ref = means / np.linalg.norm(means, axis=1, keepdims=True)
    cos = (runner.embed(batch, pooling=("mean",), normalize=True) * ref).sum(1)
    assert cos.min() >= EMBEDDING_COSINE_LOWP, f"{dtype} {layout}: cosine {cos.min()}"


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("name, layout", CASES)
def test_graphs_on_and_off_identical(checkpoints, cu, name, layout, dtype):
    path = checkpoints(name)
    rng = np.random.default_rng(7)
    on, off = _runner(path, cu, dtype, layout, graphs=True), _runner(path, cu, dtype, layout, graphs=False)
    for _ in range(2):  # first call captures, second replays
        batch = _batch(on.config, rng)
        modes = ("cls", "mean", "max")
        np.testing.assert_array_equal(on.embed(batch, pooling=modes, normalize=True),
                                      off.embed(batch, pooling=modes, normalize=True))
        for a, b in zip(on.hidden_states(batch), off.hidden_states(batch)):
            np.testing.assert_array_equal(a, b)


def test_batches_in_flight_reuse_host_buffers(checkpoints, cu):
    """Batches submitted back to back (two on the device at once, results waited for late and out
    of order, outputs growing and shrinking) each get their own embeddings: the host buffers and
    events a slot reuses never mix two batches."""
    path = checkpoints("minilm-shaped")
    rng = np.random.default_rng(12)
    runner = _runner(path, cu, "fp32", "packed")
    reference = _runner(path, numpy_ops, "fp32", "packed")
    batches = [_batch(runner.config, rng, lengths) for lengths in
               ([5, 9], list(range(1, 41)), [128], [3] * 30, [77, 1, 64], [2])]
    modes = ("mean", "cls")
    pending = [runner.submit(batch, pooling=modes, normalize=False) for batch in batches]
    for i in (5, 0, 3, 1, 4, 2):
        expected = reference.embed(batches[i], pooling=modes, normalize=False)
        got = pending[i].wait()
        assert got.shape == expected.shape
        scale = max(1.0, np.abs(expected).max())
        assert np.abs(got - expected).max() / scale <= GPU_FP32_REL, f"batch {i}"
        assert pending[i].device_seconds > 0


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_large_batch_low_precision_error_at_most_twice_hf(checkpoints, cu, dtype):
    """A batch large enough for the fused wgmma product of the FFN up-projection on sm_90
    (ops.matmul_bias_gelu; 40 x 128 tokens, 15.7 M outputs of BERT-base's 3,072): our error against
    HF fp32 at most LOWP_ERROR_FACTOR times HF's own in that dtype, as for small batches."""
    path = checkpoints("bert-base")
    rng = np.random.default_rng(13)
    config = load_bert_config(path)
    runner = BertRunner(config, load_bert_weights(path, config), cu, dtype=dtype, max_batch_tokens=8192,
                        max_seq_len=128)
    batch = _batch(config, rng, [128] * 40)
    assert 128 * 40 * config.intermediate_size >= gemm.WGMMA_GELU_MIN_OUTPUTS
    exact = _hf_hidden(path, batch, "fp32")
    hf_err = _max_err(_hf_hidden(path, batch, dtype), exact)
    assert _max_err(runner.hidden_states(batch), exact) <= LOWP_ERROR_FACTOR * hf_err


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_large_minilm_batch_low_precision_error_at_most_twice_hf(checkpoints, cu, dtype):
    """A batch of all-MiniLM-L6-v2's width (384) large enough for the product + residual LayerNorm
    kernel on sm_90 (ops.matmul_bias_residual_layernorm's gemm_sm90.cu matmul_wgmma_ln: the
    attention output and the FFN down-projection, 65 x 128 tokens): our error against HF fp32 at
    most LOWP_ERROR_FACTOR times HF's own in that dtype, as for small batches."""
    path = checkpoints("minilm-shaped")
    rng = np.random.default_rng(14)
    config = load_bert_config(path)
    runner = BertRunner(config, load_bert_weights(path, config), cu, dtype=dtype, max_batch_tokens=65 * 128,
                        max_seq_len=128)
    batch = _batch(config, rng, [128] * 65)
    assert 128 * 65 >= gemm.WGMMA_LN_MIN_ROWS and config.hidden_size <= gemm.LN_CLUSTER_MAX * gemm.WGMMA_LN_TILE[0]
    exact = _hf_hidden(path, batch, "fp32")
    hf_err = _max_err(_hf_hidden(path, batch, dtype), exact)
    assert _max_err(runner.hidden_states(batch), exact) <= LOWP_ERROR_FACTOR * hf_err


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_packed_and_padded_agree(checkpoints, cu, dtype):
    """Both layouts compute the same function; they differ by rounding only, which stays
    within the low-precision bound against HF fp32 used above."""
    path = checkpoints("bert-base")
    rng = np.random.default_rng(9)
    packed, padded = _runner(path, cu, dtype, "packed"), _runner(path, cu, dtype, "padded")
    batch = _batch(packed.config, rng)
    exact = _hf_hidden(path, batch, "fp32")
    hf_err = _max_err(_hf_hidden(path, batch, dtype), exact)
    assert _max_err(packed.hidden_states(batch), padded.hidden_states(batch)) <= 2 * LOWP_ERROR_FACTOR * hf_err


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_single_token_and_all_different_lengths(checkpoints, cu, layout):
    path = checkpoints("minilm-shaped")
    rng = np.random.default_rng(10)
    runner = _runner(path, cu, "fp32", layout)
    for lengths in ([1], list(range(1, 65))):
        batch = _batch(runner.config, rng, lengths)
        hf = _hf_hidden(path, batch, "fp32")
        scale = max(1.0, max(np.abs(x).max() for x in hf))
        assert _max_err(runner.hidden_states(batch), hf) / scale <= GPU_FP32_REL


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_long_sequences_with_a_longer_position_table(tmp_path, cu, dtype):
    """1024 and 2048 tokens (a 2048-entry position table): packed layout against HF."""
    path = write_bert_checkpoint(tmp_path, seed=13, hidden=128, layers=2, heads=2, intermediate=256,
                                 max_positions=2048)
    config = load_bert_config(path)
    runner = BertRunner(config, load_bert_weights(path, config), cu, dtype=dtype,
                        max_batch_tokens=4096, max_seq_len=2048, layout="packed")
    batch = _batch(config, np.random.default_rng(14), [2048, 1024, 5])
    ours = runner.hidden_states(batch)
    exact = _hf_hidden(path, batch, "fp32")
    if dtype == "fp32":
        scale = max(1.0, max(np.abs(x).max() for x in exact))
        assert _max_err(ours, exact) / scale <= GPU_FP32_REL
    else:
        assert _max_err(ours, exact) <= LOWP_ERROR_FACTOR * _max_err(_hf_hidden(path, batch, dtype), exact)


def test_encoder_api_on_cuda_matches_cpu(tmp_path):
    st_model = write_bert_checkpoint(
        tmp_path, seed=2, init="hf", hidden=384, layers=3, heads=6, intermediate=1536, max_positions=128,
        sentence_transformers={"pooling": {"pooling_mode_mean_tokens": True}, "normalize": True})
    texts = ["the quick brown fox", "", "hello world " * 20, "a", "lazy dog and the fox"] * 7
    cpu = Encoder.from_pretrained(st_model, device="cpu").encode(texts)
    for layout in ("packed", "padded"):
        gpu32 = Encoder.from_pretrained(st_model, device="cuda", dtype="fp32", layout=layout).encode(texts, batch_tokens=256)
        assert np.abs(cpu - gpu32).max() <= GPU_FP32_REL, layout
        for dtype in ("fp16", "bf16"):
            low = Encoder.from_pretrained(st_model, device="cuda", dtype=dtype, layout=layout).encode(texts)
            assert ((low * cpu).sum(1)).min() >= EMBEDDING_COSINE_LOWP, (dtype, layout)


def test_cli_device_cuda(st_model, tmp_path):
    from click.testing import CliRunner
    from cli import main
    src = tmp_path / "in.txt"
    src.write_text("hello world\n\nthe fox\n")
    out = tmp_path / "e.npy"
    r = CliRunner().invoke(main, ["encode", str(src), "-o", str(out), "--model", str(st_model), "--device", "cuda"])
    assert r.exit_code == 0, r.stderr
    assert np.load(out).shape == (3, 32) and "on cuda (fp16)" in r.stderr
