"""Sequence classification against HF's text-classification pipeline on random
...ForSequenceClassification checkpoints of each family: the logits within 1e-4, the labels and
scores (softmax for single-label, sigmoid for multi-label or one logit) for texts and pairs,
every top_k; `ftengine classify`; and the service's TEI POST /predict."""

import json

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from ftengine import Classifier, InputError
from ftengine.cli import main
from tests.test_serve import Server
from tests.tolerances import BATCHING_INVARIANCE_FP32, HF_FP32_MAX_ABS
from weights.fixtures import add_classification_head, write_bert_checkpoint, write_encoder_checkpoint

transformers = pytest.importorskip("transformers")
TEXTS = ["the quick brown fox", "hello world, it was a dog", "a", "some other words were there when they had"]
PAIRS = [("a question", "an answer of some words"), ("hello", "world")]


def labelled(folder, labels, problem_type=None):
    config = json.loads((folder / "config.json").read_text())
    config["id2label"] = {str(i): name for i, name in enumerate(labels)}
    config["label2id"] = {name: i for i, name in enumerate(labels)}
    if problem_type:
        config["problem_type"] = problem_type
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=["bert", "roberta", "distilbert"])
def classifier_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"cls-{request.param}")
    if request.param == "bert":
        write_bert_checkpoint(folder, seed=5, max_positions=64)
    else:
        write_encoder_checkpoint(folder, request.param, seed=5)
    add_classification_head(folder, num_labels=3, seed=6)
    return labelled(folder, ["negative", "neutral", "positive"])


def pipeline(folder, top_k=None):
    return transformers.pipeline("text-classification", model=str(folder), tokenizer=str(folder), device="cpu",
                                 top_k=top_k)


def test_logits_and_labels_match_the_pipeline(classifier_model):
    import torch
    model = transformers.AutoModelForSequenceClassification.from_pretrained(classifier_model).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(classifier_model)
    with Classifier.from_pretrained(classifier_model, device="cpu") as classifier:
        logits, _ = classifier.logits(TEXTS)
        for i, text in enumerate(TEXTS):
            with torch.no_grad():
                ref = model(**tokenizer(text, return_tensors="pt")).logits[0].numpy()
            assert np.abs(logits[i] - ref).max() <= HF_FP32_MAX_ABS
        every = classifier.predict(TEXTS, top_k=None)
        expected = pipeline(classifier_model)(TEXTS)
        for got, ref in zip(every, expected):
            assert [g["label"] for g in got] == [r["label"] for r in ref]
            assert np.abs(np.array([g["score"] for g in got]) - [r["score"] for r in ref]).max() <= HF_FP32_MAX_ABS
        best = classifier.predict(TEXTS)
        assert [b["label"] for b in best] == [r[0]["label"] for r in expected]
        two = classifier.predict(TEXTS, top_k=2)
        assert [[x["label"] for x in t] for t in two] == [[x["label"] for x in r[:2]] for r in expected]
        pairs = classifier.predict(PAIRS, top_k=None)
        ref_pairs = pipeline(classifier_model)([{"text": a, "text_pair": b} for a, b in PAIRS])
        for got, ref in zip(pairs, ref_pairs):
            assert np.abs(np.array([g["score"] for g in got]) - [r["score"] for r in ref]).max() <= HF_FP32_MAX_ABS
        with pytest.raises(InputError, match="top_k must be"):
            classifier.predict(TEXTS, top_k=0)


def test_multi_label_and_one_logit_use_a_sigmoid(tmp_path):
    folder = add_classification_head(write_bert_checkpoint(tmp_path / "multi", seed=7, max_positions=64),
                                     num_labels=4, seed=8)
    labelled(folder, ["toxic", "obscene", "threat", "insult"], "multi_label_classification")
    with Classifier.from_pretrained(folder, device="cpu") as classifier:
        got = classifier.predict(TEXTS, top_k=None)
    ref = pipeline(folder)(TEXTS)
    for g, r in zip(got, ref):
        assert [x["label"] for x in g] == [x["label"] for x in r]
        assert np.abs(np.array([x["score"] for x in g]) - [x["score"] for x in r]).max() <= HF_FP32_MAX_ABS
    assert sum(x["score"] for x in got[0]) != pytest.approx(1.0)


def test_classify_command(classifier_model, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "body": t}) + "\n" for i, t in enumerate(TEXTS)))
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(main, ["classify", str(src), "-o", str(out), "--model", str(classifier_model), "--device",
                                  "cpu", "--text-field", "body", "--id-field", "id", "--top-k", "2"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    with Classifier.from_pretrained(classifier_model, device="cpu") as classifier:
        expected = classifier.predict(TEXTS, top_k=2)
    assert [row["id"] for row in rows] == [f"d{i}" for i in range(len(TEXTS))]
    assert [row["labels"] for row in rows] == expected
    r = CliRunner().invoke(main, ["classify", str(src), "--model", str(classifier_model), "--device", "cpu",
                                  "--text-field", "body", "--quiet"])
    assert r.exit_code == 0 and [json.loads(x)["label"] for x in r.stdout.splitlines()] == \
        [e[0]["label"] for e in expected]


def test_served_predict(classifier_model):
    with Classifier.from_pretrained(classifier_model, device="cpu") as classifier:
        expected = classifier.predict(TEXTS, top_k=None)
        logits, _ = classifier.logits(TEXTS)
    s = Server(classifier_model)
    try:
        one = httpx.post(s.url + "/predict", json={"inputs": TEXTS[0]}).json()
        assert [x["label"] for x in one] == [x["label"] for x in expected[0]]
        many = httpx.post(s.url + "/predict", json={"inputs": TEXTS}).json()
        for got, ref in zip(many, expected):
            assert np.abs(np.array([x["score"] for x in got]) - [x["score"] for x in ref]).max() <= HF_FP32_MAX_ABS
        raw = httpx.post(s.url + "/predict", json={"inputs": [TEXTS[1]], "raw_scores": True}).json()[0]
        assert np.abs(np.sort([x["score"] for x in raw])[::-1] - np.sort(logits[1])[::-1]).max() <= HF_FP32_MAX_ABS
        pair = httpx.post(s.url + "/predict", json={"inputs": [["a question", "an answer"]]})
        assert pair.status_code == 200 and len(pair.json()[0]) == 3
        one_pair = httpx.post(s.url + "/predict", json={"inputs": ["a question", "an answer"]}).json()  # TEI's rule
        assert one_pair == pair.json()[0]
        bad = httpx.post(s.url + "/predict", json={"inputs": [["a", "b", "c"]]})
        assert bad.status_code == 422 and "inputs[0]" in bad.json()["error"]
        assert httpx.post(s.url + "/embed", json={"inputs": "x"}).status_code == 404
        assert httpx.get(s.url + "/info").json()["model_type"]["classifier"]["id2label"]["2"] == "positive"
    finally:
        assert s.stop()[0] == 0


def test_classify_to_parquet(classifier_model, tmp_path):
    import pyarrow.parquet as pq
    src = tmp_path / "in.txt"
    src.write_text("".join(t + "\n" for t in TEXTS))
    with Classifier.from_pretrained(classifier_model, device="cpu") as classifier:
        best, two = classifier.predict(TEXTS), classifier.predict(TEXTS, top_k=2)
    out = tmp_path / "labels.parquet"
    r = CliRunner().invoke(main, ["classify", str(src), "-o", str(out), "--model", str(classifier_model), "--device",
                                  "cpu", "--quiet"])
    assert r.exit_code == 0, r.output
    table = pq.read_table(out)
    assert table.column_names == ["line", "label", "score"]
    assert table.column("line").to_pylist() == list(range(1, len(TEXTS) + 1))
    assert table.column("label").to_pylist() == [b["label"] for b in best]
    r = CliRunner().invoke(main, ["classify", str(src), "-o", str(out), "--model", str(classifier_model), "--device",
                                  "cpu", "--quiet", "--top-k", "2"])
    assert r.exit_code == 0 and pq.read_table(out).column("labels").to_pylist() == two
    r = CliRunner().invoke(main, ["classify", str(src), "-o", str(tmp_path / "broken.parquet"), "--model",
                                  str(tmp_path / "nothing"), "--device", "cpu"])
    assert r.exit_code == 1 and not (tmp_path / "broken.parquet").exists()


def test_threads_share_one_classifier(classifier_model):
    from concurrent.futures import ThreadPoolExecutor
    with Classifier.from_pretrained(classifier_model, device="cpu") as classifier:
        expected = classifier.predict(TEXTS, top_k=None)
        with ThreadPoolExecutor(6) as pool:
            found = list(pool.map(lambda i: classifier.predict(TEXTS[i % 2:] + TEXTS[:i % 2], top_k=None), range(6)))
    for i, got in enumerate(found):
        order = TEXTS[i % 2:] + TEXTS[:i % 2]
        for text, labels in zip(order, got):
            ref = expected[TEXTS.index(text)]
            assert [x["label"] for x in labels] == [x["label"] for x in ref]
            assert np.abs(np.array([x["score"] for x in labels]) - [x["score"] for x in ref]).max() <= HF_FP32_MAX_ABS


def test_texts_and_pairs_waiting_together(classifier_model):
    """Requests of texts and of pairs queued together are tokenised in a call of each kind, and
    each gets the logits it gets alone."""
    import threading
    with Classifier.from_pretrained(classifier_model, device="cpu") as classifier:
        calls = [TEXTS, PAIRS, TEXTS[1:], PAIRS[::-1]]
        expected = [classifier.logits(c)[0] for c in calls]
        engine, held = classifier._encoder._engine, threading.Event()
        encode, taken = engine.tokenizer.encode, threading.Event()

        def held_encode(texts, **kwargs):
            taken.set()
            held.wait(30)
            return encode(texts, **kwargs)
        engine.tokenizer.encode = held_encode
        first = classifier.submit_logits(["a text the tokenizer thread holds"])
        assert taken.wait(30)
        futures = [classifier.submit_logits(c) for c in calls]
        held.set()
        classifier.head_logits(first.result())
        for future, want in zip(futures, expected):
            got = classifier.head_logits(future.result())
            assert got.shape == want.shape and np.abs(got - want).max() <= BATCHING_INVARIANCE_FP32
