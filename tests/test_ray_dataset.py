"""`ftengine encode-dataset` and FtengineEmbedder on a real local Ray cluster (`ray start`, 2 CPUs):
the job equals single-process encoding row for row with ids kept, survives a killed worker
with every row embedded exactly once, resumes after an interruption, and refuses bad input
in one line."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from ftengine import Encoder
from tests.tolerances import BATCHING_INVARIANCE_FP32, EMBEDDING_COSINE_LOWP

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
RAY = shutil.which("ray", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega the of and to in is was for on with as by at from").split()


def make_texts(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) for _ in range(n)]


def write_shards(folder: Path, sizes, fmt: str = "parquet", seed: int = 0) -> dict:
    """name -> (ids, texts) of shards written under `folder` (id `doc`, text `text`)."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = {}
    for s, n in enumerate(sizes):
        texts = make_texts(n, seed + s)
        ids = [f"s{s}-{i}" for i in range(n)]
        name = f"part-{s}"
        table = pa.table({"doc": pa.array(ids, pa.string()), "text": pa.array(texts, pa.string()),
                          "extra": pa.array(range(n), pa.int64())})
        if fmt == "parquet":
            pq.write_table(table, folder / f"{name}.parquet", row_group_size=97)
        elif fmt == "csv":
            pacsv.write_csv(table, folder / f"{name}.csv")
        else:
            (folder / f"{name}.jsonl").write_text(
                "".join(json.dumps({"doc": i, "text": t}) + "\n" for i, t in zip(ids, texts)), encoding="utf-8")
        shards[name] = (ids, texts)
    return shards


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A local Ray head with 2 CPUs, started as a user starts one; its address."""
    exe = RAY
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    port = _free_port()
    env = _env()
    start = subprocess.run([str(exe), "start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
                            "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats",
                            f"--temp-dir={temp}"],
                           capture_output=True, text=True, timeout=180, env=env)
    assert start.returncode == 0, start.stdout + start.stderr
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([str(exe), "stop", "--force"], capture_output=True, timeout=120, env=env)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(gpus: bool = False) -> dict:
    """The environment of the Ray processes and the CLI: this checkout importable, and no GPU
    unless asked for."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}  # a loopback cluster of this test only
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def encode_dataset(address, *args, wait=True, env=None):
    command = [sys.executable, "-m", "ftengine.cli", "encode-dataset", *map(str, args), "--ray-address", address]
    if not wait:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or _env())
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env or _env())


CPU_WORKERS = ["--workers", "2", "--cpus-per-worker", "0.5", "--gpus-per-worker", "0"]


def read_output(path: Path, key: str = "doc"):
    table = pq.read_table(path)
    column = table.column("embedding").combine_chunks()
    values = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), column.type.list_size)
    return table.column(key).to_pylist(), values


def check_against_single_process(model, out_dir: Path, shards: dict, *, key: str = "doc", cosine: float | None = None,
                                 device: str = "cpu"):
    with Encoder.from_pretrained(model, device=device) as encoder:
        for name, (ids, texts) in shards.items():
            got_ids, got = read_output(out_dir / f"{name}.parquet", key)
            assert got_ids == (ids if key == "doc" else list(range(1, len(ids) + 1))), name
            ref = encoder.encode(texts)
            assert got.shape == ref.shape, name
            if not len(ref):
                continue
            if cosine is None:
                assert np.abs(got - ref).max() <= BATCHING_INVARIANCE_FP32, name
            else:
                assert (np.sum(got * ref, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)).min() \
                    >= cosine, name


def test_four_parquet_shards_two_workers_equal_single_process(ray_cluster, st_model, tmp_path):
    shards = write_shards(tmp_path / "in", [700, 0, 1300, 450])
    out = tmp_path / "out"
    r = encode_dataset(ray_cluster, tmp_path / "in", "-o", out, "--model", st_model, "--id-column", "doc",
                       *CPU_WORKERS)
    assert r.returncode == 0, r.stderr
    assert "2450 rows from 4 files, 0 files already done" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == [f"part-{s}.parquet" for s in range(4)]
    check_against_single_process(st_model, out, shards)
    assert pq.read_table(out / "part-1.parquet").num_rows == 0  # an empty shard gives an empty file


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_jsonl_and_csv_shards_with_line_and_row_numbers(ray_cluster, st_model, tmp_path, fmt):
    shards = write_shards(tmp_path / "in" / "nested", [300, 250], fmt=fmt, seed=7)
    out = tmp_path / "out"
    r = encode_dataset(ray_cluster, str(tmp_path / "in" / "**" / f"*.{fmt}"), "-o", out, "--model", st_model,
                       "--workers", "1", "--cpus-per-worker", "0.5")
    assert r.returncode == 0, r.stderr
    # keys as `ftengine encode` numbers them: JSONL lines, CSV rows
    check_against_single_process(st_model, out, shards, key="line" if fmt == "jsonl" else "row")


def test_embedder_in_map_batches_for_each_batch_format(ray_cluster, st_model):
    import ray.data
    from ftengine.integrations.ray import FtengineEmbedder
    texts = make_texts(300, 11)
    with Encoder.from_pretrained(st_model, device="cpu") as encoder:
        ref = encoder.encode(texts)
    ray.init(address=ray_cluster, log_to_driver=False)
    try:
        for batch_format in ("pyarrow", "numpy", "pandas"):
            ds = ray.data.from_items([{"i": i, "sentence": t} for i, t in enumerate(texts)])
            ds = ds.map_batches(FtengineEmbedder, fn_constructor_kwargs={"model": str(st_model), "device": "cpu",
                                                                         "text_column": "sentence"},
                                batch_format=batch_format, batch_size=64, num_cpus=0.5,
                                compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=2))
            rows = sorted(ds.take_all(), key=lambda row: row["i"])
            assert [row["sentence"] for row in rows] == texts, batch_format
            got = np.stack([np.asarray(row["embedding"], np.float32) for row in rows])
            assert np.abs(got - ref).max() <= BATCHING_INVARIANCE_FP32, batch_format
    finally:
        ray.shutdown()


def _worker_pids() -> list:
    """Processes of encode-dataset's Ray actors (Ray names them after the class, ShardEncoder)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"ShardEncoder" in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def _wait_for(condition, timeout: float, proc):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def test_killed_worker_job_completes_every_row_once(ray_cluster, st_model, tmp_path):
    shards = write_shards(tmp_path / "in", [4000, 4000, 4000, 4000], seed=3)
    out = tmp_path / "out"
    proc = encode_dataset(ray_cluster, tmp_path / "in", "-o", out, "--model", st_model, "--id-column", "doc",
                          *CPU_WORKERS, wait=False)
    try:
        assert _wait_for(lambda: len(_worker_pids()) >= 2, 120, proc), "the workers did not start"
        # the first file is being written: work is under way, most of it still to do
        assert _wait_for(lambda: out.is_dir() and any(p.name.endswith(".tmp") for p in out.iterdir()), 120, proc)
        assert not (out / "part-3.parquet").exists()
        before = set(_worker_pids())
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        # Ray restarts the actor in a new process (and gives it its file again)
        restarted = _wait_for(lambda: set(_worker_pids()) - before, 120, proc)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "16000 rows from 4 files" in stderr
    assert restarted, "no new worker process replaced the killed one while the job ran"
    check_against_single_process(st_model, out, shards)  # every id once, in order, with its own embedding


def test_interrupted_job_resumes_with_the_rest(ray_cluster, st_model, tmp_path):
    shards = write_shards(tmp_path / "in", [3000] * 6, seed=5)
    out = tmp_path / "out"
    args = (tmp_path / "in", "-o", out, "--model", st_model, "--id-column", "doc", *CPU_WORKERS)
    proc = encode_dataset(ray_cluster, *args, wait=False)
    try:
        assert _wait_for(lambda: (out / "part-0.parquet").exists(), 300, proc), "no shard finished"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and "finished files are kept" in stderr, stderr
    done = sorted(p.name for p in out.iterdir())
    # the first shard finished and the job stopped before the last: which others the workers finished
    # before the signal landed depends on timing (a run saw parts 1 and 3 done, 2 not)
    assert "part-0.parquet" in done and len(done) < len(shards), done
    assert not [name for name in done if not name.endswith(".parquet")]  # no temporary file left behind
    before = {name: (out / name).stat().st_mtime_ns for name in done}
    r = encode_dataset(ray_cluster, *args)
    assert r.returncode == 0, r.stderr
    assert f"from {len(shards) - len(done)} files, {len(done)} files already done" in r.stderr
    assert {name: (out / name).stat().st_mtime_ns for name in done} == before  # finished files not redone
    check_against_single_process(st_model, out, shards)
    r = encode_dataset(ray_cluster, *args)
    assert r.returncode == 0 and f"0 rows from 0 files, {len(shards)} files already done" in r.stderr


def test_bad_dataset_input_is_one_line(ray_cluster, st_model, tmp_path):
    folder = tmp_path / "in"
    write_shards(folder, [50, 60])
    out = tmp_path / "out"
    r = encode_dataset(ray_cluster, folder, "-o", out, "--model", st_model, "--text-column", "body", *CPU_WORKERS)
    assert r.returncode == 1 and "part-0.parquet: no text column 'body' (columns: 'doc', 'text', 'extra')" in r.stderr
    r = encode_dataset(ray_cluster, tmp_path / "nothing", "-o", out, "--model", st_model)
    assert r.returncode == 1 and "no input files match" in r.stderr
    pq.write_table(pa.table({"text": ["fine", None, "x"]}), folder / "part-2.parquet")
    r = encode_dataset(ray_cluster, folder, "-o", out, "--model", st_model, *CPU_WORKERS)
    assert r.returncode == 1 and "part-2.parquet, row 2: column 'text' is null, not a string" in r.stderr, r.stderr
    # past the rows checked before the job starts, a worker finds it, and names its row
    pq.write_table(pa.table({"text": ["fine"] * 9000 + [None]}), folder / "part-2.parquet")
    r = encode_dataset(ray_cluster, folder, "-o", out, "--model", st_model, *CPU_WORKERS)
    assert r.returncode == 1, r.stderr
    assert re.search(r"part-2\.parquet, row 9001: column 'text' is null, not a string", r.stderr), r.stderr
    assert "Traceback" not in r.stderr
    assert not (out / "part-2.parquet").exists()
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # the stopped workers' files removed
    r = encode_dataset(ray_cluster, folder, "-o", folder, "--model", st_model, *CPU_WORKERS)
    assert r.returncode == 1 and "would overwrite it" in r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("workers", [1, 2])
def test_gpu_workers_equal_single_process(st_model, tmp_path, workers):
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < workers:
        pytest.skip(f"needs {workers} GPUs")
    shards = write_shards(tmp_path / "in", [2000, 1500, 2500, 1000], seed=9)
    out = tmp_path / "out"
    exe = RAY
    port = _free_port()
    env = _env(gpus=True)
    start = subprocess.run([str(exe), "start", "--head", f"--port={port}", "--num-cpus=8", f"--num-gpus={workers}",
                            "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats",
                            f"--temp-dir={tempfile.mkdtemp(prefix='ray', dir='/tmp')}"], capture_output=True, text=True, timeout=180, env=env)
    assert start.returncode == 0, start.stderr
    try:
        r = encode_dataset(f"127.0.0.1:{port}", tmp_path / "in", "-o", out, "--model", st_model, "--id-column", "doc",
                           env=env)
    finally:
        subprocess.run([str(exe), "stop", "--force"], capture_output=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "7000 rows from 4 files" in r.stderr
    check_against_single_process(st_model, out, shards, cosine=EMBEDDING_COSINE_LOWP, device="cuda")


def test_workers_the_cluster_cannot_hold_are_refused_before_starting(ray_cluster, st_model, tmp_path):
    write_shards(tmp_path / "in", [20, 20, 20])
    for args in (["--workers", "3", "--gpus-per-worker", "0"], ["--workers", "1", "--cpus-per-worker", "4"]):
        start = time.monotonic()
        r = encode_dataset(ray_cluster, tmp_path / "in", "-o", tmp_path / "out", "--model", st_model, *args)
        assert r.returncode == 1 and "do not fit in the Ray cluster (2 CPUs, 0 GPUs" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and time.monotonic() - start < 60
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_sigterm_stops_a_job_whose_workers_wait_for_resources(ray_cluster, st_model, tmp_path):
    """Another job holds the cluster's CPUs: the worker cannot start, no file is handed to it, and
    SIGTERM still ends the job at once, leaving no worker behind."""
    write_shards(tmp_path / "in", [20, 20])
    class Holder:  # defined here: Ray ships a local class by value (this module is not importable there)
        def ready(self):
            return True

    ray.init(address=ray_cluster, logging_level="ERROR", log_to_driver=False)
    try:
        holder = ray.remote(num_cpus=2)(Holder).remote()
        ray.get(holder.ready.remote())
        proc = encode_dataset(ray_cluster, tmp_path / "in", "-o", tmp_path / "out", "--model", st_model,
                              "--workers", "1", "--gpus-per-worker", "0", wait=False)
        try:
            time.sleep(8)  # the job is up and waits for its worker
            assert proc.poll() is None
            stopped = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 143 and "terminated" in stderr, stderr
        assert time.monotonic() - stopped < 30
        assert _wait_for(lambda: not _worker_pids(), 30, subprocess.Popen(["sleep", "30"]))
        assert not list((tmp_path / "out").glob("*.parquet"))
    finally:
        ray.shutdown()


def test_output_folder_inside_the_input_folder_is_not_read_as_input(ray_cluster, st_model, tmp_path):
    folder = tmp_path / "g3c"
    shards = write_shards(folder, [30, 40], fmt="jsonl")
    args = (folder, "-o", folder / "emb", "--model", st_model, "--id-column", "doc", *CPU_WORKERS)
    r = encode_dataset(ray_cluster, *args)
    assert r.returncode == 0 and "70 rows from 2 files" in r.stderr, r.stderr
    r = encode_dataset(ray_cluster, *args)  # the advertised resume: nothing left to do
    assert r.returncode == 0 and "0 rows from 0 files, 2 files already done" in r.stderr, r.stderr
    check_against_single_process(st_model, folder / "emb", shards)


def test_damaged_and_invalid_parquet_shards(ray_cluster, st_model, tmp_path):
    from tests.test_bad_input import damaged_parquet, invalid_utf8_parquet
    folder = tmp_path / "in"
    folder.mkdir()
    damaged_parquet(folder / "a.parquet", group=0)
    r = encode_dataset(ray_cluster, folder, "-o", tmp_path / "out", "--model", st_model, *CPU_WORKERS)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "a.parquet as Parquet: row group 1 of 5" in r.stderr
    damaged_parquet(folder / "a.parquet", group=3)  # past the rows checked before the job: a worker finds it
    r = encode_dataset(ray_cluster, folder, "-o", tmp_path / "out", "--model", st_model, *CPU_WORKERS)
    assert r.returncode == 1 and "row group 4 of 5 (rows 3001..4000) is damaged" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "RayTaskError" not in r.stderr
    (folder / "a.parquet").unlink()
    invalid_utf8_parquet(folder / "b.parquet")
    r = encode_dataset(ray_cluster, folder, "-o", tmp_path / "out", "--model", st_model, *CPU_WORKERS)
    assert r.returncode == 1 and "b.parquet, row 3: invalid UTF-8 in column 'text'" in r.stderr, r.stderr
    r = encode_dataset(ray_cluster, folder, "-o", tmp_path / "out", "--model", st_model, "--errors", "replace",
                       "--id-column", "id", *CPU_WORKERS)
    assert r.returncode == 0, r.stderr
    ids, got = read_output(tmp_path / "out" / "b.parquet", "id")
    with Encoder.from_pretrained(st_model, device="cpu") as encoder:
        expected = encoder.encode(["alpha beta", "gamma", "bad \ufffd\ufffd bytes", "delta"])
    assert ids == ["a", "b", "c", "d"] and np.abs(got - expected).max() <= BATCHING_INVARIANCE_FP32


def test_quiet_prints_nothing_on_a_new_local_cluster(st_model, tmp_path):
    write_shards(tmp_path / "in", [10])
    env = {k: v for k, v in _env().items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    r = encode_dataset("local", tmp_path / "in", "-o", tmp_path / "out", "--model", st_model, "--quiet",
                       "--gpus-per-worker", "0", env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert (tmp_path / "out" / "part-0.parquet").exists()
