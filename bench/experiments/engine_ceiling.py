"""What the classify engine can do at bench_serve's in-flight volume without HTTP (issue 54):
64 clients of 32 texts keep at most 2,048 texts in flight. Here P processes (the engine
processes of `serve --engine-processes P`) of T threads each call Classifier.logits on S texts in
a closed loop, P x T x S = 2,048, for 4 s; texts/s over all of them, against one process given
all 20,000 texts at once (bench_serve's offline figure), before and after. The all-MiniLM-L6-v2
shape with a three-label head and bench_serve's texts, fp16, the default tokenizer.

Between this ceiling and the served figure lies what the service adds: HTTP, the workers' event
loops, the link to the engine processes and how the clients' requests join.

    PYTHONPATH=. python3 bench/experiments/engine_ceiling.py --model-src PATH [--in-flight N] [--layouts 4x1,1x1]

--in-flight 1,024: the half of the clients' volume that the engines hold at once when each worker's
requests go in two alternating submissions (one on the engine while the other's replies and next
requests are on the event loop), as traced under bench_serve's load.

PATH: an all-MiniLM-L6-v2 folder (its config and tokenizer; random weights replace its own), as
bench_serve.py takes it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

IN_FLIGHT = 2048
# (processes, threads a process), each thread's calls of IN_FLIGHT / (processes x threads) texts
LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2)]
SECONDS = 4.0


def child(model: str):
    """One engine process: loads, says ready, then runs each layout it is sent (threads 0: idle)."""
    from ftengine import Classifier
    texts = json.loads((Path(model) / "texts.json").read_text())
    with Classifier.from_pretrained(model, device="cuda") as head:
        head.logits(texts[:512])
        print("ready", flush=True)
        for line in sys.stdin:
            threads, size, start = json.loads(line)
            if threads == 0:
                print(0, flush=True)
                continue
            for _ in range(2):  # this size's graphs, before the clock
                head.logits(texts[:size])
            time.sleep(max(0.0, start - time.time()))
            counts, stop = [0] * threads, start + SECONDS

            def loop(k):
                at = k * size
                while time.time() < stop:
                    first = at % (len(texts) - size)
                    chunk = texts[first:first + size]
                    head.logits(chunk)
                    counts[k] += len(chunk)
                    at += threads * size
            workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            print(sum(counts) / (time.time() - start), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-src", type=Path, required=True)
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT, help="texts in flight over all threads")
    parser.add_argument("--layouts", type=lambda v: [tuple(map(int, x.split("x"))) for x in v.split(",")],
                        default=LAYOUTS, help="PxT,...: P processes of T threads each")
    args = parser.parse_args()
    from bench.bench_pipeline import make_model
    from bench.bench_serve import fill_tables, offline_head, sentences
    from weights.fixtures import add_classification_head
    tmp = Path(tempfile.mkdtemp())
    model = make_model(args.model_src, tmp / "model")
    fill_tables(model)
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        (model / name).unlink(missing_ok=True)
    add_classification_head(model, num_labels=3)
    texts = sentences(model / "vocab.txt", 20_000)
    (model / "texts.json").write_text(json.dumps(texts))
    before = offline_head(model, "classify", texts)
    most = max(p for p, _ in args.layouts)
    procs = [subprocess.Popen([sys.executable, __file__, "child", str(model)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(most)]
    for proc in procs:
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit("an engine process failed to start")
    rows = []
    for processes, threads in args.layouts:
        size, start = args.in_flight // (processes * threads), time.time() + 3
        for k, proc in enumerate(procs):
            proc.stdin.write(json.dumps([threads if k < processes else 0, size, start]) + "\n")
            proc.stdin.flush()
        rows.append((processes, threads, size, sum(float(proc.stdout.readline()) for proc in procs)))
    for proc in procs:
        proc.stdin.close()
        proc.wait()
    after = offline_head(model, "classify", texts)
    offline = (before + after) / 2
    print(f"offline, all 20,000 texts in one call: {before:,.0f} and {after:,.0f} texts/s\n")
    print("| processes | threads each | texts a call | texts/s | vs offline |")
    print("|---|---|---|---|---|")
    for processes, threads, size, rate in rows:
        print(f"| {processes} | {threads} | {size} | {rate:,.0f} | {rate / offline:.2f} |")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        child(sys.argv[2])
    else:
        main()
