"""HTTP service benchmark: `ftengine serve` on loopback under a closed-loop load.

The server runs as its own process with the default model's shape and tokenizer (random
weights); clients are 8 processes of asyncio aiohttp clients, each client sending its next
request when the last is answered, for a fixed time. Cases: the server with 1 and with 4
worker processes (`--workers`); 1, 16, 64 and 256 clients, each request one short sentence or
a batch of 32 (--clients, --batches pick fewer). Reported: requests/s, embeddings/s, p50/p99
latency; for scale, the offline engine (`Encoder.encode` in one process) on the same texts. With
--tokenizers gpu,cpu, each case runs with each tokenizer (`serve --tokenizer`), against the offline
engine with the same one.

--task rerank / classify: the same model shape with a random ...ForSequenceClassification head
(one label: a cross-encoder served at TEI's POST /rerank, a query and 32 texts a request; three
labels: POST /predict, 32 texts a request), 64 clients, against Reranker.scores /
Classifier.logits offline on the same inputs, with each of --tokenizers; results in
serve_{task}.{json,md} unless --name says otherwise. With --bare, the same load also goes to a bare
ASGI app under the same uvicorn with each worker count (serve_bare.py: it parses each body and
sends a canned reply): what the HTTP stack itself serves, the ceiling of any Python service here.
--engines per-worker,processes,shared times each worker count with one engine in each worker (the
default), with `serve --engine-processes N` (an engine process beside each of the N workers) and
with `serve --shared-engine` (one engine process for all the workers). --shape bert-base: the
model's layers widened to BERT-base's (12 x 768, the size of the sentiment / NLI / moderation
classifiers people deploy) over the same tokenizer; the default is all-MiniLM-L6-v2's own.

Needs the serve extra plus aiohttp. Usage:
python bench/bench_serve.py --model-src PATH --out bench/results [--workers 1,4] [--task embed|rerank|classify]
       [--tokenizers auto|gpu,cpu] [--clients 1,16,64,256] [--batches 1,32] [--name NAME] [--bare]
       [--engines per-worker,processes,shared] [--shape minilm|bert-base]
(bench/results/serve_tokenizer.md: --workers 1,4 --tokenizers gpu,cpu --clients 64 --batches 1,32
--name serve_tokenizer)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CLIENT_PROCESSES = 8
SECONDS = 6.0
WARMUP = 1.5
TARGETS = {"ratio_64": 0.70, "p50_1_ms": 3.0}
OFFLINE_REPEATS = 5
# --shape: config entries over the model source's (make_model), and the results' words for them
SHAPES = {"minilm": ({}, "all-MiniLM-L6-v2 shape and tokenizer"),
          "bert-base": (dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
                        "BERT-base shape (12 layers x 768) with all-MiniLM-L6-v2's tokenizer")}


def sentences(vocab: Path, n: int, seed: int = 0) -> list[str]:
    words = [w for w in vocab.read_text(encoding="utf-8").split("\n") if w.isalpha() and len(w) > 2]
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, size=int(rng.integers(6, 20)))) for _ in range(n)]


ROUTES = {"embed": "/embed", "rerank": "/rerank", "classify": "/predict"}


def request_body(task: str, inputs, query: str) -> dict:
    return {"query": query, "texts": inputs} if task == "rerank" else {"inputs": inputs}


def client_process(url: str, clients: int, batch: int, texts: list, seconds: float, warmup: float, queue,
                   task: str = "embed"):
    """`clients` closed-loop aiohttp clients (C HTTP parser; httpx's pure-Python one cost more
    CPU per request than the server did); every answer is parsed and its shape checked."""
    import aiohttp
    import orjson

    async def one(http, k, stop_at, start_at, latencies):
        i = k * 131
        while time.perf_counter() < stop_at:
            inputs = [texts[(i + j) % len(texts)] for j in range(batch)] if batch > 1 else texts[i % len(texts)]
            body = orjson.dumps(request_body(task, inputs, texts[(i + 1) % len(texts)]))
            t0 = time.perf_counter()
            async with http.post(url + ROUTES[task], data=body, headers={"content-type": "application/json"}) as r:
                data = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{r.status}: {data[:200]!r}")
            rows = orjson.loads(data)
            t1 = time.perf_counter()
            if len(rows) != batch:
                raise RuntimeError(f"{len(rows)} rows for {batch} inputs")
            if t0 >= start_at:
                latencies.append(t1 - t0)
            i += 7919

    async def main():
        latencies = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as http:
            start_at = time.perf_counter() + warmup
            stop_at = start_at + seconds
            await asyncio.gather(*(one(http, k, stop_at, start_at, latencies) for k in range(clients)))
        return latencies

    queue.put(asyncio.run(main()))


def run_case(url: str, clients: int, batch: int, texts: list, task: str = "embed") -> dict:
    procs = min(CLIENT_PROCESSES, clients)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    shares = [clients // procs + (1 if p < clients % procs else 0) for p in range(procs)]
    workers = [ctx.Process(target=client_process, args=(url, n, batch, texts, SECONDS, WARMUP, queue, task))
               for n in shares]
    for w in workers:
        w.start()
    latencies = [x for _ in workers for x in queue.get()]
    for w in workers:
        w.join()
    lat = np.array(latencies) * 1000
    row = {"clients": clients, "batch": batch, "requests_per_s": round(len(lat) / SECONDS, 1),
           "embeddings_per_s": round(len(lat) * batch / SECONDS), "p50_ms": round(float(np.percentile(lat, 50)), 2),
           "p99_ms": round(float(np.percentile(lat, 99)), 2)}
    print(json.dumps(row), flush=True)
    return row


@contextmanager
def start_server(model: Path, tmp: Path, workers: int, tokenizer: str = "auto", engine: str = "per-worker"):
    """`ftengine serve --workers N --tokenizer T` (engine "processes": with --engine-processes N;
    "shared": with --shared-engine) on a free port; yields its URL once every worker has warmed up."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp / f"server-{workers}.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "ftengine.cli", "serve", "--model", str(model), "--device", "cuda", "--port", str(port),
             "--max-client-batch-size", "64", "--workers", str(workers), "--tokenizer", tokenizer,
             *(["--shared-engine"] if engine == "shared" else []),
             *(["--engine-processes", str(workers)] if engine == "processes" else [])], stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    deadline = time.monotonic() + 180
    while log_path.read_text().count("ftengine.serve ready:") < workers:
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise SystemExit("the server did not become ready:\n" + log_path.read_text())
        time.sleep(0.2)
    print(f"server with {workers} workers ready", flush=True)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=120)


@contextmanager
def start_bare(workers: int, task: str):
    """serve_bare.py's app under uvicorn with `workers` processes on a free port; yields its URL
    once it accepts connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "bench.serve_bare:app", "--port", str(port), "--workers", str(workers),
         "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"], cwd=ROOT,
        env={**os.environ, "BARE_TASK": task, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise SystemExit("the bare app did not start") from None
            time.sleep(0.1)
    time.sleep(2.0)  # every worker listening, not only the first
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=60)


def fill_tables(model: Path):
    """Build the GPU tokenizer's tables once before any timing: on a fresh machine every process
    (each server worker too) would measure the Unicode tables, seconds of CPU in the first case,
    tokenising on the CPU meanwhile; after this they load from the disk cache."""
    from ftengine import Encoder
    with Encoder.from_pretrained(model, device="cuda", tokenizer="gpu") as enc:
        enc.tokenizer.tables  # waits for the build


def offline(model: Path, texts: list, tokenizer: str = "auto") -> float:
    from ftengine import Encoder
    with Encoder.from_pretrained(model, device="cuda", tokenizer=tokenizer) as enc:
        enc.encode(texts[:2000])
        return len(texts) / median_seconds(lambda: enc.encode(texts))


def median_seconds(fn) -> float:
    """bench_decoder.timed's median of OFFLINE_REPEATS calls of fn, in seconds (one call of 20,000
    inputs lasts a fraction of a second: a single timing varied by 20% from run to run)."""
    from bench.bench_decoder import timed
    return timed(fn, repeat=OFFLINE_REPEATS) / 1e3


def offline_head(model: Path, task: str, texts: list, tokenizer: str = "auto") -> float:
    """Inputs/s of Reranker.scores (pairs of a query and each text, 32 texts a query, as the
    clients send them) or Classifier.logits, one process, after a warm-up."""
    from ftengine import Classifier, Reranker
    if task == "rerank":
        inputs = [(texts[(i // 32 + 1) % len(texts)], t) for i, t in enumerate(texts)]
        with Reranker.from_pretrained(model, device="cuda", tokenizer=tokenizer) as head:
            head.scores(inputs[:2000])
            return len(inputs) / median_seconds(lambda: head.scores(inputs))
    with Classifier.from_pretrained(model, device="cuda", tokenizer=tokenizer) as head:
        head.logits(texts[:2000])
        return len(texts) / median_seconds(lambda: head.logits(texts))


def markdown_head(r: dict) -> str:
    what = ("TEI `POST /rerank`, a query and 32 texts a request, one-label cross-encoder head"
            if r["task"] == "rerank" else "TEI `POST /predict`, 32 texts a request, three-label classification head")
    out = [f"# HTTP service benchmark, {r['task']} — {r['device']}, {r['date']}", "",
           f"`ftengine serve` ({what}) on 127.0.0.1, {SHAPES[r.get('shape', 'minilm')][1]}, random weights, fp16; "
           f"closed-loop aiohttp clients in {CLIENT_PROCESSES} processes, {SECONDS:.0f} s per case after {WARMUP} s of "
           f"warm-up. Offline ({'Reranker.scores' if r['task'] == 'rerank' else 'Classifier.logits'}, one process, "
           f"same inputs, the median of {OFFLINE_REPEATS} calls): "
           + ", ".join(f"{v:,.0f} inputs/s ({k} tokenizer)" for k, v in r["offline_inputs_per_s"].items()) + ".", "",
           "| tokenizer | engine | workers | clients | inputs per request | requests/s | inputs/s | vs offline | p50 ms "
           "| p99 ms |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for c in r["cases"]:
        offline_rate = r["offline_inputs_per_s"].get(c["tokenizer"])
        ratio = f"{c['embeddings_per_s'] / offline_rate:.2f}" if offline_rate else "-"
        engine = c.get("engine", "-" if c["tokenizer"] == "bare" else "per-worker")
        out.append(f"| {c['tokenizer']} | {engine} | {c['workers']} | {c['clients']} | "
                   f"{c['batch']} | {c['requests_per_s']:,} | "
                   f"{c['embeddings_per_s']:,} | {ratio} | {c['p50_ms']} | {c['p99_ms']} |")
    out += ["", f"Target (issue 54): with 4 workers at 64 clients, at least {TARGETS['ratio_64']:.0%} of the offline "
            "throughput."]
    if any(c.get("engine") == "processes" for c in r["cases"]):
        out.append("Rows \"processes\": `serve --engine-processes N`, each worker's engine in a process of its own.")
    if any(c["tokenizer"] == "bare" for c in r["cases"]):
        out.append("Rows \"bare\": no model, a bare ASGI app under the same uvicorn that parses each body and sends a "
                   "canned reply of the same shape (bench/serve_bare.py): the HTTP stack's own ceiling.")
    out.append("")
    return "\n".join(out)


def markdown(r: dict) -> str:
    out = [f"# HTTP service benchmark — {r['device']}, {r['date']}", "",
           f"`ftengine serve` (TEI `POST /embed`) on 127.0.0.1, {SHAPES[r.get('shape', 'minilm')][1]}, random "
           f"weights, fp16; closed-loop aiohttp clients in {CLIENT_PROCESSES} processes, {SECONDS:.0f} s per case "
           f"after {WARMUP} s of warm-up. Offline engine (`Encoder.encode`, one process, same texts, the median of "
           f"{OFFLINE_REPEATS} calls), embeddings/s: "
           + ", ".join(f"{v:,.0f} ({k} tokenizer)" for k, v in r["offline_embeddings_per_s"].items()) + ". Versions: "
           + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + ".", "",
           "| tokenizer | workers | clients | inputs per request | requests/s | embeddings/s | vs offline | p50 ms | p99 ms |",
           "|---|---|---|---|---|---|---|---|---|"]
    for c in r["cases"]:
        offline_rate = r["offline_embeddings_per_s"][c["tokenizer"]]
        out.append(f"| {c['tokenizer']} | {c['workers']} | {c['clients']} | {c['batch']} | {c['requests_per_s']:,} | "
                   f"{c['embeddings_per_s']:,} | {c['embeddings_per_s'] / offline_rate:.2f} | {c['p50_ms']} | {c['p99_ms']} |")
    out += ["", f"Targets: at 64 clients, embeddings/s >= {TARGETS['ratio_64']:.0%} of the offline engine's; p50 for "
            f"one short sentence at 1 client <= {TARGETS['p50_1_ms']} ms.", ""]
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-src", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--workers", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4],
                        help="server worker counts to measure (comma-separated)")
    parser.add_argument("--task", choices=list(ROUTES), default="embed")
    parser.add_argument("--tokenizers", type=lambda v: v.split(","), default=["auto"],
                        help="`serve --tokenizer` values to measure (comma-separated)")
    parser.add_argument("--clients", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16, 64, 256])
    parser.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 32])
    parser.add_argument("--name", help="the results' file name: serve (embed) or serve_TASK unless given")
    parser.add_argument("--engines", type=lambda v: v.split(","), default=["per-worker"],
                        help="rerank / classify: per-worker, processes (serve --engine-processes N) and/or shared "
                             "(serve --shared-engine), comma-separated")
    parser.add_argument("--shape", choices=list(SHAPES), default="minilm",
                        help="the model's layers: the model source's own, or BERT-base's")
    parser.add_argument("--bare", action="store_true",
                        help="rerank / classify: also time a bare ASGI app (serve_bare.py) under the same load")
    args = parser.parse_args()
    from bench.bench_pipeline import make_model
    import cupy
    tmp = Path(tempfile.mkdtemp(prefix="ftengine-serve-"))
    model = make_model(args.model_src, tmp / "model", SHAPES[args.shape][0])
    fill_tables(model)
    texts = sentences(model / "vocab.txt", 20_000)
    if args.task != "embed":
        head_task(args, model, texts, tmp, cupy)
        return
    cases = []
    for tokenizer in args.tokenizers:
        for workers in args.workers:
            with start_server(model, tmp, workers, tokenizer) as url:
                cases += [dict(run_case(url, c, b, texts), workers=workers, tokenizer=tokenizer)
                          for b in args.batches for c in args.clients]
    props = cupy.cuda.runtime.getDeviceProperties(0)
    result = {"shape": args.shape, "device": props["name"].decode(), "date": date.today().isoformat(),
              "versions": {"python": platform.python_version(), "cupy": cupy.__version__},
              "offline_embeddings_per_s": {t: round(offline(model, texts, t)) for t in args.tokenizers}, "cases": cases}
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.name or "serve"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


def head_task(args, model: Path, texts: list, tmp: Path, cupy):
    """The rerank / classify rows: the model with a random head, 64 clients of 32 inputs each."""
    from weights.fixtures import add_classification_head
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        (model / name).unlink(missing_ok=True)  # a ...ForSequenceClassification folder, not an embedder
    add_classification_head(model, num_labels=1 if args.task == "rerank" else 3)
    cases = []
    for tokenizer in args.tokenizers:
        for engine in args.engines:
            for workers in args.workers:
                if engine != "per-worker" and workers < 2:
                    continue
                with start_server(model, tmp, workers, tokenizer, engine) as url:
                    cases.append(dict(run_case(url, 64, 32, texts, args.task), workers=workers, tokenizer=tokenizer,
                                      engine=engine))
    for workers in args.workers if args.bare else ():
        with start_bare(workers, args.task) as url:
            cases.append(dict(run_case(url, 64, 32, texts, args.task), workers=workers, tokenizer="bare", engine="-"))
    props = cupy.cuda.runtime.getDeviceProperties(0)
    result = {"task": args.task, "shape": args.shape, "device": props["name"].decode(), "date": date.today().isoformat(),
              "offline_inputs_per_s": {t: round(offline_head(model, args.task, texts, t)) for t in args.tokenizers},
              "cases": cases}
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.name or f"serve_{args.task}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(markdown_head(result))
    print(markdown_head(result))


if __name__ == "__main__":
    main()
