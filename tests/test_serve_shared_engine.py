"""`ftengine serve --workers N --shared-engine` (one engine process runs the model for every
worker) and `--engine-processes K`. A real server on loopback: concurrent clients each get their
own answer (classifier and embedding models, against the model in this process), the batches are
counted in /metrics, SIGTERM drains and ends the engine processes too; an engine process that dies
turns requests and /health into a 503 naming it; with K = N each worker uses its own engine
process (a slot each, freed with the worker's process); options that cannot apply, or a model that
cannot load, are one clear error."""

import asyncio
import os
import re
import signal
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import httpx
import pytest
from click.testing import CliRunner

from ftengine import Classifier
from ftengine.cli import main
from tests.test_serve import Server, close
from tests.test_serve_join import WORDS, texts
from tests.tolerances import BATCHING_INVARIANCE_FP32, GPU_FP32_REL

def engine_pid(server) -> int:
    found = re.search(r"engine process (\d+) ready", server.output())
    assert found, server.output()
    return int(found.group(1))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def predict_at_once(server, requests: list, expected: list, tolerance: float = BATCHING_INVARIANCE_FP32):
    """POST every request to /predict at once; each answer as `expected` (Classifier.predict's)."""
    async def main_():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*(http.post("/predict", json={"inputs": r}) for r in requests))
    for reply, ref in zip(asyncio.run(main_()), expected):
        assert reply.status_code == 200, reply.text
        got = reply.json()
        assert [[x["label"] for x in row] for row in got] == [[x["label"] for x in row] for row in ref]
        assert max(abs(a["score"] - b["score"]) for row, r in zip(got, ref) for a, b in zip(row, r)) <= tolerance


def test_workers_share_one_engine_process(small_classifier):
    requests = [texts(200 + i, (1, 3, 4, 5, 6)[i % 5]) for i in range(32)]  # two strings would be one pair
    with Classifier.from_pretrained(small_classifier, device="cpu") as classifier:
        expected = [classifier.predict(r, top_k=None) for r in requests]
    s = Server(small_classifier, "--workers", 2, "--shared-engine")
    try:
        pid = engine_pid(s)
        address = re.search(r"engine process \d+ ready: (\S+)", s.output()).group(1)
        with pytest.raises((AuthenticationError, ConnectionError, EOFError)):
            Client(address, family="AF_UNIX", authkey=b"not the key")  # refused; the service goes on

        predict_at_once(s, requests, expected)
        too_long = httpx.post(s.url + "/predict", json={"inputs": ["fine", " ".join(WORDS * 4), "fine"]})
        assert too_long.status_code == 413 and "input 1 " in too_long.json()["error"]
        metrics = httpx.get(s.url + "/metrics").text
        batched = float(next(line.split()[-1] for line in metrics.splitlines()
                             if line.startswith("ftengine_batch_requests_sum")))
        assert batched >= len(requests)  # the engine process's batches, with every request counted
    finally:
        code, output = s.stop()
    assert code == 0, output
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the engine process outlived the service"


def test_an_engine_process_that_dies_is_a_503(small_classifier):
    s = Server(small_classifier, "--workers", 2, "--shared-engine")
    try:
        deadline = time.monotonic() + 60
        while s.output().count("ftengine.serve ready:") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # both workers warmed up (/health answered from one of them)
        os.kill(engine_pid(s), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            reply = httpx.post(s.url + "/predict", json={"inputs": ["hello there"]})
            if reply.status_code == 503:
                break
            time.sleep(0.1)
        assert reply.status_code == 503 and "engine process has ended" in reply.json()["error"], reply.text
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and "engine process has ended" in health.json()["error"]
    finally:
        code, output = s.stop()
    assert code == 0, output


def test_an_engine_process_per_worker(small_classifier):
    requests = [texts(400 + i, (1, 3, 4, 5, 6)[i % 5]) for i in range(32)]
    with Classifier.from_pretrained(small_classifier, device="cpu") as classifier:
        expected = [classifier.predict(r, top_k=None) for r in requests]
    s = Server(small_classifier, "--workers", 2, "--engine-processes", 2)
    try:
        engines = {int(pid) for pid in re.findall(r"engine process (\d+) ready", s.output())}
        assert len(engines) == 2, s.output()
        deadline = time.monotonic() + 60
        while len(used := re.findall(r"the models run in engine process (\d+)", s.output())) < 2 \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {int(pid) for pid in used} == engines, s.output()  # each worker its own

        predict_at_once(s, requests, expected)
    finally:
        code, output = s.stop()
    assert code == 0, output
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in engines) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in engines), "an engine process outlived the service"


@pytest.mark.gpu
def test_engine_processes_on_the_gpu(small_classifier):
    """On the GPU in fp32, each worker's engine process answers as the model does on the CPU here
    (the workers load theirs with the CPU tokenizer: they tokenise no batch)."""
    requests = [texts(600 + i, (1, 3, 4, 5, 6)[i % 5]) for i in range(32)]
    with Classifier.from_pretrained(small_classifier, device="cpu") as classifier:
        expected = [classifier.predict(r, top_k=None) for r in requests]
    s = Server(small_classifier, "--workers", 2, "--engine-processes", 2, "--dtype", "fp32", device="cuda")
    try:
        predict_at_once(s, requests, expected, GPU_FP32_REL)
    finally:
        code, output = s.stop()
    assert code == 0, output


def test_worker_slots_are_one_each_and_freed_with_their_process(tmp_path):
    """Which engine process a worker uses: its slot, held while it lives."""
    import subprocess
    import sys
    claim = ("import sys, time; from ftengine.serve_engine_host import claim_slot; "
             f"print(claim_slot({str(tmp_path)!r}, 3), flush=True); time.sleep(float(sys.argv[1]))")
    holders = [subprocess.Popen([sys.executable, "-c", claim, "60"], stdout=subprocess.PIPE, text=True)
               for _ in range(2)]
    try:
        held = [int(h.stdout.readline()) for h in holders]
        assert sorted(held) == [0, 1]
        holders[0].kill()  # its slot goes with it, as a dead worker's to the one uvicorn starts instead
        holders[0].wait()
        again = subprocess.run([sys.executable, "-c", claim, "0"], capture_output=True, text=True, check=True)
        assert int(again.stdout) == held[0]
    finally:
        for h in holders:
            h.kill()
            h.wait()


@pytest.mark.parametrize("args, message", [
    (["--engine-processes", 1], "--workers 2 or more"),
    (["--workers", 2, "--engine-processes", 3], "--engine-processes 3 is more than --workers 2"),
    (["--workers", 2, "--shared-engine", "--engine-processes", 2], "--shared-engine is --engine-processes 1"),
])
def test_engine_processes_options_that_cannot_apply(small_classifier, args, message):
    r = CliRunner().invoke(main, ["serve", "--model", str(small_classifier), "--device", "cpu", *map(str, args)])
    assert r.exit_code != 0 and message in r.output, r.output


def test_shared_engine_needs_workers(small_classifier):
    r = CliRunner().invoke(main, ["serve", "--model", str(small_classifier), "--device", "cpu", "--shared-engine"])
    assert r.exit_code != 0 and "--workers 2 or more" in r.output


def test_a_model_the_engine_process_cannot_load_is_one_error(small_classifier, tmp_path):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(small_classifier, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    s = None
    try:
        s = Server(broken, "--workers", 2, "--shared-engine")
    except AssertionError as e:
        message = str(e)
    else:
        s.stop()
        pytest.fail("the server started on a broken checkpoint")
    assert "model.safetensors" in message and "Traceback" not in message


def test_embeddings_through_the_shared_engine(st_model):
    from ftengine import Encoder
    calls = [texts(300 + i, (1, 2, 5)[i % 3]) for i in range(12)]
    with Encoder.from_pretrained(st_model, device="cpu") as encoder:
        expected = [encoder.encode(c) for c in calls]
    s = Server(st_model, "--workers", 2, "--shared-engine")
    try:
        async def main_():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
                tei = [http.post("/embed", json={"inputs": c}) for c in calls]
                openai = [http.post("/v1/embeddings", json={"input": c}) for c in calls]
                return await asyncio.gather(*tei, *openai)
        replies = asyncio.run(main_())
        for reply, ref in zip(replies[:len(calls)], expected):
            assert reply.status_code == 200 and close(reply.json(), ref)
        for reply, ref in zip(replies[len(calls):], expected):
            assert reply.status_code == 200 and close([d["embedding"] for d in reply.json()["data"]], ref)
    finally:
        assert s.stop()[0] == 0


def test_batch_metrics_carry_the_model_beside_a_token_classifier(small_classifier, tmp_path):
    """The engine process runs the classifier, the workers the token classifier: the service has
    two models, so the engine process's batch series are labelled by model as the workers' are."""
    from weights.fixtures import add_token_classification_head, write_bert_checkpoint
    ner = add_token_classification_head(write_bert_checkpoint(tmp_path / "ner", seed=3, max_positions=32), seed=4)
    s = Server(f"cls={small_classifier}", "--model", f"ner={ner}", "--workers", 2, "--shared-engine")
    try:
        assert httpx.post(s.url + "/predict", json={"inputs": ["hello there"]}).status_code == 200
        assert httpx.post(s.url + "/ner", json={"inputs": "hello there"}).status_code == 200
        batches = [line for line in httpx.get(s.url + "/metrics").text.splitlines()
                   if line.startswith("ftengine_batch_requests_count")]
        assert batches and all('model="' in line for line in batches), batches
        assert any('model="cls"' in line for line in batches), batches
    finally:
        assert s.stop()[0] == 0
