"""Level 3 (GPU): the CUDA encoder against HF transformers on the same GPU and against the
NumPy backend, for every dtype; CUDA graphs on and off give identical results."""

import numpy as np
import pytest

from ftengine import Encoder
from ftengine.backends import numpy_ops
from ftengine.checkpoint import load_bert_weights
from ftengine.config import load_bert_config
from ftengine.models.bert import BertRunner, make_batch
from tests.tolerances import EMBEDDING_COSINE_LOWP, GPU_FP32_REL, LOWP_ERROR_FACTOR
from weights.fixtures import write_bert_checkpoint

pytestmark = pytest.mark.gpu

CONFIGS = {
    "bert-base": dict(hidden=768, layers=12, heads=12, intermediate=3072, max_positions=512),
    "small-odd": dict(hidden=200, layers=2, heads=4, intermediate=803, max_positions=160, hidden_act="gelu_new"),
    "minilm-shaped": dict(hidden=384, layers=3, heads=12, intermediate=1536, max_positions=512, type_vocab=1),
}
LENGTHS = [128, 1, 77, 3, 128, 64, 31, 100]


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request, tmp_path_factory):
    name = request.param
    return name, write_bert_checkpoint(tmp_path_factory.mktemp(name), seed=11, **CONFIGS[name])


def _batch(config, rng):
    ids = [rng.integers(0, config.vocab_size, n).tolist() for n in LENGTHS]
    types = [rng.integers(0, config.type_vocab_size, n).tolist() for n in LENGTHS]
    return make_batch(ids, types, pad_id=0)


def _hf_hidden(path, batch, dtype):
    import torch
    from transformers import BertModel
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    m = BertModel.from_pretrained(str(path), attn_implementation="eager").eval().cuda()
    m = m.to({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    mask = (np.arange(batch.ids.shape[1])[None] < batch.lengths[:, None]).astype(np.int64)
    with torch.no_grad():
        out = m(input_ids=torch.from_numpy(batch.ids.astype(np.int64)).cuda(),
                token_type_ids=torch.from_numpy(batch.token_types.astype(np.int64)).cuda(),
                attention_mask=torch.from_numpy(mask).cuda()).last_hidden_state
    return out.float().cpu().numpy()


def _runner(path, ops, dtype, graphs=True):
    config = load_bert_config(path)
    return BertRunner(config, load_bert_weights(path, config), ops, dtype=dtype,
                      max_batch_tokens=2048, max_seq_len=128, graphs=graphs)


def _real(batch):
    return np.arange(batch.ids.shape[1])[None, :] < batch.lengths[:, None]


@pytest.fixture(scope="module")
def cu():
    from ftengine.backends.cuda import ops
    return ops


def test_fp32_matches_hf_and_numpy(model, cu):
    name, path = model
    rng = np.random.default_rng(5)
    runner = _runner(path, cu, "fp32")
    batch = _batch(runner.config, rng)
    ours = runner.hidden_states(batch)
    real = _real(batch)
    hf = _hf_hidden(path, batch, "fp32")
    scale = max(1.0, np.abs(hf[real]).max())
    assert np.abs(ours - hf)[real].max() / scale <= GPU_FP32_REL, name
    reference = _runner(path, numpy_ops, "fp32").hidden_states(batch)
    assert np.abs(ours - reference)[real].max() / scale <= GPU_FP32_REL, name


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_low_precision_error_at_most_twice_hf(model, cu, dtype):
    """Stress weights (large, sharp attention): our fp16/bf16 error against HF fp32 is at most
    twice HF's own error in the same dtype."""
    name, path = model
    rng = np.random.default_rng(6)
    runner = _runner(path, cu, dtype)
    batch = _batch(runner.config, rng)
    real = _real(batch)
    ours = runner.hidden_states(batch)
    exact = _hf_hidden(path, batch, "fp32")
    hf_low = _hf_hidden(path, batch, dtype)
    ours_err = np.abs(ours - exact)[real].max()
    hf_err = np.abs(hf_low - exact)[real].max()
    assert ours_err <= LOWP_ERROR_FACTOR * hf_err, f"{name} {dtype}: ours {ours_err:.3g} vs HF {hf_err:.3g}"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_low_precision_embeddings_cosine(tmp_path, cu, dtype):
    """HF-style random weights (what a real model looks like): pooled, normalised fp16/bf16
    embeddings keep cosine >= 0.9999 with HF fp32's."""
    path = write_bert_checkpoint(tmp_path, seed=12, init="hf", **CONFIGS["bert-base"])
    rng = np.random.default_rng(8)
    runner = _runner(path, cu, dtype)
    batch = _batch(runner.config, rng)
    exact = _hf_hidden(path, batch, "fp32")
    mask = _real(batch)[:, :, None]
    mean = (exact * mask).sum(1) / batch.lengths[:, None]
    ref = mean / np.linalg.norm(mean, axis=1, keepdims=True)
    pooled = runner.embed(batch, pooling=("mean",), normalize=True)
    cos = (pooled * ref).sum(1)
    hf_low = _hf_hidden(path, batch, dtype)
    hf_mean = (hf_low * mask).sum(1) / batch.lengths[:, None]
    hf_cos = (hf_mean / np.linalg.norm(hf_mean, axis=1, keepdims=True) * ref).sum(1)
    assert cos.min() >= EMBEDDING_COSINE_LOWP, f"{dtype}: cosine {cos.min()} (HF {dtype}: {hf_cos.min()})"


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_graphs_on_and_off_identical(model, cu, dtype):
    _, path = model
    rng = np.random.default_rng(7)
    on, off = _runner(path, cu, dtype, graphs=True), _runner(path, cu, dtype, graphs=False)
    for _ in range(2):  # first call captures, second replays
        batch = _batch(on.config, rng)
        modes = ("cls", "mean", "max")
        a = on.embed(batch, pooling=modes, normalize=True)
        b = off.embed(batch, pooling=modes, normalize=True)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(on.hidden_states(batch), off.hidden_states(batch))


def test_encoder_api_on_cuda_matches_cpu(tmp_path):
    st_model = write_bert_checkpoint(
        tmp_path, seed=2, init="hf", hidden=384, layers=3, heads=6, intermediate=1536, max_positions=128,
        sentence_transformers={"pooling": {"pooling_mode_mean_tokens": True}, "normalize": True})
    texts = ["the quick brown fox", "", "hello world " * 20, "a", "lazy dog and the fox"] * 7
    cpu = Encoder.from_pretrained(st_model, device="cpu").encode(texts)
    gpu32 = Encoder.from_pretrained(st_model, device="cuda", dtype="fp32").encode(texts, batch_tokens=256)
    assert np.abs(cpu - gpu32).max() <= GPU_FP32_REL
    for dtype in ("fp16", "bf16"):
        low = Encoder.from_pretrained(st_model, device="cuda", dtype=dtype).encode(texts)
        assert ((low * cpu).sum(1)).min() >= EMBEDDING_COSINE_LOWP, dtype


def test_cli_device_cuda(st_model, tmp_path):
    from click.testing import CliRunner
    from cli import main
    src = tmp_path / "in.txt"
    src.write_text("hello world\n\nthe fox\n")
    out = tmp_path / "e.npy"
    r = CliRunner().invoke(main, ["encode", str(src), "-o", str(out), "--model", str(st_model), "--device", "cuda"])
    assert r.exit_code == 0, r.stderr
    assert np.load(out).shape == (3, 32) and "on cuda (fp16)" in r.stderr
