"""`ftengine serve` of a reranker (a cross-encoder) as a real server on 127.0.0.1, talked to with
httpx: TEI's POST /rerank and the Cohere / Jina / Infinity POST /v1/rerank, each answer checked
against Reranker.predict; concurrent clients; every bad request one JSON error."""

import concurrent.futures

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")

from ftengine import Reranker  # noqa: E402
from tests.test_serve import Server, texts_for  # noqa: E402
from tests.tolerances import BATCHING_INVARIANCE_FP32  # noqa: E402
from weights.fixtures import add_classification_head, write_bert_checkpoint  # noqa: E402

QUERY = "how do foxes hunt"


@pytest.fixture(scope="module")
def reranker_model(tmp_path_factory):
    folder = write_bert_checkpoint(tmp_path_factory.mktemp("serve-reranker"), seed=2, max_positions=64)
    return add_classification_head(folder, num_labels=1)


@pytest.fixture(scope="module")
def reranker(reranker_model):
    with Reranker.from_pretrained(reranker_model, device="cpu") as r:
        yield r


@pytest.fixture(scope="module")
def server(reranker_model):
    s = Server(reranker_model, "--max-client-batch-size", 40)
    yield s
    code, _ = s.stop()
    assert code == 0


def test_tei_rerank(server, reranker):
    texts = texts_for(3, 9)
    expected = reranker.predict([(QUERY, t) for t in texts])
    r = httpx.post(server.url + "/rerank", json={"query": QUERY, "texts": texts, "return_text": True})
    assert r.status_code == 200, r.text
    reply = r.json()
    assert [item["index"] for item in reply] == np.argsort(-expected, kind="stable").tolist()
    assert np.abs(np.array([item["score"] for item in reply]) - expected[[item["index"] for item in reply]]).max() \
        <= BATCHING_INVARIANCE_FP32
    assert all(item["text"] == texts[item["index"]] for item in reply)
    raw = httpx.post(server.url + "/rerank", json={"query": QUERY, "texts": texts, "raw_scores": True}).json()
    logits = reranker.predict([(QUERY, t) for t in texts], activation=False)
    assert np.abs(np.array([item["score"] for item in raw]) - logits[[item["index"] for item in raw]]).max() \
        <= BATCHING_INVARIANCE_FP32
    assert "text" not in raw[0]


def test_cohere_style_rerank(server, reranker):
    texts = texts_for(4, 12)
    expected = reranker.predict([(QUERY, t) for t in texts])
    documents = [t if i % 2 else {"text": t} for i, t in enumerate(texts)]  # strings and Jina-style objects
    r = httpx.post(server.url + "/v1/rerank", json={"model": "any", "query": QUERY, "documents": documents,
                                                    "top_n": 3, "return_documents": True})
    assert r.status_code == 200, r.text
    reply = r.json()
    best = np.argsort(-expected, kind="stable")[:3].tolist()
    assert [item["index"] for item in reply["results"]] == best and reply["model"] == "any"
    assert np.abs(np.array([item["relevance_score"] for item in reply["results"]]) - expected[best]).max() \
        <= BATCHING_INVARIANCE_FP32
    assert [item["document"]["text"] for item in reply["results"]] == [texts[i] for i in best]
    assert reply["usage"]["total_tokens"] > 0


def test_concurrent_clients_get_their_own_scores(server, reranker):
    batches = [texts_for(10 + i, 5 + i % 7) for i in range(32)]

    def ask(texts):
        return httpx.post(server.url + "/rerank", json={"query": QUERY, "texts": texts}, timeout=60).json()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(ask, batches))
    for texts, reply in zip(batches, replies):
        expected = reranker.predict([(QUERY, t) for t in texts])
        got = np.zeros(len(texts), np.float32)
        got[[item["index"] for item in reply]] = [item["score"] for item in reply]
        assert np.abs(got - expected).max() <= BATCHING_INVARIANCE_FP32


@pytest.mark.parametrize("path, body, status, message", [
    ("/rerank", {"texts": ["a"]}, 422, "query is required"),
    ("/rerank", {"query": "  ", "texts": ["a"]}, 422, "query must not be empty"),
    ("/rerank", {"query": "q", "texts": []}, 422, "texts must not be empty"),
    ("/rerank", {"query": "q", "texts": ["a", 3]}, 422, "texts[1] must be a string"),
    ("/rerank", {"query": "q", "texts": ["a"] * 41}, 413, "more than --max-client-batch-size 40"),
    ("/rerank", {"query": "q", "texts": ["short", "word " * 100]}, 413, "text 1 with the query is longer than"),
    ("/rerank", {"query": "q", "texts": ["a"], "raw_scores": "yes"}, 422, "raw_scores must be true or false"),
    ("/v1/rerank", {"query": "q", "documents": [{"body": "a"}]}, 422, "documents[0] must be a string or"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, 422, "top_n must be an integer >= 1"),
    ("/v1/rerank", {"query": "q"}, 422, "documents is required"),
    ("/embed", {"inputs": ["a"]}, 404, None),
])
def test_bad_requests_are_one_json_error(server, path, body, status, message):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    if message is not None:
        assert message in r.json()["error"]
    ok = httpx.post(server.url + "/rerank", json={"query": "q", "texts": ["still", "served"]})
    assert ok.status_code == 200


def test_info_says_reranker(server):
    info = httpx.get(server.url + "/info").json()
    assert info["model_type"] == {"reranker": {}} and info["max_input_length"] == 64


@pytest.mark.parametrize("path, field", [("/rerank", "texts"), ("/v1/rerank", "documents")])
def test_a_client_that_leaves_cancels_its_scoring(reranker_model, path, field):
    """A client that closes its connection while its pairs wait on the engine gets its work
    cancelled (counted as 499, as /embed's), and the service answers the next client."""
    import json
    import re
    import socket
    import time
    s = Server(reranker_model, "--max-client-batch-size", 20000)
    try:
        body = json.dumps({"query": QUERY, field: texts_for(5, 20000)}).encode()
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as gone:
            gone.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.05)
        route = "rerank" if path == "/rerank" else "cohere"
        deadline, metrics = time.monotonic() + 60, ""
        while time.monotonic() < deadline:
            metrics = httpx.get(s.url + "/metrics").text
            if re.search(r'ftengine_requests_total\{[^}]*status="499"', metrics):
                break
            time.sleep(0.1)
        assert re.search(rf'ftengine_requests_total\{{[^}}]*route="{route}"[^}}]*status="499"', metrics), metrics
        r = httpx.post(s.url + path, json={"query": QUERY, field: ["a fox", "the dog"]}, timeout=30)
        assert r.status_code == 200
    finally:
        code, out = s.stop()
    assert code == 0 and "Traceback" not in out
