"""Several models in one `ftengine serve` (a real server on loopback, httpx clients): each answers
under /models/NAME/, the usual routes go to the first model of their task or to the one the body
names, /v1/models lists them, 64 concurrent clients spread over the models all get their own
model's answers, and SIGTERM drains them all."""

import asyncio
import re
import signal

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")

from ftengine import Classifier, Encoder, Reranker  # noqa: E402
from tests.test_serve import Server, texts_for  # noqa: E402
from tests.tolerances import BATCHING_INVARIANCE_FP32  # noqa: E402
from weights.fixtures import add_classification_head, write_bert_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory, st_model):
    root = tmp_path_factory.mktemp("models")
    other = write_bert_checkpoint(root / "other", seed=11, max_positions=64, sentence_transformers={
        "pooling": {"word_embedding_dimension": 32, "pooling_mode_cls_token": True}, "max_seq_length": 32})
    reranker = add_classification_head(write_bert_checkpoint(root / "rr", seed=2, max_positions=64), num_labels=1)
    classifier = add_classification_head(write_bert_checkpoint(root / "cls", seed=3, max_positions=64), num_labels=3)
    return {"emb": st_model, "other": other, "rr": reranker, "cls": classifier}


@pytest.fixture(scope="module")
def server(folders):
    s = Server(*[f"{name}={path}" for name, path in folders.items()][:1], *sum(
        (["--model", f"{name}={path}"] for name, path in list(folders.items())[1:]), []),
        "--max-client-batch-size", 64)
    yield s
    if s.proc.poll() is None:
        s.stop()


@pytest.fixture(scope="module")
def local(folders):
    with Encoder.from_pretrained(folders["emb"], device="cpu") as emb, \
            Encoder.from_pretrained(folders["other"], device="cpu") as other, \
            Reranker.from_pretrained(folders["rr"], device="cpu") as rr, \
            Classifier.from_pretrained(folders["cls"], device="cpu") as cls:
        yield {"emb": emb, "other": other, "rr": rr, "cls": cls}


def close(got, ref):
    return np.abs(np.asarray(got, np.float32) - ref).max() <= BATCHING_INVARIANCE_FP32


def test_each_model_answers_its_routes(server, local):
    texts = texts_for(1, 5)
    assert close(httpx.post(server.url + "/embed", json={"inputs": texts}).json(), local["emb"].encode(texts))
    assert close(httpx.post(server.url + "/models/other/embed", json={"inputs": texts}).json(),
                 local["other"].encode(texts, normalize=True))  # TEI's normalize: true
    reply = httpx.post(server.url + "/v1/embeddings", json={"model": "other", "input": texts}).json()
    assert reply["model"] == "other" and close([d["embedding"] for d in reply["data"]], local["other"].encode(texts))
    default = httpx.post(server.url + "/v1/embeddings", json={"model": "text-embedding-3-small", "input": texts})
    assert close([d["embedding"] for d in default.json()["data"]], local["emb"].encode(texts))
    scores = local["rr"].predict([("q", t) for t in texts])
    ranked = httpx.post(server.url + "/rerank", json={"query": "q", "texts": texts}).json()
    assert [r["index"] for r in ranked] == np.argsort(-scores, kind="stable").tolist()
    cohere = httpx.post(server.url + "/v1/rerank", json={"model": "rr", "query": "q", "documents": texts}).json()
    assert [r["index"] for r in cohere["results"]] == np.argsort(-scores, kind="stable").tolist()
    labels = httpx.post(server.url + "/models/cls/predict", json={"inputs": texts}).json()
    assert [x[0]["label"] for x in labels] == [p["label"] for p in local["cls"].predict(texts)]
    wrong = httpx.post(server.url + "/v1/embeddings", json={"model": "rr", "input": texts})
    assert wrong.status_code == 404 and "models that do: emb, other" in wrong.json()["error"]
    listed = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in listed["data"]] == ["emb", "other", "rr", "cls"]
    assert [m["task"] for m in listed["data"]] == ["embed", "embed", "rerank", "classify"]
    assert httpx.get(server.url + "/health").json()["models"] == ["emb", "other", "rr", "cls"]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'ftengine_requests_total{model="other",route="openai",status="200"}' in metrics


def test_sixty_four_clients_over_four_models_then_sigterm_drains_them(server, local):
    calls = []
    for i in range(64):
        texts = texts_for(100 + i, 1 + i % 9)
        kind = ["emb", "other", "rr", "cls"][i % 4]
        calls.append((kind, texts))

    async def ask(http, kind, texts):
        if kind in ("emb", "other"):
            return await http.post(server.url + f"/models/{kind}/embed", json={"inputs": texts})
        if kind == "rr":
            return await http.post(server.url + "/rerank", json={"query": "q", "texts": texts})
        return await http.post(server.url + "/predict", json={"inputs": [texts[0], texts[-1], texts[0]]})

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as http:
            replies = await asyncio.gather(*(ask(http, kind, texts) for kind, texts in calls))
            late = [asyncio.ensure_future(ask(http, kind, texts)) for kind, texts in calls[:8]]
            while True:  # every late request answered or accepted (the queue-depth gauges), then SIGTERM:
                # one still on its way in would meet a connection the server closes as idle
                metrics = (await http.get(server.url + "/metrics")).text
                gauges = re.findall(r"^ftengine_queue_depth\{model=.*\} (\S+)$", metrics, re.M)
                assert len(gauges) == 4, metrics  # one a model
                if sum(map(float, gauges)) + sum(t.done() for t in late) >= len(late):
                    break
                await asyncio.sleep(0.01)
            server.proc.send_signal(signal.SIGTERM)
            return replies, await asyncio.gather(*late)

    replies, late = asyncio.run(main())
    code, out = server.stop(signal_it=False)
    assert code == 0, out
    for (kind, texts), r in zip(calls + calls[:8], replies + late):
        assert r.status_code == 200, r.text
        if kind in ("emb", "other"):
            assert close(r.json(), local[kind].encode(texts, normalize=True))
        elif kind == "rr":
            scores = local["rr"].predict([("q", t) for t in texts])
            assert [x["index"] for x in r.json()] == np.argsort(-scores, kind="stable").tolist()
        else:
            expected = local["cls"].predict([texts[0], texts[-1], texts[0]])
            assert [x[0]["label"] for x in r.json()] == [p["label"] for p in expected]
