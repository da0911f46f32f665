"""`ftengine serve` as a real server on 127.0.0.1 (a subprocess of the installed command), talked
to with httpx and the `openai` client package. Every answer is checked against Encoder.encode."""

import asyncio
import base64
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")

from ftengine import Encoder  # noqa: E402
from tests.tolerances import BATCHING_INVARIANCE_FP32  # noqa: E402
from weights.fixtures import WORDS  # noqa: E402

EXE = str(Path(sys.executable).with_name("ftengine"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, *args, device: str = "cpu"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")  # a pipe nobody reads would fill and stall the server
        hide = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}
        self.proc = subprocess.Popen([EXE, "serve", "--model", str(model), "--device", device, "--port",
                                      str(self.port), *map(str, args)], stdout=self.log,
                                     stderr=subprocess.STDOUT, env={**os.environ, **hide})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, self.output()
            time.sleep(0.1)
        raise AssertionError("the server never became healthy")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self, *, signal_it: bool = True) -> tuple[int, str]:
        """SIGTERM (unless the test sent it already: a second one after the server's own
        handlers are gone would kill the exiting process), then its exit code and output."""
        if signal_it and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        return self.proc.returncode, self.output()


@pytest.fixture(scope="module")
def encoder(st_model):
    with Encoder.from_pretrained(st_model, device="cpu") as enc:
        yield enc


@pytest.fixture(scope="module")
def server(st_model):
    s = Server(st_model, "--max-client-batch-size", 40)
    yield s
    code, _ = s.stop()
    assert code == 0


def texts_for(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 30)))) for _ in range(n)]


def close(got, ref):
    return np.abs(np.asarray(got, dtype=np.float32) - ref).max() <= BATCHING_INVARIANCE_FP32


def test_tei_embed(server, encoder):
    texts = texts_for(1, 7)
    r = httpx.post(server.url + "/embed", json={"inputs": texts})
    assert r.status_code == 200 and close(r.json(), encoder.encode(texts))
    r = httpx.post(server.url + "/embed", json={"inputs": "one text", "normalize": False})
    assert r.status_code == 200 and close(r.json(), encoder.encode(["one text"], normalize=False))


def test_openai_client(server, encoder):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    texts = texts_for(2, 5)
    reply = client.embeddings.create(model="any", input=texts)  # the client asks for base64
    assert [d.index for d in reply.data] == list(range(5))
    assert close([d.embedding for d in reply.data], encoder.encode(texts))
    assert reply.usage.prompt_tokens == int(encoder.tokenizer.encode(texts).lengths.sum())
    floats = client.embeddings.create(model="any", input="hello world", encoding_format="float")
    assert close([floats.data[0].embedding], encoder.encode(["hello world"]))


def test_huggingface_hub_inference_client(server, encoder, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr("huggingface_hub.constants.is_offline_mode", lambda: False)  # conftest keeps the Hub offline
    client = hub.InferenceClient(model=server.url)  # posts TEI bodies to the root route
    assert close(client.feature_extraction("hello world"), encoder.encode(["hello world"]))
    raw = client.feature_extraction("hello world", normalize=False)
    assert close(raw, encoder.encode(["hello world"], normalize=False))


def test_openai_token_ids_and_dimensions(server, encoder):
    tokens = encoder.tokenizer.encode(["the quick brown fox"])
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "m", "input": tokens.ids.tolist()})
    assert r.status_code == 200 and close([r.json()["data"][0]["embedding"]], encoder.encode(["the quick brown fox"]))
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "m", "input": "hello", "dimensions": 8,
                                                        "encoding_format": "base64"})
    row = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
    cut = encoder.encode(["hello"])[0, :8]
    assert row.shape == (8,) and np.abs(row - cut / np.linalg.norm(cut)).max() <= BATCHING_INVARIANCE_FP32


@pytest.mark.parametrize("path, body, status, message", [
    ("/embed", b"{not json", 422, "the body is not valid JSON"),
    ("/embed", b"[1, 2]", 422, "the body must be a JSON object"),
    ("/embed", {"inputs": 5}, 422, "inputs must be a string or a list of strings"),
    ("/embed", {"inputs": []}, 422, "inputs must not be empty"),
    ("/embed", {"inputs": ["a", 3]}, 422, "inputs[1] must be a string, found int"),
    ("/embed", {"inputs": "a", "truncate": "yes"}, 422, "truncate must be true or false"),
    ("/embed", {"inputs": ["x"] * 41}, 413, "inputs holds 41 inputs, more than --max-client-batch-size 40"),
    ("/embed", {"inputs": ["ok", "word " * 60]}, 413, "input 1 has 62 tokens, more than the maximum input length 48"),
    ("/v1/embeddings", {"model": "m"}, 422, "input is required"),
    ("/v1/embeddings", {"model": "m", "input": [[2, 99999]]}, 422, "input[0] holds token id 99999, outside"),
    ("/v1/embeddings", {"model": "m", "input": "a", "encoding_format": "hex"}, 422, "encoding_format must be"),
    ("/v1/embeddings", {"model": "m", "input": "a", "dimensions": 0}, 422, "dimensions must be an integer within 1..32"),
])
def test_errors_have_status_and_message(server, path, body, status, message):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, **kwargs)
    assert r.status_code == status, r.text
    assert message in r.json()["error"] and "error_type" in r.json()
    ok = httpx.post(server.url + "/embed", json={"inputs": "still served"})  # the next request is served
    assert ok.status_code == 200


def test_body_over_the_cap_is_413(server):
    r = httpx.post(server.url + "/embed", content=b'{"inputs": "' + b"a" * (17 << 20) + b'"}')
    assert r.status_code == 413 and "over the limit" in r.json()["error"]


def test_a_15_mb_input_is_cut_from_a_bounded_prefix_and_stalls_no_one(server, encoder):
    """One text of 15 MB, inside the body cap: with truncate it is embedded from a bounded prefix
    (as the text cut short is), a small request sent while its body is read and parsed is answered
    meanwhile, and without truncate the 413 counts its characters."""
    huge = "!" * (15 << 20)

    async def main_():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            big = asyncio.ensure_future(http.post("/embed", json={"inputs": huge, "truncate": True}))
            await asyncio.sleep(0.05)
            start = time.monotonic()
            small = await http.post("/embed", json={"inputs": "still served"})
            return await big, small, time.monotonic() - start

    big, small, waited = asyncio.run(main_())
    assert big.status_code == 200 and close(big.json(), encoder.encode(["!" * 200]))
    assert small.status_code == 200 and close(small.json(), encoder.encode(["still served"])) and waited < 10
    refused = httpx.post(server.url + "/embed", json={"inputs": huge}, timeout=120)
    assert refused.status_code == 413 and f"input 0 has {len(huge)} characters" in refused.json()["error"]


def test_info_and_health(server):
    info = httpx.get(server.url + "/info").json()
    assert info["dim"] == 32 and info["max_input_length"] == 48 and info["device"] == "cpu"


def test_sixty_four_clients_share_batches(server, encoder):
    calls = {(c, i): texts_for(1000 * c + i, 1 + (c * 7 + i * 3) % 20) for c in range(64) for i in range(20)}
    expected = {k: encoder.encode(v) for k, v in calls.items()}

    async def client(c, http):
        out = {}
        for i in range(20):
            r = await http.post(server.url + "/embed", json={"inputs": calls[c, i]})
            assert r.status_code == 200, r.text
            out[c, i] = r.json()
        return out

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as http:
            return await asyncio.gather(*(client(c, http) for c in range(64)))

    for part in asyncio.run(main()):
        for key, rows in part.items():
            assert close(rows, expected[key]), key
    metrics = httpx.get(server.url + "/metrics").text
    count = float(next(l.split()[-1] for l in metrics.splitlines() if l.startswith("ftengine_batch_requests_count")))
    single = float(next(l.split()[-1] for l in metrics.splitlines()
                        if l.startswith('ftengine_batch_requests_bucket{le="1.0"}')))
    assert count > single, "no device batch held more than one request"


def test_an_idle_keep_alive_connection_stays_open_past_uvicorns_default(server):
    """A pooled client's connection, idle for longer than uvicorn's default keep-alive (5 s),
    still takes the next request: a server that closed it could race with a request sent on it
    (an httpx ReadError in the 64-client test on a busy CI machine)."""
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

    def exchange(sock) -> bytes:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            assert chunk, "the server closed the connection"
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        while len(body) < length:
            chunk = sock.recv(4096)
            assert chunk, "the server closed the connection"
            body += chunk
        return head.split(b"\r\n")[0]

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        assert exchange(sock) == b"HTTP/1.1 200 OK"
        time.sleep(6.5)
        assert exchange(sock) == b"HTTP/1.1 200 OK"


def test_api_key(st_model):
    s = Server(st_model, "--api-key", "sesame")
    try:
        assert httpx.post(s.url + "/embed", json={"inputs": "x"}).status_code == 401
        r = httpx.post(s.url + "/embed", json={"inputs": "x"}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "API key" in r.json()["error"]
        assert httpx.post(s.url + "/embed", json={"inputs": "x"},
                          headers={"Authorization": "Bearer sesame"}).status_code == 200
    finally:
        assert s.stop()[0] == 0


def test_queue_full_is_429_with_retry_after(st_model):
    s = Server(st_model, "--max-concurrent-requests", 1, "--max-client-batch-size", 100000)
    try:
        async def main():
            async with httpx.AsyncClient(timeout=120) as http:
                big = http.post(s.url + "/embed", json={"inputs": texts_for(5, 60000)})
                task = asyncio.ensure_future(big)
                await asyncio.sleep(1.0)  # the big one is accepted and running
                small = await http.post(s.url + "/embed", json={"inputs": "x"})
                return await task, small

        big, small = asyncio.run(main())
        assert big.status_code == 200
        assert small.status_code == 429 and small.headers["retry-after"] == "1"
        assert "--max-concurrent-requests" in small.json()["error"]
    finally:
        assert s.stop()[0] == 0


def test_sigterm_finishes_requests_in_flight(st_model, encoder):
    s = Server(st_model, "--max-client-batch-size", 5000)
    calls = [texts_for(300 + i, 2000) for i in range(32)]

    async def main():
        async with httpx.AsyncClient(timeout=300) as http:
            tasks = [asyncio.ensure_future(http.post(s.url + "/embed", json={"inputs": t})) for t in calls]
            while True:  # every request accepted: the queue-depth gauge says 32
                metrics = (await http.get(s.url + "/metrics")).text
                if "ftengine_queue_depth 32.0" in metrics:
                    break
                await asyncio.sleep(0.01)
            s.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    replies = asyncio.run(main())
    code, out = s.stop(signal_it=False)
    assert code == 0, out
    for r, texts in zip(replies, calls):
        assert r.status_code == 200 and close(r.json(), encoder.encode(texts))


def test_workers_share_one_port_and_sum_their_metrics(st_model, encoder):
    s = Server(st_model, "--workers", 2, "--max-client-batch-size", 5000)
    calls = [texts_for(500 + i, 1 + i % 9) for i in range(48)]
    slow = [texts_for(900 + i, 1500) for i in range(16)]

    async def main():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=32)) as http:
            replies = await asyncio.gather(*(http.post(s.url + "/embed", json={"inputs": t}) for t in calls))
            metrics = (await http.get(s.url + "/metrics")).text
            tasks = [asyncio.ensure_future(http.post(s.url + "/embed", json={"inputs": t})) for t in slow]
            while "ftengine_queue_depth 16.0" not in (await http.get(s.url + "/metrics")).text:
                await asyncio.sleep(0.01)  # all 16 accepted, summed over the workers
            s.proc.send_signal(signal.SIGTERM)
            return replies, metrics, await asyncio.gather(*tasks)

    replies, metrics, last = asyncio.run(main())
    code, out = s.stop(signal_it=False)
    assert code == 0, out
    for r, texts in zip(replies + last, calls + slow):
        assert r.status_code == 200 and close(r.json(), encoder.encode(texts))
    assert 'ftengine_requests_total{route="embed",status="200"} 48.0' in metrics
    assert out.count("Started server process") == 2


def test_workers_report_a_model_that_cannot_load(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    proc = subprocess.run([EXE, "serve", "--model", str(tmp_path), "--device", "cpu", "--port", str(free_port()),
                           "--workers", "2"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1
    assert f"ftengine: {tmp_path}" in proc.stderr or "config.json" in proc.stderr, proc.stderr
    assert "a service worker could not start" in proc.stderr


def raw_request(port: int, head: bytes, body: bytes = b"", *, timeout: float = 60) -> bytes:
    """One HTTP request on a socket of its own; the status line of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + body)
        reply = sock.recv(65536)
    return reply.split(b"\r\n")[0]


def test_the_key_guards_info_and_metrics_and_stays_out_of_argv_and_workers(st_model, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key\n")
    s = Server(st_model, "--api-key-file", key_file, "--workers", 2)
    try:
        for path in ("/info", "/metrics"):
            assert httpx.get(s.url + path).status_code == 401
            assert httpx.get(s.url + path, headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200  # orchestrators probe it without a key
        r = httpx.post(s.url + "/embed", json={"inputs": "x"}, headers={"Authorization": "Bearer s3cret-key"})
        assert r.status_code == 200
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            assert b"s3cret-key" not in environ and b"s3cret-key" not in cmdline, pid
    finally:
        assert s.stop()[0] == 0
    env_server = Server.__new__(Server)
    os.environ["FTENGINE_API_KEY"] = "from-env"
    try:
        env_server.__init__(st_model)
        assert httpx.post(env_server.url + "/embed", json={"inputs": "x"}).status_code == 401
        assert httpx.post(env_server.url + "/embed", json={"inputs": "x"},
                          headers={"Authorization": "Bearer from-env"}).status_code == 200
    finally:
        del os.environ["FTENGINE_API_KEY"]
        assert env_server.stop()[0] == 0


def test_no_redirect_gzip_and_token_id_messages(server):
    forged = raw_request(server.port, b"POST /embed/ HTTP/1.1\r\nHost: evil.example\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 15\r\n\r\n", b'{"inputs": "x"}')
    assert forged == b"HTTP/1.1 404 Not Found"
    r = httpx.post(server.url + "/embed", content=b"\x1f\x8b gzip", headers={"Content-Encoding": "gzip",
                                                                             "Content-Type": "application/json"})
    assert r.status_code == 415 and "uncompressed" in r.json()["error"]
    r = httpx.post(server.url + "/v1/embeddings", json={"input": [[5, 999999]]})
    assert r.status_code == 422 and "input[0] holds token id 999999, outside this model's vocabulary" \
        in r.json()["error"]
    r = httpx.post(server.url + "/v1/embeddings", json={"input": [2 ** 63]})
    assert r.status_code == 422 and "token ids (integers within 0..2^31-1)" in r.json()["error"]


def read_replies(sock, count: int) -> list:
    """The status lines of the next `count` whole answers on a socket (bodies of content-length)."""
    data, statuses = b"", []
    while len(statuses) < count:
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            head = data[:head_end].decode("latin-1").split("\r\n")
            length = next(int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length:"))
            if len(data) >= head_end + 4 + length:
                statuses.append(head[0])
                data = data[head_end + 4 + length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed after {statuses}"
        data += chunk
    assert not data
    return statuses


def test_a_stalled_body_times_out_and_frees_its_slot(st_model):
    """Also on a kept-alive connection whose pipelined requests came first: the body's deadline is
    the connection's one timer, which each request moves forward."""
    s = Server(st_model, "--max-concurrent-requests", 1)
    whole = (b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n"
             b'{"inputs": "x"}')
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=120) as stalled:
            stalled.sendall(whole * 2)
            assert read_replies(stalled, 2) == ["HTTP/1.1 200 OK"] * 2
            stalled.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 100\r\n\r\n{\"inputs\":")  # and nothing more
            time.sleep(1)
            assert httpx.post(s.url + "/embed", json={"inputs": "y"}).status_code == 429  # its slot is held
            start = time.monotonic()
            reply = stalled.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408") and b"request body did not arrive" in reply
        assert time.monotonic() - start < 45
        assert httpx.post(s.url + "/embed", json={"inputs": "y"}).status_code == 200
        metrics = httpx.get(s.url + "/metrics").text
        assert 'ftengine_requests_total{route="embed",status="408"} 1.0' in metrics
    finally:
        assert s.stop()[0] == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_slow_or_endless_request_heads_are_cut_off(st_model, workers):
    """A head that trickles in is answered 408 and closed within the head deadline; one that grows
    past the head limit 431 at once; the service answers others meanwhile (with --workers too:
    its workers import the protocol)."""
    from ftengine.serve_http import HEAD_BYTES, HEAD_SECONDS
    s = Server(st_model, "--workers", workers)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=60) as slow, \
                socket.create_connection(("127.0.0.1", s.port), timeout=60) as endless:
            start = time.monotonic()
            slow.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\n")
            endless.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4096)
            sent = 4096
            while sent <= HEAD_BYTES:
                try:
                    endless.sendall(b"a" * 8192)
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent += 8192
            assert endless.recv(65536).startswith(b"HTTP/1.1 431")
            assert httpx.post(s.url + "/embed", json={"inputs": "y"}).status_code == 200
            for _ in range(3):  # a trickle: the deadline counts from the head's first byte
                time.sleep(1)
                slow.sendall(b"X-Slow: 1\r\n")
            reply = slow.recv(65536)
            assert reply.startswith(b"HTTP/1.1 408") and HEAD_SECONDS <= time.monotonic() - start < HEAD_SECONDS + 10
            assert slow.recv(65536) == b""  # closed
        assert httpx.post(s.url + "/embed", json={"inputs": "y"}).status_code == 200
    finally:
        assert s.stop()[0] == 0


def test_sigterm_exits_while_slow_clients_stay_connected(st_model):
    """SIGTERM with one client stalled in its head and one in its body: the process still exits,
    0, as the head and body deadlines cut them (no orchestrator has to kill it)."""
    s = Server(st_model)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=60) as head, \
                socket.create_connection(("127.0.0.1", s.port), timeout=60) as body:
            head.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\n")
            body.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"inputs\":")
            time.sleep(0.5)
            start = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            code, out = s.stop(signal_it=False)
        assert code == 0 and "Traceback" not in out and time.monotonic() - start < 45
    finally:
        if s.proc.poll() is None:
            s.stop()


def test_a_client_that_leaves_mid_body_is_no_internal_error(st_model):
    s = Server(st_model)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as gone:
            gone.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"inputs\":")
            time.sleep(0.5)
        time.sleep(1)
        metrics = httpx.get(s.url + "/metrics").text
        assert 'status="500"' not in metrics
        code, out = s.stop()
        assert code == 0 and "Traceback" not in out and "internal error" not in out
    finally:
        if s.proc.poll() is None:
            s.stop()


def test_workers_share_the_concurrency_limit_rounding_up(st_model):
    s = Server(st_model, "--workers", 2, "--max-concurrent-requests", 3)
    try:
        assert httpx.get(s.url + "/info").json()["max_concurrent_requests"] == 2
    finally:
        assert s.stop()[0] == 0


def test_tokenize_decode_and_routes_of_other_tasks(server, st_model):
    from tokenizers import Tokenizer
    reference = Tokenizer.from_file(str(st_model / "tokenizer.json"))
    r = httpx.post(server.url + "/tokenize", json={"inputs": ["hello world", "The quick fox"]})
    assert r.status_code == 200, r.text
    rows = r.json()
    assert rows[0][0]["special"] and rows[0][-1]["special"]  # [CLS] ... [SEP]
    for text, tokens in zip(["hello world", "The quick fox"], rows):
        for tok in tokens:
            if not tok["special"]:
                assert text[tok["start"]:tok["stop"]].lower().startswith(tok["text"].lower().replace("##", "")[:1])
    ids = [tok["id"] for tok in rows[0]]
    assert ids == reference.encode("hello world").ids
    plain = httpx.post(server.url + "/tokenize", json={"inputs": "hello world", "add_special_tokens": False}).json()
    assert [tok["id"] for tok in plain[0]] == ids[1:-1]
    for skip in (True, False):
        decoded = httpx.post(server.url + "/decode", json={"ids": [ids], "skip_special_tokens": skip}).json()
        assert decoded == [reference.decode(ids, skip_special_tokens=skip)]
    bad = httpx.post(server.url + "/decode", json={"ids": [[1, 10 ** 9]]})
    assert bad.status_code == 422 and "ids[0] holds token id" in bad.json()["error"]
    other = httpx.post(server.url + "/rerank", json={"query": "q", "texts": ["a"]})
    assert other.status_code == 404 and "runs an embedding model (POST /embed" in other.json()["error"]
