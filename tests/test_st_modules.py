"""sentence-transformers features read from the model folder and asked for per call: prompts,
truncate_dim (dimensions), and output precision; checked against sentence-transformers itself
(SentenceTransformer.encode, quantize_embeddings) on small random checkpoints."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from ftengine import Encoder
from ftengine.errors import ConfigError, InputError
from ftengine.output import calibration_ranges, quantize
from tests.tolerances import BATCHING_INVARIANCE_FP32, EMBEDDING_COSINE_FP32
from weights.fixtures import write_bert_checkpoint, write_encoder_checkpoint, write_modernbert_checkpoint

st = pytest.importorskip("sentence_transformers")

PROMPTS = {"query": "query: ", "passage": "passage: "}
TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world, this is a line of text!", "a",
         "what some of them had was all there " * 3, "one word", "text line with it"]
EXE = str(Path(sys.executable).with_name("ftengine"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An XLM-R folder shaped like multilingual-e5: mean pooling, Normalize, query/passage prompts."""
    return write_encoder_checkpoint(
        tmp_path_factory.mktemp("e5"), "xlm-roberta", seed=8, hidden=64, heads=2, layers=2, intermediate=150,
        init="hf", sentence_transformers={
            "pooling": {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True},
            "normalize": True, "max_seq_length": 64, "prompts": PROMPTS, "default_prompt_name": "query"})


@pytest.fixture(scope="module")
def encoder(folder):
    with Encoder.from_pretrained(folder, device="cpu") as enc:
        yield enc


@pytest.fixture(scope="module")
def reference(folder):
    return st.SentenceTransformer(str(folder), device="cpu")


def cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("kwargs", [{}, {"prompt_name": "passage"}, {"prompt": "custom instruction: "},
                                    {"prompt": ""}])
def test_prompts_as_sentence_transformers(encoder, reference, kwargs):
    ours = encoder.encode(TEXTS, **kwargs)
    ref = reference.encode(TEXTS, **kwargs)
    assert cosines(ours, ref).min() >= EMBEDDING_COSINE_FP32
    if kwargs.get("prompt") == "":  # no prompt at all differs from the default (query) prompt
        assert cosines(ours, encoder.encode(TEXTS)).min() < EMBEDDING_COSINE_FP32


def test_default_prompt_reaches_stream_and_async(encoder):
    import asyncio
    expected = encoder.encode(TEXTS)
    streamed = np.concatenate(list(encoder.encode_stream(iter(TEXTS), window=2)))
    awaited = asyncio.run(encoder.encode_async(TEXTS))
    assert cosines(streamed, expected).min() >= EMBEDDING_COSINE_FP32
    assert cosines(awaited, expected).min() >= EMBEDDING_COSINE_FP32


@pytest.mark.parametrize("dim", [8, 33, 64])
def test_dimensions_as_truncate_dim(folder, encoder, dim):
    ref = st.SentenceTransformer(str(folder), device="cpu", truncate_dim=dim).encode(TEXTS)
    ours = encoder.encode(TEXTS, dimensions=dim)
    assert ours.shape == ref.shape == (len(TEXTS), dim)
    assert np.abs(ours - ref).max() <= 1e-5  # truncated after normalising: not unit norm, like ST's


def _levels_agree(ours, ref, precision, floats=None, ranges=None):
    """Equal, except (int8/uint8) one level apart where sentence-transformers' float lies within
    float rounding of a level boundary (ours and its floats differ by rounding)."""
    ours, ref = ours.astype(np.int32), ref.astype(np.int32)
    if precision.endswith("binary"):
        return np.array_equal(ours, ref)
    level = (floats - ranges[0]) / ((ranges[1] - ranges[0]) / 255)
    on_boundary = np.abs(level - np.round(level)) < 1e-3
    return np.abs(ours - ref).max() <= 1 and on_boundary[ours != ref].all()


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
def test_precision_as_quantize_embeddings(encoder, reference, precision):
    from sentence_transformers.util.quantization import quantize_embeddings
    floats = reference.encode(TEXTS * 5)
    calibration = reference.encode([t[::-1] for t in TEXTS] * 3)
    ranges = calibration_ranges(calibration)
    given = None if precision.endswith("binary") else ranges
    # the function on the very same floats: identical to sentence-transformers'
    st_q = quantize_embeddings(floats, precision, calibration_embeddings=calibration)
    assert np.array_equal(quantize(floats, precision, given), st_q) and quantize(floats, precision, given).dtype == st_q.dtype
    if not precision.endswith("binary"):  # ranges from the embeddings themselves, as ST does without any
        assert np.array_equal(quantize(floats, precision, calibration_ranges(floats)),
                              quantize_embeddings(floats, precision))
    # end to end
    ours = encoder.encode(TEXTS * 5, precision=precision, ranges=given)
    assert ours.dtype == st_q.dtype and ours.shape == st_q.shape
    assert _levels_agree(ours, st_q, precision, floats, ranges)


def test_bad_options_are_named(encoder):
    with pytest.raises(InputError, match=r"prompt_name 'doc' is not one of this model's prompts: 'query', 'passage'"):
        encoder.encode(TEXTS, prompt_name="doc")
    with pytest.raises(InputError, match=r"dimensions must be an integer within 1\.\.64, found 65"):
        encoder.encode(TEXTS, dimensions=65)
    with pytest.raises(InputError, match=r"precision 'int4' is not one of float32, int8, uint8, binary, ubinary"):
        encoder.encode(TEXTS, precision="int4")
    with pytest.raises(InputError, match=r"ranges must have shape \(2, 8\)"):
        encoder.encode(TEXTS, precision="int8", dimensions=8, ranges=np.zeros((2, 64)))
    with pytest.raises(InputError, match="needs ranges, or at least two embeddings"):
        encoder.encode(TEXTS[:1], precision="uint8")
    with pytest.raises(InputError, match="precision int8 on a stream needs ranges"):
        encoder.encode_stream(iter(TEXTS), precision="int8")


@pytest.mark.parametrize("change, message", [
    (("1_Pooling/config.json", {"include_prompt": "no"}), "include_prompt must be true or false, found 'no'"),
    (("config_sentence_transformers.json", {"default_prompt_name": "doc"}),
     "default_prompt_name 'doc' is not one of the prompts (query, passage)"),
    (("config_sentence_transformers.json", {"prompts": {"query": 5}}), "prompts must map names to strings"),
])
def test_folder_refusals_name_the_file(tmp_path, change, message):
    path = write_encoder_checkpoint(tmp_path, "xlm-roberta", hidden=64, heads=2, sentence_transformers={
        "pooling": {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}, "prompts": PROMPTS})
    name, values = change
    cfg = json.loads((path / name).read_text())
    cfg.update(values)
    (path / name).write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        Encoder.from_pretrained(path, device="cpu")
    assert str(path / name) in str(e.value) and message in str(e.value)


def _cli(*args):
    return subprocess.run([EXE, "encode", "--device", "cpu", "--quiet", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def test_cli_prompt_dimensions_precision(folder, reference, tmp_path):
    from sentence_transformers.util.quantization import quantize_embeddings
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "out.npy"
    done = _cli(src, "-o", out, "--model", folder, "--prompt-name", "passage", "--dimensions", 32,
                "--precision", "ubinary")
    assert done.returncode == 0, done.stderr
    ref = quantize_embeddings(reference.encode(TEXTS, prompt_name="passage")[:, :32], "ubinary")
    got = np.load(out)
    assert got.dtype == np.uint8 and np.array_equal(got, ref)
    calibration = tmp_path / "calibration.npy"
    np.save(calibration, reference.encode([t[::-1] for t in TEXTS] * 3))
    done = _cli(src, "-o", tmp_path / "q.npy", "--model", folder, "--precision", "int8", "--calibration", calibration)
    assert done.returncode == 0, done.stderr
    floats = reference.encode(TEXTS)
    ref = quantize_embeddings(floats, "int8", calibration_embeddings=np.load(calibration))
    assert _levels_agree(np.load(tmp_path / "q.npy"), ref, "int8", floats, calibration_ranges(np.load(calibration)))


@pytest.mark.parametrize("args, message", [
    (["--precision", "int8"], "--precision int8 needs --ranges FILE.npy or --calibration FILE.npy"),
    (["--precision", "binary", "--ranges", "r.npy"], "--ranges and --calibration apply to int8 and uint8 only"),
    (["--prompt-name", "doc"], "prompt_name 'doc' is not one of this model's prompts"),
    (["--precision", "uint8", "--ranges", "missing.npy"], "cannot read missing.npy: No such file"),
])
def test_cli_refusals(folder, tmp_path, args, message):
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\n")
    done = _cli(src, "-o", tmp_path / "out.npy", "--model", folder, *args)
    assert done.returncode == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / "out.npy").exists()


def test_serve_prompt_name(folder, encoder):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from tests.test_serve import Server
    server = Server(folder)
    try:
        r = httpx.post(server.url + "/embed", json={"inputs": TEXTS, "prompt_name": "passage"})
        assert r.status_code == 200
        assert cosines(r.json(), encoder.encode(TEXTS, prompt_name="passage")).min() >= EMBEDDING_COSINE_FP32
        r = httpx.post(server.url + "/embed", json={"inputs": TEXTS, "prompt_name": "doc"})
        assert r.status_code == 422 and "prompt_name 'doc' is not one of this model's prompts" in r.json()["error"]
        info = httpx.get(server.url + "/info").json()
        assert info["prompts"] == ["passage", "query"] and info["default_prompt_name"] == "query"
    finally:
        assert server.stop()[0] == 0


@pytest.mark.parametrize("pooling", [{"pooling_mode_weightedmean_tokens": True},
                                     {"pooling_mode_mean_tokens": True, "pooling_mode_weightedmean_tokens": True,
                                      "pooling_mode_lasttoken": True}])
def test_weightedmean_pooling_as_sentence_transformers(tmp_path, pooling):
    path = write_encoder_checkpoint(tmp_path, "roberta", seed=2, hidden=64, heads=2, init="hf", sentence_transformers={
        "pooling": {"word_embedding_dimension": 64, **pooling}, "normalize": False, "max_seq_length": 64})
    ref = st.SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    with Encoder.from_pretrained(path, device="cpu") as enc:
        ours = enc.encode(TEXTS)
    assert ours.shape == ref.shape and cosines(ours, ref).min() >= EMBEDDING_COSINE_FP32


def test_modernbert_folder_as_sentence_transformers(tmp_path):
    """A modernbert-embed-style folder: mean pooling, Normalize, query / document prompts."""
    path = write_modernbert_checkpoint(tmp_path, seed=2, max_positions=512, sentence_transformers={
        "pooling": {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}, "normalize": True,
        "max_seq_length": 512, "prompts": {"query": "search_query: ", "document": "search_document: "}})
    model = st.SentenceTransformer(str(path), device="cpu")
    texts = TEXTS + ["word " * 200]  # past the local window
    with Encoder.from_pretrained(path, device="cpu") as enc:
        for kwargs in ({}, {"prompt_name": "query"}):
            ours, ref = enc.encode(texts, **kwargs), model.encode(texts, **kwargs)
            assert ours.shape == ref.shape and cosines(ours, ref).min() >= EMBEDDING_COSINE_FP32


@pytest.mark.parametrize("model_type, pooling", [
    ("xlm-roberta", {"pooling_mode_mean_tokens": True}),
    ("bert", {"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True}),
    ("modernbert", {"pooling_mode": ["weightedmean", "lasttoken", "mean_sqrt_len_tokens"]}),  # ST 5+ key
])
def test_include_prompt_false_as_sentence_transformers(tmp_path, model_type, pooling):
    """include_prompt=false: the prompt's tokens (the prompt tokenised alone, less a trailing
    special token) are left out of pooling, for every mode, as sentence-transformers does."""
    files = {"pooling": {"word_embedding_dimension": 64, "include_prompt": False, **pooling}, "normalize": True,
             "max_seq_length": 64, "prompts": {"query": "query: find the", "long": "word " * 70}}
    if model_type == "modernbert":
        path = write_modernbert_checkpoint(tmp_path, seed=3, max_positions=64, sentence_transformers=files)
    elif model_type == "bert":
        path = write_bert_checkpoint(tmp_path, seed=3, hidden=64, heads=2, layers=2, intermediate=100,
                                     sentence_transformers=files)
    else:
        path = write_encoder_checkpoint(tmp_path, model_type, seed=3, hidden=64, heads=2, init="hf",
                                        sentence_transformers=files)
    model = st.SentenceTransformer(str(path), device="cpu")
    with Encoder.from_pretrained(path, device="cpu") as enc:
        for kwargs in ({}, {"prompt_name": "query"}, {"prompt": "a custom prompt, "}):
            ours, ref = enc.encode(TEXTS, **kwargs), model.encode(TEXTS, **kwargs)
            assert cosines(ours, ref).min() >= EMBEDDING_COSINE_FP32, kwargs
        with_prompt = enc.encode(TEXTS, prompt_name="query")
        assert cosines(with_prompt, enc.encode(TEXTS)).min() < EMBEDDING_COSINE_FP32  # the prompt still counts
        streamed = np.concatenate(list(enc.encode_stream(iter(TEXTS), prompt_name="query", window=4)))
        assert np.abs(streamed - with_prompt).max() <= BATCHING_INVARIANCE_FP32
        calls = [{"prompt_name": "query"}, {}, {"prompt": "a custom prompt, "}] * 4
        expected = [enc.encode(TEXTS, **kwargs) for kwargs in calls]
        with ThreadPoolExecutor(6) as pool:  # calls with different prompts (different pooling skips) at once
            got = list(pool.map(lambda kwargs: enc.encode(TEXTS, **kwargs), calls))
        assert all(np.abs(g - e).max() <= BATCHING_INVARIANCE_FP32 for g, e in zip(got, expected))
        assert np.isfinite(enc.encode(TEXTS, prompt_name="long")).all()  # no token past the prompt: zeros


TANH, IDENTITY, RELU = ("torch.nn.modules.activation.Tanh", "torch.nn.modules.linear.Identity",
                        "torch.nn.modules.activation.ReLU")


@pytest.mark.parametrize("dense, normalize", [
    ([{"out_features": 48, "activation": TANH, "bias": True}], True),          # LaBSE / distiluse style
    ([{"out_features": 96, "activation": IDENTITY, "bias": False}], False),
    ([{"out_features": 80, "activation": RELU, "bias": True},
      {"out_features": 24, "activation": TANH, "bias": True}], True),
])
def test_dense_modules_as_sentence_transformers(tmp_path, dense, normalize):
    path = write_encoder_checkpoint(tmp_path, "distilbert", seed=5, hidden=64, heads=2, init="hf",
                                    sentence_transformers={"pooling": {"word_embedding_dimension": 64,
                                                                       "pooling_mode_mean_tokens": True},
                                                           "normalize": normalize, "dense": dense})
    ref = st.SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    with Encoder.from_pretrained(path, device="cpu") as enc:
        ours = enc.encode(TEXTS)
        assert enc.dim == dense[-1]["out_features"] == ours.shape[1] == ref.shape[1]
        assert enc.encode(TEXTS, dimensions=8).shape == (len(TEXTS), 8)
        with pytest.raises(InputError, match=r"pooling cls,mean gives 128 values; the model's Dense module takes 64"):
            enc.encode(TEXTS, pooling="cls,mean")
    assert cosines(ours, ref).min() >= EMBEDDING_COSINE_FP32 and np.abs(ours - ref).max() <= 1e-5


def test_dense_module_refusals(tmp_path):
    path = write_encoder_checkpoint(tmp_path, "roberta", hidden=64, heads=2, sentence_transformers={
        "pooling": {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True},
        "dense": [{"out_features": 8, "activation": "mypackage.Swish", "bias": True}]})
    with pytest.raises(ConfigError, match=r"2_Dense/config.json: activation_function 'mypackage.Swish' is not supported"):
        Encoder.from_pretrained(path, device="cpu")
    cfg = json.loads((path / "2_Dense" / "config.json").read_text())
    (path / "2_Dense" / "config.json").write_text(json.dumps(dict(cfg, activation_function=TANH, in_features=65)))
    with pytest.raises(ConfigError, match=r"in_features 65 does not match the 64 values before it"):
        Encoder.from_pretrained(path, device="cpu")
    (path / "2_Dense" / "config.json").write_text(json.dumps(dict(cfg, activation_function=TANH)))
    (path / "2_Dense" / "model.safetensors").unlink()
    with pytest.raises(Exception, match=r"no \*\.safetensors weights in .*2_Dense"):
        Encoder.from_pretrained(path, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("include_prompt", [True, False])
def test_dense_weightedmean_and_prompts_on_the_gpu(tmp_path, dtype, include_prompt):
    """The whole sentence-transformers pipeline on the CUDA backend (weightedmean pooling, two
    Dense layers, Normalize, a prompt, in the pooling or left out) against SentenceTransformer
    on the same GPU in fp32."""
    from tests.tolerances import EMBEDDING_COSINE_LOWP
    path = write_encoder_checkpoint(tmp_path, "xlm-roberta", seed=6, hidden=256, heads=4, intermediate=700, init="hf",
                                    max_positions=128, sentence_transformers={
                                        "pooling": {"word_embedding_dimension": 256, "include_prompt": include_prompt,
                                                    "pooling_mode_weightedmean_tokens": True},
                                        "normalize": True, "prompts": PROMPTS, "dense": [
                                            {"out_features": 300, "activation": RELU, "bias": True},
                                            {"out_features": 128, "activation": TANH, "bias": True}]})
    ref = st.SentenceTransformer(str(path), device="cuda").encode(TEXTS * 8, prompt_name="passage")
    with Encoder.from_pretrained(path, device="cuda", dtype=dtype) as enc:
        ours = enc.encode(TEXTS * 8, prompt_name="passage")
    assert cosines(ours, ref).min() >= (EMBEDDING_COSINE_FP32 if dtype == "fp32" else EMBEDDING_COSINE_LOWP)
