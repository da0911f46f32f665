"""cuBLASLt algorithm choice: each product shape's algorithm, timed once per process and shared by
every thread (so two engines compute a shape with the same algorithm, bit for bit), and kept in the
GPU's algorithm file (algo_cache.py) for the processes after it.

Per row bucket (rows up to the next power of two, the other dimensions the same) the algorithm
timed fastest for the first shape of that bucket is reused by its later shapes where cuBLASLt
accepts it: a batch's padded shapes are many, and their trials would cost more than they gain.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from . import cublas as cb
from .algo_cache import AlgoCache, cache_folder, key_text
from .kernels import kernel_cache_dir
from .runtime import _planning, context


# the cuBLASLt algorithm each product shape runs, chosen once per process and shared by every
# thread (so two engines compute a shape with the same algorithm, bit for bit): plan key -> algo;
# and per row bucket (rows up to the next power of two, the other dimensions the same) the algorithm
# timed fastest for the first shape of that bucket, which later shapes of it reuse where cuBLASLt
# accepts it (a batch's padded shapes are many, their trials would cost more than they gain). Both
# are kept on disk for later processes (algo_cache.py, _earlier_algo).
_ALGOS = {}
_BUCKET_ALGOS = {}
_ALGOS_LOCK = threading.Lock()
TRIAL_REPEATS = 10  # products per timed graph of each candidate algorithm

# products of fewer rows run cuBLASLt's heuristic's first algorithm untimed. The best of its candidates
# gained up to 19% at 32,768 rows and 3-8% at 4,096 (BERT-base's 32 x 128 tokens: QKV 23.6 -> 22.5 us,
# attention output 9.5 -> 8.9, bench/results/gemm.md 2026-11-25); at 128 rows 0-10% of 3.4-6.6 us,
# about the noise of a trial's 10 products there
TRIAL_MIN_ROWS = 4096


def _fill_random(a):
    """a = standard normal values in its storage type (bf16 words truncated from float32)."""
    cupy = context().cupy
    values = cupy.random.standard_normal(a.shape, dtype=np.float32)
    a[...] = (values.view(np.uint32) >> 16).astype(np.uint16) if a.dtype == np.uint16 else values.astype(a.dtype)


def _row_bucket(key):
    """The plan key with its rows (key[3]) rounded up to a power of two."""
    return key[:3] + (1 << (key[3] - 1).bit_length(),) + key[4:]


def _earlier_algo(ctx, key):
    """The algorithm chosen before for key, now key's own, where cuBLASLt runs key with it: the one
    an earlier process timed for key itself (the GPU's algorithm file, algo_cache.py), else the one
    timed for the first shape of key's row bucket (in this process, else in an earlier one: a bucket
    then holds the earlier process's algorithm, as it did there); None: key gets a trial of its own."""
    bucket = _row_bucket(key)
    entries = _algo_file(ctx)[1]
    algo = _stored_algo(entries, "shape", key)
    if algo is None or not ctx.lt.supports(key, algo):
        stored = _stored_algo(entries, "bucket", bucket)
        with _ALGOS_LOCK:
            if bucket not in _BUCKET_ALGOS and stored is not None:
                _BUCKET_ALGOS[bucket] = stored
            algo = _BUCKET_ALGOS.get(bucket)
        if algo is None or not ctx.lt.supports(key, algo):
            return None
    with _ALGOS_LOCK:
        return _ALGOS.setdefault(key, algo)


def _stored_algo(entries, kind: str, key):
    """The algorithm file's entry for a shape's or a row bucket's plan key, None where it has none."""
    raw = entries.get(key_text((kind, *key)))
    return None if raw is None else cb.algo_from_bytes(raw)


_ALGO_FILES = {}  # (folder, fingerprint) -> (AlgoCache, its entries: read once, then what this process adds)


def _algo_file(ctx) -> tuple:
    """The GPU's algorithm file (algo_cache.py) and its entries (name -> bytes)."""
    fingerprint = {"device": ctx.device_name, "capability": list(ctx.capability), "sms": ctx.sm_count,
                   "cublaslt": ctx.lt.version, "workspace": cb.WORKSPACE_BYTES, "candidates": cb.CANDIDATES}
    where = (cache_folder(kernel_cache_dir()), json.dumps(fingerprint, sort_keys=True))
    with _ALGOS_LOCK:
        if where not in _ALGO_FILES:
            cache = AlgoCache(where[0], fingerprint)
            _ALGO_FILES[where] = (cache, cache.load())
        return _ALGO_FILES[where]


def _keep_algos(ctx, chosen: dict):
    """Add timed algorithms ((kind, *plan key) -> algo) to the GPU's algorithm file, but for entries
    it holds already."""
    cache, entries = _algo_file(ctx)
    with _ALGOS_LOCK:
        new = {key_text(k): bytes(a) for k, a in chosen.items() if key_text(k) not in entries}
        entries.update(new)
    if new:
        cache.save(new)


# Measurements: docs/gpu-internals.md, algos.py _choose_algo
def _choose_algo(ctx, key, product):
    """The fastest of the shape's candidate algorithms on this call's operands, recorded for the
    whole process and in the GPU's algorithm file for the processes after it (with the row bucket's
    algorithm, where the file has none: _keep_algos): each candidate's TRIAL_REPEATS products
    captured in a graph, replayed once to warm up and once between events (launched one by one
    from Python, a small product would measure the host's launch rate instead of the GPU)."""
    cupy = ctx.cupy
    candidates = ctx.lt.candidates(key)
    times = []
    for algo in candidates:
        ctx.stream.begin_capture()
        try:
            for _ in range(TRIAL_REPEATS):
                product(algo)
        finally:
            graph = ctx.stream.end_capture()
        graph.launch(stream=ctx.stream)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(ctx.stream)
        graph.launch(stream=ctx.stream)
        end.record(ctx.stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    bucket = _row_bucket(key)
    with _ALGOS_LOCK:
        algo = _ALGOS.setdefault(key, candidates[int(np.argmin(times))])
        bucket_algo = _BUCKET_ALGOS.setdefault(bucket, algo)
    _keep_algos(ctx, {("shape", *key): algo, ("bucket", *bucket): bucket_algo})
    return algo


def algorithm(ctx, key, product, x):
    """The algorithm cuBLASLt runs plan key with (None: its heuristic's first): from TRIAL_MIN_ROWS
    rows on, outside a capture, the one chosen before (_earlier_algo) or else timed now on the call's
    operands (`product(algo)` runs it; x is its input)."""
    algo = _ALGOS.get(key)
    if algo is None and key[3] >= TRIAL_MIN_ROWS and not ctx.stream.is_capturing():
        algo = _earlier_algo(ctx, key)
        if algo is None:
            if _planning():  # x holds what the skipped launches left (zeros in a new workspace): time on real-like values
                _fill_random(x)
            algo = _choose_algo(ctx, key, product)
    return algo
