"""serve_join.Joiner: requests of one turn of the event loop go to the engine as one list, and each
gets its own rows back (against the same inputs classified alone), its own error (a too-long
input named by its own index, the others answered), and a client that leaves drops its share;
requests of a key whose submissions fill the engine's depth wait and go as one; then the same
through a real server on loopback under concurrent clients."""

import asyncio
from concurrent.futures import Future

import httpx
import numpy as np
import pytest

from ftengine import Classifier
from ftengine.engine import EncodeResult
from ftengine.errors import TooLongError
from ftengine.serve_join import Joiner
from tests.test_serve import Server
from tests.tolerances import BATCHING_INVARIANCE_FP32

WORDS = "the quick brown fox jumps over a lazy dog while some birds sing in tall green trees".split()


@pytest.fixture(scope="module")
def classifier(small_classifier):
    with Classifier.from_pretrained(small_classifier, device="cpu") as c:
        yield c


def texts(seed: int, n: int, words: int = 6) -> list:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, words + 1)))) for _ in range(n)]


def counting(classifier, calls: list, *, truncate: bool = True):
    def submit(inputs, requests):
        calls.append(len(inputs))
        return classifier.submit_logits(inputs, truncate=truncate, requests=requests)
    return submit


def test_one_turn_is_one_submission_and_each_gets_its_rows(classifier):
    groups = [texts(1, 3), texts(2, 7), texts(3, 1)]
    calls, batches = [], []

    async def main():
        join = Joiner()
        submit = counting(classifier, calls)
        futures = [join.submit(g, ("classify", False, True), submit) for g in groups]
        return await asyncio.gather(*futures)
    engine = classifier._encoder._engine
    engine.on_batch = lambda texts, requests, tokens: batches.append((texts, requests))
    try:
        results = asyncio.run(main())
    finally:
        engine.on_batch = None
    assert calls == [11]
    assert batches == [(11, 3)]  # the service's metrics count the three requests in the batch
    for group, result in zip(groups, results):
        alone, tokens = classifier.logits(group)
        assert np.abs(result.embeddings - alone).max() <= BATCHING_INVARIANCE_FP32
        assert result.tokens == tokens and len(result.lengths) == len(group)


def test_different_keys_are_not_joined(classifier):
    calls = []

    async def main():
        join = Joiner()
        a = join.submit(texts(4, 2), ("classify", False, True), counting(classifier, calls))
        b = join.submit(texts(5, 3), ("classify", False, False), counting(classifier, calls, truncate=False))
        return await asyncio.gather(a, b)
    asyncio.run(main())
    assert sorted(calls) == [2, 3]


def test_a_too_long_member_fails_alone_with_its_own_index(classifier):
    long = " ".join(WORDS * 4)  # past the checkpoint's 32 positions
    groups = [texts(6, 2), ["short", long], texts(7, 3)]
    calls = []

    async def main():
        join = Joiner()
        submit = counting(classifier, calls, truncate=False)
        futures = [join.submit(g, ("classify", False, False), submit) for g in groups]
        return await asyncio.gather(*futures, return_exceptions=True)
    first, second, third = asyncio.run(main())
    assert isinstance(second, TooLongError) and second.index == 1
    for group, result in ((groups[0], first), (groups[2], third)):
        assert np.abs(result.embeddings - classifier.logits(group)[0]).max() <= BATCHING_INVARIANCE_FP32
    assert calls == [7, 2, 2, 3]  # joined, then each member alone


def test_requests_wait_while_the_engine_holds_depth_submissions_then_go_as_one():
    calls, engines = [], []

    def submit(inputs, requests):
        calls.append((len(inputs), requests))
        engines.append(Future())
        return engines[-1]

    def answer(i):
        n = calls[i][0]
        rows = np.arange(n, dtype=np.float32)[:, None] + 100 * i
        engines[i].set_result(EncodeResult(rows, n, 0, 0.0, np.ones(n, np.int32), np.zeros(n, bool)))

    async def turn():
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    async def main():
        join = Joiner(depth=2)
        first = join.submit(["a"], "k", submit)
        await turn()
        second = join.submit(["b", "c"], "k", submit)
        await turn()
        held = [join.submit(["d"], "k", submit), join.submit(["e", "f"], "k", submit)]
        await turn()
        held.append(join.submit(["g"], "k", submit))
        other = join.submit(["x"], "other key", submit)  # not held by "k"'s submissions
        await turn()
        assert calls == [(1, 1), (2, 1), (1, 1)]
        answer(0)
        assert (await first).embeddings[:, 0].tolist() == [0]
        assert calls[3:] == [(4, 3)]  # the three held requests, joined once the first is answered
        for i in (1, 2, 3):
            answer(i)
        return await asyncio.gather(second, other, *held)
    results = asyncio.run(main())
    assert [r.embeddings[:, 0].tolist() for r in results] == [[100, 101], [200], [300], [301, 302], [303]]


def test_the_engine_work_is_cancelled_once_every_member_has_left():
    engine = Future()  # the engine's future: pending, as while a submission waits its turn

    async def main():
        join = Joiner()
        a = join.submit(["x"], "k", lambda inputs, requests: engine)
        b = join.submit(["y", "z"], "k", lambda inputs, requests: engine)
        await asyncio.sleep(0)  # the turn ends: one submission
        await asyncio.sleep(0)
        join.cancel(a)
        assert not engine.cancelled()  # b still waits
        join.cancel(b)
        assert engine.cancelled()
    asyncio.run(main())


def test_concurrent_clients_each_get_their_own_answer(small_classifier, classifier):
    requests = [texts(100 + i, (1, 3, 4, 5, 6)[i % 5]) for i in range(24)]  # two strings would be one pair
    expected = [classifier.predict(r, top_k=None) for r in requests]
    long = " ".join(WORDS * 4)
    s = Server(small_classifier)
    try:
        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
                sent = [http.post("/predict", json={"inputs": r}) for r in requests]
                sent.append(http.post("/predict", json={"inputs": ["fine", long, "also fine"]}))
                return await asyncio.gather(*sent)
        replies = asyncio.run(main())
        for reply, ref in zip(replies, expected):
            assert reply.status_code == 200
            got = reply.json()
            assert [[x["label"] for x in row] for row in got] == [[x["label"] for x in row] for row in ref]
            assert max(abs(a["score"] - b["score"]) for row, r in zip(got, ref) for a, b in zip(row, r)) \
                <= BATCHING_INVARIANCE_FP32
        assert replies[-1].status_code == 413 and "input 1 " in replies[-1].json()["error"]
    finally:
        assert s.stop()[0] == 0
