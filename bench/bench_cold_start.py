"""Cold and warm start: whole `ftengine encode` and `ftengine generate` processes, with empty and
with filled caches, for this tree and (--baseline) another checkout of ftengine, in one run.

Models: the default model's shape and tokenizer with random weights (bench_pipeline.make_model),
and GPT-2 small's shape (weights/fixtures.py, its byte-level test vocabulary). Each figure is the
wall time of a fresh process (Python start, imports, model load, kernel compile or cache load,
tokenizer tables, graph capture, output):
  - cold: empty CuPy kernel cache and ftengine cache (algorithm file, tokenizer tables),
  - warm: the same caches after the cold run (best of 3),
  - imports alone: `python -c "import ftengine.cli"` (best of 3).
Python's bytecode is cached as an installed environment has it (pip compiles it at install): in a
folder of the run's own (PYTHONPYCACHEPREFIX), filled by one import of the packages before any
timing; the GPU machine's image ships its packages without bytecode and sets
PYTHONDONTWRITEBYTECODE, so that every process compiled some 170 modules from source.
Then, for this tree, each kernel module the first encode and the first generate compile (those
BertRunner and GPT2Runner ask for), compiled alone, one after the other, in one process with an empty
cache (the first run compiles them in parallel threads).

Usage: python bench/bench_cold_start.py --model-src PATH [--baseline PATH] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_pipeline import make_model  # noqa: E402

TARGETS = {"encode_cold_s": 3.0, "encode_warm_s": 1.2, "generate_cold_s": 3.0}
WARM_RUNS = 3
# the packages a run imports, compiled to bytecode before the timings
PRIME = "import ftengine.cli, ftengine.backends.cuda.ops, cupy, cupy.cuda.compiler, safetensors, tokenizers"

MODULE_TIMES = """
import json, sys, time
from pathlib import Path
from ftengine.backends.cuda import families, kernels
from ftengine.config import load_bert_config, load_gpt2_config
from ftengine.models import bert, gpt2
asked = []
families.prepare = lambda files, types, only: asked.append((files, types, only))
encoder, decoder = load_bert_config(Path(sys.argv[1])), load_gpt2_config(Path(sys.argv[2]))
# as BertRunner and GPT2Runner ask for these models
bert.prepare_kernels(encoder, families, "fp16", "packed")
gpt2.prepare_kernels(decoder, families, "fp16")
for run, (files, types, only) in zip(("encode", "generate"), asked):
    for file, key, index in kernels.modules_of(files, types, only=only):
        names = kernels.groups(file, key)[index]
        t0 = time.perf_counter()
        kernels.module(file, key, index).get_function(names[0])
        print(json.dumps({"run": run, "file": file, "type": key, "kernels": len(names), "first": names[0],
                          "seconds": round(time.perf_counter() - t0, 3)}), flush=True)
"""


def timed(tree: Path, args, env: dict) -> float:
    """Wall seconds of `python args` run in `tree` (its ftengine) with `env` added (Python's bytecode
    written where env's PYTHONPYCACHEPREFIX says)."""
    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=tree,
                          env={**base, "PYTHONPATH": str(tree), **env})
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, args[:4]))} failed in {tree}: {proc.stderr[-2000:]}")
    return seconds


def bytecode(tmp: Path) -> dict:
    """The environment that keeps the runs' bytecode in tmp."""
    return {"PYTHONPYCACHEPREFIX": str(tmp / "pycache")}


def starts(tree: Path, command: list, tmp: Path, name: str) -> dict:
    """Cold and warm (best of WARM_RUNS) wall seconds of `python -m ftengine.cli command` in `tree`."""
    cache = {"CUPY_CACHE_DIR": str(tmp / f"{name}-cupy"), "XDG_CACHE_HOME": str(tmp / f"{name}-cache"),
             **bytecode(tmp)}
    args = ["-m", "ftengine.cli", *command]
    cold = timed(tree, args, cache)
    warm = min(timed(tree, args, cache) for _ in range(WARM_RUNS))
    out = {"cold_s": round(cold, 2), "warm_s": round(warm, 2)}
    print(json.dumps({"tree": str(tree), "run": name, **out}), flush=True)
    return out


def measure(tree: Path, encoder: Path, gpt2: Path, tmp: Path, label: str) -> dict:
    one = tmp / "one.txt"
    timed(tree, ["-c", PRIME], bytecode(tmp))
    imports = min(timed(tree, ["-c", "import ftengine.cli"], bytecode(tmp)) for _ in range(WARM_RUNS))
    result = {"imports_s": round(imports, 2)}
    result["encode"] = starts(tree, ["encode", one, "-o", tmp / "one.npy", "--model", encoder, "--device", "cuda",
                                     "--quiet"], tmp, f"{label}-encode")
    result["generate"] = starts(tree, ["generate", "--model", gpt2, "--prompt", "The quick brown fox",
                                       "--max-new-tokens", "8", "--device", "cuda"], tmp, f"{label}-generate")
    return result


def module_times(encoder: Path, gpt2: Path, tmp: Path) -> list:
    """Each module of the first encode, then of the first generate (those the encode compiled already
    are loaded from the cache: about 0 s)."""
    proc = subprocess.run([sys.executable, "-c", MODULE_TIMES, str(encoder), str(gpt2)], capture_output=True, text=True,
                          cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "CUPY_CACHE_DIR": str(tmp / "modules-cupy")})
    if proc.returncode != 0:
        raise SystemExit(f"module compile times failed: {proc.stderr[-2000:]}")
    return sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda r: -r["seconds"])


def markdown(r: dict) -> str:
    trees = [("this tree", r["after"])] + ([(f"baseline ({r['baseline_label']})", r["before"])] if "before" in r else [])
    out = [f"# Cold and warm start — {r['device']}, {r['date']}", "",
           "Wall time of a whole process (Python start, imports, model load, kernel compile or cache load, tokenizer "
           "tables, graph capture, output): `ftengine encode` of one line with the default model's shape and tokenizer, "
           "`ftengine generate` of 8 tokens with GPT-2 small's shape. Cold: empty kernel and ftengine caches; warm: the "
           f"caches filled, best of {WARM_RUNS}. Python's bytecode cached as an installed environment has it (filled "
           "before the timings). Versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items())
           + ".", "",
           "| figure | " + " | ".join(name for name, _ in trees) + " | target |",
           "|---|" + "---|" * len(trees) + "---|"]
    rows = [("encode, cold", lambda t: t["encode"]["cold_s"], TARGETS["encode_cold_s"]),
            ("encode, warm", lambda t: t["encode"]["warm_s"], TARGETS["encode_warm_s"]),
            ("generate, cold", lambda t: t["generate"]["cold_s"], TARGETS["generate_cold_s"]),
            ("generate, warm", lambda t: t["generate"]["warm_s"], None),
            ("imports alone (`import ftengine.cli`)", lambda t: t["imports_s"], None)]
    for name, get, target in rows:
        out.append(f"| {name} | " + " | ".join(f"{get(t):.2f} s" for _, t in trees) + " | "
                   + (f"<= {target} s" if target else "") + " |")
    for run in ("encode", "generate"):
        out += ["", f"The first {run}'s kernel modules, each compiled alone (NVRTC, empty cache; the first run compiles "
                "the ones its model needs in parallel threads), slowest first"
                + (" (those the encode compiled too are loaded from the cache)" if run == "generate" else "") + ":", "",
                "| file | type | kernels | first kernel | seconds |", "|---|---|---|---|---|"]
        out += [f"| {m['file']} | {m['type']} | {m['kernels']} | `{m['first']}` | {m['seconds']:.2f} |"
                for m in r["modules"] if m.get("run", "encode") == run]
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-src", type=Path, required=True, help="the default model's config and tokenizer files")
    parser.add_argument("--baseline", type=Path, help="another checkout (its ftengine/ and kernels_cu/) to time alike")
    parser.add_argument("--baseline-label", default="baseline", help="what the baseline is, for the table")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    import cupy
    import numpy as np
    from weights.fixtures import write_gpt2_checkpoint
    tmp = Path(tempfile.mkdtemp(prefix="ftengine-cold-"))
    encoder = make_model(args.model_src, tmp / "encoder")
    gpt2 = write_gpt2_checkpoint(tmp / "gpt2", n_embd=768, n_layer=12, n_head=12, n_positions=1024)
    (tmp / "one.txt").write_text("The quick brown fox jumps over the lazy dog.\n", encoding="utf-8")
    result = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "date": date.today().isoformat(),
              "versions": {"python": platform.python_version(), "cupy": cupy.__version__, "numpy": np.__version__},
              "cpus": os.cpu_count()}
    if args.baseline:
        result["baseline_label"] = args.baseline_label
        result["before"] = measure(args.baseline.resolve(), encoder, gpt2, tmp, "before")
    result["after"] = measure(ROOT, encoder, gpt2, tmp, "after")
    result["modules"] = module_times(encoder, gpt2, tmp)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cold_start.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "cold_start.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
