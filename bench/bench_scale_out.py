"""Scale-out benchmark: `ftengine encode-dataset` on Ray with 1 and 2 GPU workers, against the
single-process `ftengine encode` on the same rows, all in one run on one machine.

The model has the default model's shape and its real tokenizer (all-MiniLM-L6-v2's folder
files, random HF-style weights, as bench_pipeline.py). The rows are bench_pipeline.py's
realistic lines (log-normal token counts, mean about 100, some over the 256-token limit) in
Parquet shards with an id column; the single-process run reads the same rows from one Parquet
file. Each run is a fresh CLI process writing Parquet; a Ray head (`ray start`) with the
machine's GPUs is started once, so the Ray figures include each job's actor start and model
load but not the cluster's start. Rows/s is rows / process wall time, and the job's own
figure (the CLI summary) is reported beside it. Each Ray worker gets its GPU's share of the
machine's CPUs (the CLI's default); one run gives a single worker all of them, and the
single-process CLI runs with all CPUs and with one worker's share.

Usage: python bench/bench_scale_out.py --model-src PATH --out bench/results [--lines 2000000 --shards 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_pipeline import make_lines, make_model  # noqa: E402

RAY_SUMMARY = re.compile(r"ftengine: (\d+) rows from (\d+) files, \d+ files already done, ([\d.]+) s, (\d+) rows/s")
ENCODE_SUMMARY = re.compile(r"ftengine: (\d+) lines, (\d+) tokens, .* ([\d.]+) s, (\d+) lines/s")
TARGET_SPEEDUP = 1.8


def write_shards(lines_file: Path, folder: Path, shards: int, whole: Path) -> int:
    """The lines as `shards` Parquet files (id, text) under `folder`, and all of them in `whole`."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = lines_file.read_text(encoding="utf-8").split("\n")[:-1]
    table = pa.table({"id": pa.array(range(len(texts)), pa.int64()), "text": pa.array(texts, pa.string())})
    pq.write_table(table, whole, row_group_size=65536)
    folder.mkdir(parents=True)
    size = -(-len(texts) // shards)
    for s in range(shards):
        pq.write_table(table.slice(s * size, size), folder / f"part-{s:04d}.parquet", row_group_size=65536)
    return len(texts)


def timed(command: list, env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, command[:4]))} failed:\n{proc.stderr[-4000:]}")
    return wall, proc.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_same(a: Path, b_folder: Path):
    """The Ray output, shard by shard, has every id of the single-process output once, in order,
    with the same embedding up to fp16 batching differences (cosine)."""
    import numpy as np
    import pyarrow.parquet as pq
    whole = pq.read_table(a)
    parts = [pq.read_table(p) for p in sorted(b_folder.glob("*.parquet"))]
    ids = [i for p in parts for i in p.column("id").to_pylist()]
    assert ids == whole.column("id").to_pylist(), "ids differ"

    def values(t):
        c = t.column("embedding").combine_chunks()
        return c.flatten().to_numpy(zero_copy_only=False).reshape(len(c), c.type.list_size)
    x = values(whole)
    y = np.concatenate([values(p) for p in parts])
    cos = (x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)
    return float(cos.min())


def two_processes(work: Path, model: Path, env: dict, rows: int) -> dict:
    """Two `ftengine encode` processes at once, one per GPU, on half the rows each."""
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "ftengine.cli", "encode", str(work / f"half{i}.parquet"), "-o",
                               str(work / f"half{i}.out.parquet"), "--model", str(model), "--id-column", "id"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**env, "CUDA_VISIBLE_DEVICES": str(i)}) for i in range(2)]
    outputs = [p.communicate()[1] for p in procs]
    wall = time.perf_counter() - start
    if any(p.returncode for p in procs):
        raise SystemExit("\n".join(outputs)[-4000:])
    job = sum(int(ENCODE_SUMMARY.search(o).group(4)) for o in outputs)
    return dict(wall_s=round(wall, 2), rows_per_s_wall=round(rows / wall), rows_per_s_job=job)


def markdown(r: dict) -> str:
    rows = r["runs"]
    one = rows["ray_1_worker"]["rows_per_s_wall"]
    out = [f"# Scale-out benchmark — {r['device']}, {r['date']}", "",
           f"{r['rows']:,} rows in {r['shards']} Parquet shards (id + text; realistic lines, "
           f"{r['tokens']:,} tokens after truncation at 256), all-MiniLM-L6-v2 shape and tokenizer, random "
           f"weights, fp16, Parquet output. Versions: {r['versions']}. Each `encode-dataset` worker has one GPU "
           f"and {r['cpus_per_worker']} CPUs (its share of the machine, the default), which its tokeniser uses.", "",
           "| run | wall s | rows/s (wall) | job rows/s (CLI summaries) | vs 1 Ray worker | target |",
           "|---|---|---|---|---|---|"]
    for run in rows.values():
        out.append(f"| {run['label']} | {run['wall_s']:.1f} | {run['rows_per_s_wall']:,.0f} | "
                   f"{run['rows_per_s_job']:,.0f} | {run['rows_per_s_wall'] / one:.2f}x | {run.get('target', '')} |")
    out += ["", f"Ray's outputs hold every id once, in order; minimum cosine against the single-process "
                f"embeddings: {r['min_cosine_1']:.6f} (1 worker), {r['min_cosine_2']:.6f} (2 workers).", "",
            f"Machine: {r['cpus']} CPUs, {r['gpus']}. Ray {r['ray']}, head started with `ray start`."]
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-src", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lines", type=int, default=2_000_000)
    parser.add_argument("--shards", type=int, default=16)
    args = parser.parse_args()
    import cupy
    import pyarrow
    import ray
    gpus = cupy.cuda.runtime.getDeviceCount()
    names = sorted({cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(gpus)})
    work = Path(tempfile.mkdtemp(prefix="ftengine-scale-"))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    ray_exe = shutil.which("ray", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    try:
        model = make_model(args.model_src, work / "model")
        make_lines(work / "lines.txt", args.lines, model / "vocab.txt")
        rows = write_shards(work / "lines.txt", work / "shards", args.shards, work / "all.parquet")
        runs = {}
        share = os.cpu_count() // gpus  # one worker's CPUs: its GPU's share of the machine (the CLI's default)
        for name, label, extra in (
                ("single_process", "`ftengine encode`: one process, one GPU, all CPUs", {}),
                ("single_process_share", f"`ftengine encode`: one process, one GPU, tokeniser on {share} threads",
                 {"RAYON_NUM_THREADS": str(share)})):
            wall, err = timed([sys.executable, "-m", "ftengine.cli", "encode", str(work / "all.parquet"), "-o",
                               str(work / "single.parquet"), "--model", str(model), "--id-column", "id"],
                              {**env, **extra})
            m = ENCODE_SUMMARY.search(err)
            tokens = int(m.group(2))
            runs[name] = dict(label=label, wall_s=round(wall, 2), rows_per_s_wall=round(rows / wall),
                              rows_per_s_job=int(m.group(4)))
            print(json.dumps({name: runs[name]}), flush=True)
        # the machine's own bound for two GPUs without Ray: two processes at once, one per GPU, half the rows each
        half = rows // 2
        import pyarrow.parquet as pq
        table = pq.read_table(work / "all.parquet")
        for i, part in enumerate((table.slice(0, half), table.slice(half))):
            pq.write_table(part, work / f"half{i}.parquet", row_group_size=65536)
        del table
        runs["two_processes"] = dict(two_processes(work, model, {**env, "RAYON_NUM_THREADS": str(share)}, rows),
                                     label=f"two `ftengine encode` processes at once, one per GPU, half the rows "
                                           f"each, tokeniser on {share} threads each (no Ray)")
        print(json.dumps({"two_processes": runs["two_processes"]}), flush=True)
        cosines = {}
        port = free_port()
        start = subprocess.run([ray_exe, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                                f"--num-gpus={gpus}", "--include-dashboard=false", "--disable-usage-stats"],
                               capture_output=True, text=True, env=env)
        if start.returncode != 0:
            raise SystemExit(start.stderr)
        try:
            for workers, cpus in ((1, None), (2, None), (1, os.cpu_count())):
                out = work / f"ray{workers}"
                wall, err = timed([sys.executable, "-m", "ftengine.cli", "encode-dataset", str(work / "shards"),
                                   "-o", str(out), "--model", str(model), "--id-column", "id", "--workers",
                                   str(workers), "--gpus-per-worker", "1", "--ray-address", f"127.0.0.1:{port}",
                                   *(["--cpus-per-worker", str(cpus)] if cpus else [])], env)
                m = RAY_SUMMARY.search(err)
                assert int(m.group(1)) == rows, err[-2000:]
                name = f"ray_{workers}_worker{'s' if workers > 1 else ''}" + ("_all_cpus" if cpus else "")
                runs[name] = dict(label=f"`encode-dataset`, {workers} GPU worker{'s' if workers > 1 else ''}"
                                        + (f", {cpus} CPUs" if cpus else ""),
                                  wall_s=round(wall, 2), rows_per_s_wall=round(rows / wall),
                                  rows_per_s_job=int(m.group(4)))
                if name == "ray_2_workers":
                    runs[name]["target"] = f">= {TARGET_SPEEDUP}x"
                print(json.dumps({name: runs[name]}), flush=True)
                if not cpus:
                    cosines[workers] = check_same(work / "single.parquet", out)
                shutil.rmtree(out)
        finally:
            subprocess.run([ray_exe, "stop", "--force"], capture_output=True, env=env)
        speedup = runs["ray_2_workers"]["rows_per_s_wall"] / runs["ray_1_worker"]["rows_per_s_wall"]
        result = dict(date=str(date.today()), device=f"{gpus} x {', '.join(names)}", gpus=f"{gpus} x {names[0]}",
                      cpus=os.cpu_count(), cpus_per_worker=share, rows=rows, shards=args.shards, tokens=tokens,
                      runs=runs, speedup_2_vs_1=round(speedup, 3), target_speedup=TARGET_SPEEDUP,
                      min_cosine_1=cosines[1], min_cosine_2=cosines[2], ray=ray.__version__,
                      versions=f"python {platform.python_version()}, cupy {cupy.__version__}, "
                               f"pyarrow {pyarrow.__version__}, ray {ray.__version__}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale_out.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "scale_out.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
