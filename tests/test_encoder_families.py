"""RoBERTa, XLM-RoBERTa, CamemBERT, DistilBERT, MPNet and ModernBERT: the encoder (NumPy
reference, and CUDA where marked) against HF transformers' own classes, model level and through
the whole Encoder (each family's tokenizer kind, pooling) on small random checkpoints."""

import json

import numpy as np
import pytest

from ftengine import Encoder
from ftengine.backends import numpy_ops
from ftengine.checkpoint import load_bert_weights
from ftengine.config import SUPPORTED_BERT_TYPES, load_bert_config
from ftengine.errors import ConfigError
from ftengine.models.bert import Batch, BertRunner
from tests.tolerances import GPU_FP32_REL, HF_FP32_MAX_ABS, LOWP_ERROR_FACTOR
from weights.fixtures import ENCODER_TYPES, write_encoder_checkpoint, write_modernbert_checkpoint

SHAPES = {  # layout -> fixture shape (packed needs head_dim 32, 64 or 128)
    "packed": dict(hidden=64, layers=2, heads=2, intermediate=150),
    "padded": dict(hidden=40, layers=2, heads=5, intermediate=64, hidden_act="gelu_new"),
}
TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world, this is a line of text!", "a",
         "what some of them had was all there " * 12]


def _runner(path, ops, layout, dtype="fp32", max_batch_tokens=4096):
    config = load_bert_config(path)
    return BertRunner(config, load_bert_weights(path, config), ops, dtype=dtype, max_batch_tokens=max_batch_tokens,
                      max_seq_len=config.max_position_embeddings, layout=layout)


def _ids(rng, config, lengths):
    """Random ids without the pad id: RoBERTa's HF position ids skip pad ids wherever they are."""
    ids = [rng.integers(0, config.vocab_size - 1, n) for n in lengths]
    return [np.where(x >= config.pad_token_id, x + 1, x).tolist() for x in ids]


def _hf_hidden(path, ids, *, device="cpu", dtype="fp32"):
    import torch
    from transformers import AutoModel
    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModel.from_pretrained(str(path), attn_implementation="eager").eval().to(device)
    model = model.to({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    pad = model.config.pad_token_id
    s = max(len(x) for x in ids)
    padded = np.full((len(ids), s), pad, np.int64)
    mask = np.zeros((len(ids), s), np.int64)
    for i, x in enumerate(ids):
        padded[i, :len(x)], mask[i, :len(x)] = x, 1
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(padded).to(device),
                    attention_mask=torch.from_numpy(mask).to(device)).last_hidden_state
    out = out.float().cpu().numpy()
    return [out[i, :len(x)] for i, x in enumerate(ids)]


def _max_err(a, b):
    return max(np.abs(x - y).max() for x, y in zip(a, b))


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("model_type", ENCODER_TYPES)
def test_hidden_states_match_hf(tmp_path, rng, model_type, layout):
    path = write_encoder_checkpoint(tmp_path, model_type, seed=3, **SHAPES[layout])
    runner = _runner(path, numpy_ops, layout)
    ids = _ids(rng, runner.config, [1, 7, 64, 33, 2])  # up to the longest input the model takes
    ours = runner.hidden_states(Batch.from_lists(ids, [[0] * len(x) for x in ids]))
    ref = _hf_hidden(path, ids)
    assert max(np.abs(r).max() for r in ref) > 0.5
    assert _max_err(ours, ref) <= HF_FP32_MAX_ABS, model_type


@pytest.mark.parametrize("model_type", ENCODER_TYPES + ("modernbert",))
def test_encoder_matches_hf_tokenizer_model_and_pooling(tmp_path, model_type):
    """Texts through Encoder (the family's tokenizer.json) = HF AutoTokenizer + AutoModel + mean pooling."""
    import torch
    from transformers import AutoModel, AutoTokenizer
    if model_type == "modernbert":  # byte-level BPE, [CLS] ... [SEP]
        path = write_modernbert_checkpoint(tmp_path, seed=4, max_positions=512)
    else:
        path = write_encoder_checkpoint(tmp_path, model_type, seed=4, **SHAPES["packed"])
    with Encoder.from_pretrained(path, device="cpu") as enc:
        assert enc.layout == "packed"
        ours = enc.encode(TEXTS, pooling="mean", normalize=False)
        max_length = enc.max_length
    tok = AutoTokenizer.from_pretrained(str(path))
    inputs = tok(TEXTS, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    model = AutoModel.from_pretrained(str(path), attn_implementation="eager").eval()
    with torch.no_grad():
        hidden = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    mask = inputs["attention_mask"].unsqueeze(-1).float()
    ref = ((hidden * mask).sum(1) / mask.sum(1)).numpy()
    assert np.abs(ours - ref).max() <= HF_FP32_MAX_ABS, model_type


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("model_type", ["roberta", "mpnet"])
def test_pad_ids_inside_sequences_numbered_as_transformers(tmp_path, rng, model_type, layout):
    """A text holding the literal pad token: transformers gives that token row pad_token_id of
    the position table and does not count it; so must the encoder (model level, and through
    the tokenizer)."""
    import torch
    from transformers import AutoModel, AutoTokenizer
    shape = dict(SHAPES[layout], max_positions=64)
    path = write_encoder_checkpoint(tmp_path, model_type, seed=7, **shape)
    runner = _runner(path, numpy_ops, layout)
    pad = runner.config.pad_token_id
    ids = _ids(rng, runner.config, [9, 30, 5])
    ids[0][3] = ids[0][4] = ids[1][-1] = ids[2][0] = pad
    ours = runner.hidden_states(Batch.from_lists(ids, [[0] * len(x) for x in ids]))
    assert _max_err(ours, _hf_hidden(path, ids)) <= HF_FP32_MAX_ABS
    if model_type == "mpnet":  # its fixture tokenizer (WordPiece) has no token for id 1
        return
    texts = ["hello <pad> world", "<pad> the dog <pad><pad> a fox"]
    with Encoder.from_pretrained(path, device="cpu", layout=layout) as enc:
        embedded = enc.encode(texts, pooling="mean", normalize=False)
    inputs = AutoTokenizer.from_pretrained(str(path))(texts, padding=True, return_tensors="pt")
    assert (inputs["input_ids"][inputs["attention_mask"] == 1] == pad).sum() == 4
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(str(path), attn_implementation="eager").eval()(**inputs).last_hidden_state
    mask = inputs["attention_mask"].unsqueeze(-1).float()
    assert np.abs(embedded - ((hidden * mask).sum(1) / mask.sum(1)).numpy()).max() <= HF_FP32_MAX_ABS


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("model_type, changes, message", [
    ("distilbert", {"sinusoidal_pos_embds": True}, "sinusoidal_pos_embds=true is not supported"),
    ("distilbert", {"activation": "relu"}, "activation 'relu' is not supported; supported: gelu"),
    ("distilbert", {"dim": 33}, "dim 33 is not divisible by n_heads 2"),
    ("roberta", {"max_position_embeddings": 3}, "max_position_embeddings 3 leaves no positions after the first 2"),
    ("xlm-roberta", {"model_type": "deberta-v2"}, "model_type 'deberta-v2' is not supported by the encoder; "
                                                   "supported: " + ", ".join(SUPPORTED_BERT_TYPES)),
])
def test_config_refusals_name_file_and_key(tmp_path, model_type, changes, message):
    path = write_encoder_checkpoint(tmp_path, model_type, **SHAPES["packed"])
    _edit_config(path, **changes)
    with pytest.raises(ConfigError) as e:
        load_bert_config(path)
    assert str(path / "config.json") in str(e.value) and message in str(e.value)


def test_distilbert_weight_names_are_checked(tmp_path):
    from safetensors.numpy import load_file, save_file
    path = write_encoder_checkpoint(tmp_path, "distilbert", **SHAPES["packed"])
    tensors = load_file(str(path / "model.safetensors"))
    tensors["transformer.layer.1.ffn.lin3.weight"] = tensors.pop("transformer.layer.1.ffn.lin2.weight")
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(Exception, match=r"unexpected tensor\(s\) for a DistilBERT with 2 layers: "
                                        r"transformer\.layer\.1\.ffn\.lin3\.weight"):
        load_bert_weights(path, load_bert_config(path))


@pytest.fixture(scope="module")
def cu():
    from ftengine.backends.cuda import ops
    return ops


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("model_type", ENCODER_TYPES)
def test_cuda_matches_hf_on_the_gpu(tmp_path, cu, model_type, layout, dtype):
    shape = dict(hidden=256, layers=2, heads=4, intermediate=700) if layout == "packed" else SHAPES["padded"]
    path = write_encoder_checkpoint(tmp_path, model_type, seed=9, max_positions=512, **shape)
    _gpu_parity(cu, path, layout, dtype)


def _gpu_parity(cu, path, layout, dtype):
    _gpu_parity_runner(_runner(path, cu, layout, dtype), path, [512, 1, 77, 300, 3], dtype)


def _gpu_parity_runner(runner, path, lengths, dtype):
    """CUDA hidden states against HF on the GPU: fp32 within GPU_FP32_REL; fp16/bf16 with at
    most LOWP_ERROR_FACTOR times HF's own error in that dtype."""
    ids = _ids(np.random.default_rng(2), runner.config, lengths)
    ours = runner.hidden_states(Batch.from_lists(ids, [[0] * len(x) for x in ids]))
    exact = _hf_hidden(path, ids, device="cuda")
    if dtype == "fp32":
        scale = max(1.0, max(np.abs(x).max() for x in exact))
        assert _max_err(ours, exact) / scale <= GPU_FP32_REL
    else:
        assert _max_err(ours, exact) <= LOWP_ERROR_FACTOR * _max_err(_hf_hidden(path, ids, device="cuda", dtype=dtype),
                                                                     exact)


@pytest.mark.parametrize("model_type", ENCODER_TYPES)
def test_white_space_tokenised_as_transformers(tmp_path, model_type):
    """Leading, trailing, doubled and tab white space: the ids HF's tokenizer (what
    sentence-transformers uses; texts are not stripped) gives, for each tokenizer kind."""
    from transformers import AutoTokenizer
    path = write_encoder_checkpoint(tmp_path, model_type, **SHAPES["packed"])
    texts = ["  hello world ", "the\tquick  brown\n fox", " a", "dog  ", "   "]
    with Encoder.from_pretrained(path, device="cpu") as enc:
        ours = enc.tokenizer.encode(texts)
    ref = AutoTokenizer.from_pretrained(str(path))(texts)["input_ids"]
    assert [x.tolist() for x in np.split(ours.ids, np.cumsum(ours.lengths)[:-1])] == ref


# ---------------------------------------------------------------- MPNet (relative position bias)

MPNET_SHAPE = dict(hidden=64, layers=2, heads=2, intermediate=100, max_positions=300)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_mpnet_hidden_states_match_hf(tmp_path, rng, layout):
    """Lengths past the bias's max distance (128), ragged: the bucketed bias of every layer,
    added inside the fused attention (packed) or to the scores (padded)."""
    path = write_encoder_checkpoint(tmp_path, "mpnet", seed=5, **MPNET_SHAPE)
    runner = _runner(path, numpy_ops, layout)
    ids = _ids(rng, runner.config, [5, 300, 17, 140, 1])
    ours = runner.hidden_states(Batch.from_lists(ids, [[0] * len(x) for x in ids]))
    assert _max_err(ours, _hf_hidden(path, ids)) <= HF_FP32_MAX_ABS


def test_mpnet_encoder_and_layout(tmp_path):
    from ftengine.models.bert import relative_position_buckets
    import torch
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder
    path = write_encoder_checkpoint(tmp_path, "mpnet", seed=6, **MPNET_SHAPE)
    # the buckets against HF's own function, over every relative position of 300 tokens
    rel = torch.arange(-299, 300)
    assert np.array_equal(relative_position_buckets(300, 32), MPNetEncoder.relative_position_bucket(rel).numpy())
    with Encoder.from_pretrained(path, device="cpu") as enc:
        assert enc.layout == "packed"
        ours = enc.encode(TEXTS, pooling="mean", normalize=False)
        tokens = enc.tokenizer.encode(TEXTS)
    ids = [x.tolist() for x in np.split(tokens.ids, np.cumsum(tokens.lengths)[:-1])]
    ref = np.stack([h.mean(axis=0) for h in _hf_hidden(path, ids)])
    assert np.abs(ours - ref).max() <= HF_FP32_MAX_ABS


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_mpnet_cuda_matches_hf_on_the_gpu(tmp_path, cu, layout, dtype):
    path = write_encoder_checkpoint(tmp_path, "mpnet", seed=9, hidden=256, layers=2, heads=4, intermediate=700,
                                    max_positions=512)
    _gpu_parity(cu, path, layout, dtype)


# ---------------------------------------------------------------- ModernBERT (rotary, GeGLU, local windows)

# lengths past the local window (local_attention 32: |k - q| <= 16) and into the thousands
MODERNBERT_LENGTHS = {"packed": [1, 7, 64, 33, 2500, 300], "padded": [1, 40, 2500]}


@pytest.mark.parametrize("bias, style", [(False, "hub"), (True, "transformers5")])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_modernbert_hidden_states_match_hf(tmp_path, rng, layout, bias, style):
    """Bias-free (as the Hub's models) and with every bias; both config styles; global and local
    layers with their own rotary theta."""
    path = write_modernbert_checkpoint(tmp_path, seed=5, bias=bias, style=style)
    runner = _runner(path, numpy_ops, layout, max_batch_tokens=8192)
    config = runner.config
    assert config.local_layers == (False, True, True) and config.window == 16
    assert config.rotary_theta == (160000.0, 10000.0)
    ids = _ids(rng, config, MODERNBERT_LENGTHS[layout])
    ours = runner.hidden_states(Batch.from_lists(ids, [[0] * len(x) for x in ids]))
    ref = _hf_hidden(path, ids)
    assert max(np.abs(r).max() for r in ref) > 0.5
    assert _max_err(ours, ref) <= HF_FP32_MAX_ABS


@pytest.mark.parametrize("changes, message", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1.0}}},
     "rope_parameters['full_attention'] rope_type 'yarn' is not supported; supported: default"),
    ({"layer_types": ["full_attention"]}, "key 'layer_types' must list 3 of full_attention, sliding_attention"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported; supported: gelu"),
    ({"classifier_pooling": "max"}, "classifier_pooling 'max' is not supported; supported: cls, mean"),
    ({"local_attention": 1}, "key 'local_attention' must be >= 2, found 1"),
    ({"norm_bias": "no"}, "key 'norm_bias' must be bool, found 'no'"),
])
def test_modernbert_config_refusals_name_file_and_key(tmp_path, changes, message):
    path = write_modernbert_checkpoint(tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(ConfigError) as e:
        load_bert_config(path)
    assert str(path / "config.json") in str(e.value) and message in str(e.value)


def test_modernbert_bias_flags_decide_the_expected_tensors(tmp_path):
    """A checkpoint with biases under a config that says it has none: each is named."""
    path = write_modernbert_checkpoint(tmp_path, bias=True)
    _edit_config(path, attention_bias=False)
    with pytest.raises(Exception, match=r"unexpected tensor\(s\) for a ModernBERT with 3 layers: "
                                        r"layers\.0\.attn\.Wo\.bias"):
        load_bert_weights(path, load_bert_config(path))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_modernbert_cuda_matches_hf_on_the_gpu(tmp_path, cu, layout, dtype):
    """Up to 4096 tokens, the local window (64 each side) far smaller than the sequences."""
    path = write_modernbert_checkpoint(tmp_path, seed=9, hidden=256, layers=3, heads=4, intermediate=384,
                                       max_positions=4096, local_attention=128, bias=layout == "padded")
    runner = _runner(path, cu, layout, dtype, max_batch_tokens=8192)
    lengths = [4096, 1, 77, 1500, 3] if layout == "packed" else [1500, 1, 77, 3]
    _gpu_parity_runner(runner, path, lengths, dtype)


# ---------------------------------------------------------------- every family as sentence-transformers gives it

FAMILIES = ENCODER_TYPES + ("mpnet", "modernbert")
ST_TEXTS = TEXTS + ["The Quick, brown fox! " * 20, "  leading and trailing  ", "x"]


def _st_folder(tmp_path, model_type, hidden, heads, intermediate):
    files = {"pooling": {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True}, "normalize": True,
             "max_seq_length": 128}
    if model_type == "modernbert":
        return write_modernbert_checkpoint(tmp_path, seed=11, hidden=hidden, heads=heads, intermediate=intermediate,
                                           max_positions=512, sentence_transformers=files)
    return write_encoder_checkpoint(tmp_path, model_type, seed=11, hidden=hidden, heads=heads, intermediate=intermediate,
                                    max_positions=128, init="hf", sentence_transformers=files)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_embeddings_as_sentence_transformers(tmp_path, model_type):
    """A sentence-transformers folder of each family: Encoder on the CPU = SentenceTransformer.encode."""
    from tests.tolerances import EMBEDDING_COSINE_FP32
    st = pytest.importorskip("sentence_transformers")
    path = _st_folder(tmp_path, model_type, 64, 2, 96)
    ref = st.SentenceTransformer(str(path), device="cpu").encode(ST_TEXTS)
    with Encoder.from_pretrained(path, device="cpu") as enc:
        ours = enc.encode(ST_TEXTS)
    assert ours.shape == ref.shape and (ours * ref).sum(1).min() >= EMBEDDING_COSINE_FP32


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_embeddings_fp16_on_the_gpu(tmp_path, model_type):
    """fp16 on the GPU against SentenceTransformer in fp32 on the same GPU: cosine >= EMBEDDING_COSINE_LOWP."""
    from tests.tolerances import EMBEDDING_COSINE_LOWP
    st = pytest.importorskip("sentence_transformers")
    path = _st_folder(tmp_path, model_type, 256, 4, 700)
    ref = st.SentenceTransformer(str(path), device="cuda").encode(ST_TEXTS * 4)
    with Encoder.from_pretrained(path, device="cuda", dtype="fp16") as enc:
        ours = enc.encode(ST_TEXTS * 4)
    assert (ours * ref).sum(1).min() >= EMBEDDING_COSINE_LOWP
