"""Reranker (cross-encoders) against sentence-transformers' CrossEncoder, for every encoder
family's ...ForSequenceClassification checkpoint; pairs tokenised as each tokenizer pairs them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ftengine import Reranker
from ftengine.errors import CheckpointError, InputError
from tests.tolerances import BATCHING_INVARIANCE_FP32, HF_FP32_MAX_ABS
from weights.fixtures import (ENCODER_TYPES, add_classification_head, write_bert_checkpoint, write_encoder_checkpoint,
                               write_modernbert_checkpoint)

st = pytest.importorskip("sentence_transformers")

QUERY = "what is a quick fox"
DOCS = ["the quick brown fox jumps over the lazy dog", "hello world", "dog " * 40, "", "a fox, a dog and a line"]
PAIRS = [(QUERY, d) for d in DOCS] + [("hello", "world"), ("the dog " * 30, "the fox " * 30)]
EXE = str(Path(sys.executable).with_name("ftengine"))


def cross_encoder(folder, model_type, num_labels=1):
    if model_type == "bert":
        write_bert_checkpoint(folder, seed=3, hidden=64, heads=2, layers=2, intermediate=100)
    elif model_type.startswith("modernbert"):  # "modernbert-cls": its head on the first token, else the mean
        write_modernbert_checkpoint(folder, seed=3, max_positions=64, local_attention=16)
        config = json.loads((folder / "config.json").read_text())
        config["classifier_pooling"] = model_type.partition("-")[2] or "mean"
        (folder / "config.json").write_text(json.dumps(config))
    else:
        write_encoder_checkpoint(folder, model_type, seed=3, hidden=64, heads=2, intermediate=100)
    return add_classification_head(folder, num_labels=num_labels, seed=4)


@pytest.mark.parametrize("num_labels", [1, 3])
@pytest.mark.parametrize("model_type", ("bert",) + ENCODER_TYPES + ("modernbert", "modernbert-cls"))
def test_predict_as_cross_encoder(tmp_path, model_type, num_labels):
    path = cross_encoder(tmp_path, model_type, num_labels)
    ref = st.CrossEncoder(str(path), device="cpu", max_length=64).predict(PAIRS)
    with Reranker.from_pretrained(path, device="cpu") as r:
        ours = r.predict(PAIRS)
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() <= HF_FP32_MAX_ABS and np.ptp(ref) > 0.1, model_type
        if num_labels == 1:
            logits = r.predict(PAIRS, activation=False)
            assert np.abs(1 / (1 + np.exp(-logits)) - ours).max() <= 1e-6


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_rank_as_cross_encoder(tmp_path, model_type):
    path = cross_encoder(tmp_path, model_type)
    ref = st.CrossEncoder(str(path), device="cpu", max_length=64).rank(QUERY, DOCS, top_k=3, return_documents=True)
    with Reranker.from_pretrained(path, device="cpu") as r:
        ours = r.rank(QUERY, DOCS, top_k=3, return_documents=True)
        assert [d["corpus_id"] for d in ours] == [d["corpus_id"] for d in ref]
        assert [d["text"] for d in ours] == [d["text"] for d in ref]
        assert np.allclose([d["score"] for d in ours], [d["score"] for d in ref], atol=HF_FP32_MAX_ABS)
        assert len(r.rank(QUERY, DOCS)) == len(DOCS)


def test_refusals(tmp_path):
    plain = write_bert_checkpoint(tmp_path / "plain", hidden=64, heads=2)
    with pytest.raises(CheckpointError, match="not a BERT sequence-classification"):
        Reranker.from_pretrained(plain, device="cpu")
    with Reranker.from_pretrained(cross_encoder(tmp_path / "three", "bert", 3), device="cpu") as r:
        with pytest.raises(InputError, match="rank needs a model with one score per pair; this one has 3 labels"):
            r.rank(QUERY, DOCS)
    with Reranker.from_pretrained(cross_encoder(tmp_path / "one", "roberta"), device="cpu") as r:
        with pytest.raises(InputError, match="pair 2 must be two strings"):
            r.predict([("a", "b"), ("a",)])
        with pytest.raises(InputError, match="top_k must be an integer >= 1, found 0"):
            r.rank(QUERY, DOCS, top_k=0)
        assert r.predict([]).shape == (0,)


def test_modernbert_head_tensors_are_checked(tmp_path):
    """A head bias the config does not have is named, not dropped; a masked-LM checkpoint is not a cross-encoder."""
    from safetensors.numpy import load_file, save_file
    path = cross_encoder(tmp_path / "ce", "modernbert")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["head.dense.bias"] = np.zeros(64, np.float32)  # the config says classifier_bias false
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) for a ModernBERT classification head: "
                                              r"head\.dense\.bias"):
        Reranker.from_pretrained(path, device="cpu")
    masked_lm = write_modernbert_checkpoint(tmp_path / "mlm", max_positions=64)
    with pytest.raises(CheckpointError, match=r"classifier\.weight, classifier\.bias missing: not a ModernBERT "
                                              r"sequence-classification"):
        Reranker.from_pretrained(masked_lm, device="cpu")


def test_cli_rerank(tmp_path):
    path = cross_encoder(tmp_path / "m", "distilbert")
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(DOCS) + "\n")
    done = subprocess.run([EXE, "rerank", "--model", str(path), "--device", "cpu", "--query", QUERY, str(docs),
                           "--top-k", "4"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    ref = st.CrossEncoder(str(path), device="cpu", max_length=64).rank(QUERY, DOCS, top_k=4)
    assert [r["index"] for r in rows] == [r["corpus_id"] for r in ref]
    assert np.allclose([r["score"] for r in rows], [r["score"] for r in ref], atol=HF_FP32_MAX_ABS)


@pytest.mark.parametrize("stop, code", [("terminated", 143), ("interrupted", 130)])
def test_cli_rerank_stopped_exits_as_a_stop_and_cancels_the_reranker(tmp_path, monkeypatch, stop, code):
    """rerank stops as encode and generate do: a Ctrl-C exits 130 and a SIGTERM 143 (bare or
    wrapped), one line, no traceback, no scores printed, the reranker closed with its work cancelled."""
    from click.testing import CliRunner

    from cli import main
    from tests.test_cli import raise_stop
    path = cross_encoder(tmp_path / "m", "distilbert")
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(DOCS) + "\n")
    closed = []
    close = Reranker.close
    monkeypatch.setattr(Reranker, "close",
                        lambda self, *, cancel=False: closed.append(cancel) or close(self, cancel=cancel))
    for wrapped in (False, True):
        monkeypatch.setattr(Reranker, "predict", lambda self, *a, **k: raise_stop(stop, wrapped=wrapped))
        r = CliRunner().invoke(main, ["rerank", "--model", str(path), "--device", "cpu", "--query", QUERY, str(docs)])
        assert r.exit_code == code and r.stderr.strip() == f"ftengine: {stop}" and r.stdout == "", r.output
    assert closed == [True, True]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta", "distilbert", "modernbert"])
def test_cuda_reranker_as_cross_encoder(tmp_path, model_type, dtype):
    """fp32: CrossEncoder's scores on the same GPU; fp16: an error at most LOWP_ERROR_FACTOR
    times CrossEncoder's own in fp16."""
    from tests.tolerances import LOWP_ERROR_FACTOR
    path = cross_encoder(tmp_path, model_type)
    model = st.CrossEncoder(str(path), device="cuda", max_length=64)
    exact = model.predict(PAIRS * 5)
    with Reranker.from_pretrained(path, device="cuda", dtype=dtype) as r:
        ours = r.predict(PAIRS * 5)
    if dtype == "fp32":
        assert np.abs(ours - exact).max() <= HF_FP32_MAX_ABS
    else:
        model.model.half()
        theirs = np.abs(model.predict(PAIRS * 5) - exact).max()
        assert np.abs(ours - exact).max() <= LOWP_ERROR_FACTOR * theirs


def test_predict_from_threads_equals_sequential(tmp_path):
    from concurrent.futures import ThreadPoolExecutor
    path = cross_encoder(tmp_path, "bert")
    calls = [[(f"{QUERY} {i}", d) for d in DOCS[i % len(DOCS):] + DOCS[:i % 3]] for i in range(24)]
    with Reranker.from_pretrained(path, device="cpu") as r:
        expected = [r.predict(c) for c in calls]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(r.predict, calls))
    for g, e in zip(got, expected):
        assert g.shape == e.shape and np.abs(g - e).max() <= BATCHING_INVARIANCE_FP32


def test_waiting_requests_share_one_tokenizer_call(tmp_path):
    """Pair requests queued while the engine's tokenizer thread is busy are tokenised in one call
    (a service's requests share it), each still getting its own scores; a bad request among them
    fails alone."""
    import threading
    path = cross_encoder(tmp_path, "xlm-roberta")  # one token type: the pairs' type ids are zeroed
    calls = [[(f"{QUERY} {i}", d) for d in DOCS[i % len(DOCS):]] for i in range(6)]
    with Reranker.from_pretrained(path, device="cpu") as r:
        expected = [r.predict(c) for c in calls]
        tokenizer = r._encoder.tokenizer
        encode_pairs, sizes, held = tokenizer.encode_pairs, [], threading.Event()

        def counted(pairs, **kwargs):
            sizes.append(len(pairs))
            held.wait(30)
            return encode_pairs(pairs, **kwargs)
        tokenizer.encode_pairs = counted
        first = r.submit_scores(calls[0])
        while not sizes:  # the tokenizer thread holds the first request
            threading.Event().wait(0.01)
        futures = [r.submit_scores(c) for c in calls[1:3]] + [r.submit_scores([("\ud800", "x")])]
        futures += [r.submit_scores(c) for c in calls[3:]]
        held.set()
        got = [r.finish_scores(f) for f in [first] + futures[:2] + futures[3:]]
        with pytest.raises(InputError, match="pair 1"):
            futures[2].result()
    assert sizes[:2] == [len(calls[0]), sum(map(len, calls[1:])) + 1]
    for g, e in zip(got, expected):
        assert g.shape == e.shape and np.abs(g - e).max() <= BATCHING_INVARIANCE_FP32
