"""Token classification (NER) against HF's token-classification pipeline on random BERT,
RoBERTa, XLM-R, CamemBERT and DistilBERT ...ForTokenClassification checkpoints (WordPiece,
byte-level BPE and Unigram tokenizers): every aggregation strategy gives the pipeline's
entities (labels, words, character offsets; scores within 1e-4) on texts with multi-token words,
punctuation, accents and unknown tokens; texts past the model's length are cut as the pipeline
cuts them; threads share one model, and requests waiting together its forward passes; `ftengine
ner` writes one record a line."""

import json
import threading
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from click.testing import CliRunner

from ftengine import InputError, TokenClassifier
from ftengine.cli import main
from ftengine.token_classifier import STRATEGIES
from tests.tolerances import BATCHING_INVARIANCE_FP32, HF_FP32_MAX_ABS
from weights.fixtures import add_token_classification_head, write_bert_checkpoint, write_encoder_checkpoint

transformers = pytest.importorskip("transformers")

TEXTS = ["hello world, the quick brown fox jumps over the lazy dog!", "Ünïcödé ✓ text with emoji 🙂 and words",
         "microsoft company was founded in a word", "", "   ", "a-b c.d (x) [y] quickly jumping",
         " ".join(["jumps over"] * 40)]


@pytest.fixture(scope="module", params=["bert", "roberta", "xlm-roberta", "camembert", "distilbert"])
def ner_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"ner-{request.param}")
    if request.param == "bert":
        write_bert_checkpoint(folder, seed=3, max_positions=64)
    else:
        write_encoder_checkpoint(folder, request.param, seed=3)
    settings = folder / "tokenizer_config.json"  # the model's length, as the Hub's files give it (HF cuts there)
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "model_max_length": 64}))
    return add_token_classification_head(folder, seed=1)


def hf_entities(folder, texts, strategy, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = transformers.pipeline("token-classification", model=str(folder), aggregation_strategy=strategy,
                                     device="cpu")
        return [pipe(t, **options) for t in texts]


def assert_same_entities(got, expected):
    for ours, theirs in zip(got, expected):
        assert [{k: v for k, v in e.items() if k != "score"} for e in ours] == \
            [{k: (int(v) if k == "index" else v) for k, v in e.items() if k != "score"} for e in theirs]
        assert all(abs(a["score"] - float(b["score"])) <= HF_FP32_MAX_ABS for a, b in zip(ours, theirs))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_entities_match_the_hf_pipeline(ner_model, strategy):
    with TokenClassifier.from_pretrained(ner_model, device="cpu") as model:
        got = model.predict(TEXTS, aggregation_strategy=strategy)
    expected = hf_entities(ner_model, TEXTS, strategy)
    assert sum(map(len, expected)) > 10  # the random head finds entities
    assert_same_entities(got, expected)


def test_ignored_labels_are_dropped_as_the_pipeline_drops_them(ner_model):
    """Ignored: B-LOC and the head's most common label by full name (tokens) and by group name
    (a group is named by its label past the first "-")."""
    with TokenClassifier.from_pretrained(ner_model, device="cpu") as model:
        every = model.predict(TEXTS, ignore_labels=())
        common = Counter(e["entity"] for text in every for e in text).most_common(1)[0][0]
        for strategy in ("none", "simple", "first"):
            counts = []
            for ignore in ((), ("B-LOC", common, common.split("-", 1)[-1])):
                got = model.predict(TEXTS, aggregation_strategy=strategy, ignore_labels=ignore)
                assert_same_entities(got, hf_entities(ner_model, TEXTS, strategy, ignore_labels=list(ignore)))
                counts.append(sum(map(len, got)))
            assert counts[0] > counts[1]  # the labels were there to drop


LONG = [" ".join(["the quick brown fox jumps over the lazy dog, microsoft company!"] * 9),
        "hello world " * 40, "a short one"]


@pytest.mark.parametrize("strategy", ["simple", "first", "max"])
def test_long_texts_in_overlapping_windows_match_the_hf_pipeline(ner_model, strategy):
    """stride: windows of the model's length overlapping by 16 tokens, overlapping entities
    resolved as the pipeline resolves them."""
    with TokenClassifier.from_pretrained(ner_model, device="cpu") as model:
        got = model.predict(LONG, aggregation_strategy=strategy, stride=16)
        assert max(e["end"] for e in got[0]) > len(LONG[0]) - 20  # entities from the last window
        with pytest.raises(InputError, match="stride needs an aggregation_strategy other than none"):
            model.predict(LONG, stride=16)
        with pytest.raises(InputError, match="stride must be an integer within 0..63"):
            model.predict(LONG, aggregation_strategy="first", stride=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = transformers.pipeline("token-classification", model=str(ner_model), aggregation_strategy=strategy,
                                     stride=16, device="cpu")
        expected = [pipe(t) for t in LONG]
    assert_same_entities(got, expected)


def assert_same_as_alone(got, alone):
    """The entities of texts that shared forward passes with other requests' texts: those each
    request had alone, scores within the batching tolerance (fp32 rounding only)."""
    for ours, theirs in zip(got, alone, strict=True):
        assert [{k: v for k, v in e.items() if k != "score"} for e in ours] == \
            [{k: v for k, v in e.items() if k != "score"} for e in theirs]
        assert all(abs(a["score"] - b["score"]) <= BATCHING_INVARIANCE_FP32 for a, b in zip(ours, theirs))


def test_threads_share_one_model_and_bad_input_is_refused(ner_model):
    with TokenClassifier.from_pretrained(ner_model, device="cpu") as model:
        expected = model.predict(TEXTS, aggregation_strategy="simple")
        with ThreadPoolExecutor(4) as pool:
            found = list(pool.map(lambda _: model.predict(TEXTS, aggregation_strategy="simple"), range(4)))
        for got in found:
            assert_same_as_alone(got, expected)
        with pytest.raises(InputError, match="aggregation_strategy 'best' is not one of"):
            model.predict(TEXTS, aggregation_strategy="best")
        with pytest.raises(InputError, match="text 2 is a int"):
            model.predict(["fine", 3])
        assert model.predict([]) == []
    with pytest.raises(InputError, match="max_length 1 must be within 2..64"):
        TokenClassifier.from_pretrained(ner_model, device="cpu", max_length=1)


def test_ner_command(ner_model, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("".join(t + "\n" for t in TEXTS), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(main, ["ner", str(src), "-o", str(out), "--model", str(ner_model), "--device", "cpu",
                                  "--aggregation-strategy", "first"])
    assert r.exit_code == 0, r.output
    assert f"{len(TEXTS)} lines" in r.stderr
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [row["line"] for row in rows] == list(range(1, len(TEXTS) + 1))
    assert_same_entities([row["entities"] for row in rows], hf_entities(ner_model, TEXTS, "first"))
    for args in (["--model", str(tmp_path)], ["--model", str(ner_model), "--stride", "99"]):
        r = CliRunner().invoke(main, ["ner", str(src), "--device", "cpu", *args])
        assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1, r.output


def test_served_at_ner_with_the_pipelines_entities(ner_model):
    """A real server on loopback, httpx: POST /ner for one text and for a list, /info's labels,
    a bad strategy as one JSON error, /predict answered with the routes this model serves."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from tests.test_serve import Server
    s = Server(ner_model)
    try:
        r = httpx.post(s.url + "/ner", json={"inputs": TEXTS[0], "aggregation_strategy": "first"}, timeout=60)
        assert r.status_code == 200, r.text
        assert_same_entities([r.json()], hf_entities(ner_model, TEXTS[:1], "first"))
        r = httpx.post(s.url + "/ner", json={"inputs": TEXTS}, timeout=60)
        assert_same_entities(r.json(), hf_entities(ner_model, TEXTS, "simple"))
        r = httpx.post(s.url + "/ner", json={"inputs": LONG, "aggregation_strategy": "max", "stride": 16}, timeout=60)
        with TokenClassifier.from_pretrained(ner_model, device="cpu") as model:
            assert r.json() == model.predict(LONG, aggregation_strategy="max", stride=16)
        r = httpx.post(s.url + "/ner", json={"inputs": TEXTS, "aggregation_strategy": "best"}, timeout=60)
        assert r.status_code == 422 and "aggregation_strategy must be one of" in r.json()["error"]
        assert "token_classifier" in httpx.get(s.url + "/info").json()["model_type"]
        r = httpx.post(s.url + "/predict", json={"inputs": "x"}, timeout=60)
        assert r.status_code == 404 and "POST /ner" in r.json()["error"]
    finally:
        code, out = s.stop()
    assert code == 0 and "Traceback" not in out


def test_waiting_requests_share_forward_passes_and_a_cancelled_one_is_dropped(ner_model):
    """Requests submitted while the worker is busy run in one pass when it frees, each with the
    entities it has alone; one cancelled before then never reaches the model."""
    with TokenClassifier.from_pretrained(ner_model, device="cpu") as model:
        alone = [model.predict([t], aggregation_strategy="first") for t in TEXTS[:3]]
        passes, scores = [], model._scores
        model._scores = lambda encodings: passes.append(len(encodings)) or scores(encodings)
        busy = threading.Event()
        model._worker.submit(busy.wait, 60)
        futures = [model.submit([t], aggregation_strategy="first") for t in TEXTS[:3]]
        gone = model.submit([TEXTS[4]], aggregation_strategy="first")
        assert gone.cancel()
        busy.set()
        got = [f.result(timeout=60)[0] for f in futures]
    assert passes == [3] and gone.cancelled()
    for ours, theirs in zip(got, alone):
        assert_same_as_alone(ours, theirs)
    assert_same_entities([entities for one in got for entities in one], hf_entities(ner_model, TEXTS[:3], "first"))


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["none", "average"])
def test_cuda_fp32_entities_match_the_hf_pipeline(ner_model, strategy):
    with TokenClassifier.from_pretrained(ner_model, device="cuda", dtype="fp32") as model:
        got = model.predict(TEXTS, aggregation_strategy=strategy)
    assert_same_entities(got, hf_entities(ner_model, TEXTS, strategy))


@pytest.fixture(scope="module")
def wide_ner_model(tmp_path_factory):
    """A BERT of head size 32, which the packed layout takes, with a token-classification head."""
    folder = write_bert_checkpoint(tmp_path_factory.mktemp("ner-wide"), seed=3, hidden=64, heads=2)
    return add_token_classification_head(folder, seed=1)


def assert_token_head_follows_the_last_layer(folder, ops, layout: str, bound):
    """BertRunner.token_logits (the head run by the backend after the last layer, its labels padded
    to LABEL_ALIGN) equals the head applied on the host to hidden_states' rows, sequence for
    sequence: |difference| <= bound(reference)."""
    import numpy as np

    from ftengine.checkpoint import load_bert_weights
    from ftengine.config import load_bert_config
    from ftengine.models.bert import LABEL_ALIGN, Batch, BertRunner
    from ftengine.token_classifier import _token_head
    config = load_bert_config(folder)
    weight, bias = (a[:5] for a in _token_head(folder, config.hidden_size))  # labels the padding completes
    assert len(bias) % LABEL_ALIGN
    runner = BertRunner(config, load_bert_weights(folder, config), ops, dtype="fp32", max_batch_tokens=256,
                        max_seq_len=64, layout=layout, token_head=(weight, bias))
    ids = [[5 + (7 * i) % 40 for i in range(n)] for n in (7, 1, 30)]
    batch = Batch.from_lists(ids, [[0] * len(x) for x in ids])
    found, hidden = runner.token_logits(batch), runner.hidden_states(batch)
    assert [f.shape for f in found] == [(len(x), len(bias)) for x in ids]
    for logits, states in zip(found, hidden):
        expected = states @ weight.T + bias
        assert np.abs(logits - expected).max() <= bound(expected)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_the_token_head_follows_the_last_layer(wide_ner_model, layout):
    from ftengine.backends import numpy_ops
    from tests.tolerances import OPS
    assert_token_head_follows_the_last_layer(
        wide_ner_model, numpy_ops, layout, lambda ref: OPS["fp32"]["atol"] + OPS["fp32"]["rtol"] * abs(ref).max())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_cuda_token_head_follows_the_last_layer(wide_ner_model, layout):
    from ftengine.backends.cuda import ops
    from tests.tolerances import GPU_FP32_REL
    assert_token_head_follows_the_last_layer(wide_ner_model, ops, layout,
                                             lambda ref: GPU_FP32_REL * max(1.0, float(abs(ref).max())))


def test_a_checkpoint_of_the_other_head_is_refused_by_name(tmp_path):
    """BERT's sequence- and token-classification heads are both a `classifier` of one shape, so
    config.json's architectures decide: ner never runs a sentiment head, nor classify / rerank an
    NER one, without a word (in the API and the CLI)."""
    from ftengine import Classifier, Reranker
    from ftengine.errors import ConfigError
    from weights.fixtures import add_classification_head
    seq = add_classification_head(write_bert_checkpoint(tmp_path / "seq", seed=1), num_labels=3, seed=6)
    config = json.loads((seq / "config.json").read_text())
    (seq / "config.json").write_text(json.dumps({**config, "architectures": ["BertForSequenceClassification"]}))
    tok = add_token_classification_head(write_bert_checkpoint(tmp_path / "tok", seed=1), seed=6)
    to_ner = "names BertForSequenceClassification, a sequence-classification model (classify / rerank); ner needs a " \
             "...ForTokenClassification checkpoint"
    to_sequence = "names BertForTokenClassification, a token-classification model (ner); classify / rerank needs a " \
                  "...ForSequenceClassification checkpoint"
    with pytest.raises(ConfigError) as e:
        TokenClassifier.from_pretrained(seq, device="cpu")
    assert to_ner in str(e.value)
    for cls in (Classifier, Reranker):
        with pytest.raises(ConfigError) as e:
            cls.from_pretrained(tok, device="cpu")
        assert to_sequence in str(e.value)
    src = tmp_path / "in.txt"
    src.write_text("hello world\n")
    for command, model, message in (("ner", seq, to_ner), ("classify", tok, to_sequence)):
        r = CliRunner().invoke(main, [command, str(src), "--model", str(model), "--device", "cpu"])
        assert r.exit_code == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    TokenClassifier.from_pretrained(tok, device="cpu").close()  # each head still loads where it belongs
    Classifier.from_pretrained(seq, device="cpu").close()
