"""The `ftengine` command line: parse, call the library, print. No model logic here.

Installed as the `ftengine` console script (ftengine.cli:main); the repository's top-level
cli.py runs the same app from a source checkout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from itertools import islice

import click
import numpy as np

from . import Encoder, FtengineError, Reranker
from .backends import DEVICES
from .cli_support import Commands, close_engine, closes_on_failure, exits_when_stopped, fail, rate, text_option
from .cli_text import classify, generate, ner, translate
from .encoder import DTYPES, ENCODER_DTYPES, EncodeStats
from .errors import DeviceError, InputError
from .gpu_tokenizer import AUTO_MIN_TEXTS, TOKENIZER_CHOICES
from .hub import model_folder
from .output import PRECISIONS, calibration_ranges, needs_ranges, output_dtype
from .records import INPUT_FORMATS, embed_records, input_format, open_records
from .textio import iter_lines
from .writers import FORMATS, EmbeddingWriter, check_writable, output_format



@click.group(cls=Commands)
@click.version_option(package_name="ftengine")
def main():
    """ftengine: transformer inference on raw CUDA kernels (NumPy reference on the CPU)."""


@main.command()
@click.argument("input_path", metavar="[INPUT|-]", default="-")
@click.option("-o", "--output", default="-", show_default=True,
              help="Output file (.npy, .parquet or .jsonl); '-' writes JSONL to stdout.")
@click.option("--input-format", "input_format_name", type=click.Choice(INPUT_FORMATS), default=None,
              help="Input format. Default: from the input's file name (.txt, .jsonl, .csv, .tsv, .parquet); "
                   "text lines on stdin.")
@click.option("--text-field", "--text-column", "text_field", default=None,
              help="The JSONL field or the CSV/TSV/Parquet column holding the text. Default: text.")
@click.option("--id-field", "--id-column", "id_field", default=None,
              help="A JSONL field or CSV/TSV/Parquet column carried to the output as each row's key "
                   "(default key: the line number, or the row number for CSV/TSV/Parquet).")
@click.option("--model", "model_path", default=None,
              help="Model folder (HF/sentence-transformers). Default: the installed all-MiniLM-L6-v2.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(ENCODER_DTYPES), default=None,
              help="Compute precision. Default: fp16 on the GPU, fp32 on the CPU. fp8: e4m3 products (GPUs of "
                   "compute capability 8.9+).")
@click.option("--batch-tokens", type=click.IntRange(min=1), default=None,
              help="Token budget per batch: real tokens (packed layout) or batch size x longest "
                   "(padded). Default: 16384 on the GPU, 4096 on the CPU.")
@click.option("--max-length", type=click.IntRange(min=2), default=None,
              help="Longest tokenised text; longer texts are truncated. Default: the model folder's.")
@click.option("--pooling", default=None,
              help="cls, mean, max, mean_sqrt_len, weightedmean, lasttoken, or several joined by commas. Default: the model folder's.")
@click.option("--normalize/--no-normalize", default=None,
              help="L2-normalise embeddings. Default: the model folder's (Normalize module).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Output format. Default: from the output's file name; JSONL on stdout.")
@click.option("--errors", type=click.Choice(["strict", "replace"]), default="strict", show_default=True,
              help="Invalid UTF-8: fail naming the line, or replace with U+FFFD.")
@click.option("--truncate/--no-truncate", default=True, show_default=True,
              help="Truncate over-long lines (counted in the summary) or fail naming the line.")
@click.option("--layout", type=click.Choice(["auto", "packed", "padded"]), default="auto", show_default=True,
              help="packed: padding-free with fused attention; padded: batched-GEMM attention. "
                   "auto: packed when the model's head size is 32, 64 or 128.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
              help="Replay each batch shape as a captured CUDA graph (off: direct launches, for debugging).")
@click.option("--tokenizer", type=click.Choice(TOKENIZER_CHOICES), default="auto", show_default=True,
              help="gpu: WordPiece models tokenised on the GPU (the same ids as HF tokenizers); cpu: HF "
                   f"tokenizers; auto: gpu where it covers the model's tokenizer, for calls of {AUTO_MIN_TEXTS} texts "
                   "or more (fewer are faster on the CPU).")
@click.option("--prompt-name", default=None,
              help="Put the model's prompt of this name (config_sentence_transformers.json) before each line.")
@click.option("--prompt", default=None, help="Put this text before each line (instead of a named prompt).")
@click.option("--dimensions", type=click.IntRange(min=1), default=None,
              help="Keep the first N values of each embedding (Matryoshka models).")
@click.option("--precision", type=click.Choice(PRECISIONS), default="float32", show_default=True,
              help="Output precision, as sentence-transformers' quantize_embeddings.")
@click.option("--ranges", "ranges_path", default=None,
              help="int8/uint8: a .npy of shape (2, dim), each dimension's min and max.")
@click.option("--calibration", "calibration_path", default=None,
              help="int8/uint8: a .npy of float embeddings (n, dim) to take the ranges from.")
@click.option("--quiet", is_flag=True, help="No progress bar and no summary.")
def encode(input_path, output, input_format_name, text_field, id_field, model_path, device, dtype, batch_tokens,
           max_length, pooling, normalize, fmt, errors, truncate, layout, cuda_graphs, tokenizer, prompt_name, prompt,
           dimensions, precision, ranges_path, calibration_path, quiet):
    """Embed each record of INPUT: the lines of a UTF-8 text file ('-': stdin), or the text field of
    a JSONL, CSV, TSV or Parquet file. One row per record, in order, with its key (line or row
    number, or --id-field). The input is read and the output written as the work goes, so memory
    does not grow with the file."""
    encoder = None
    with closes_on_failure(lambda: close_engine(encoder)):
        fmt = output_format(output, fmt)
        in_fmt = input_format(input_path, input_format_name)
        if in_fmt == "txt" and (text_field is not None or id_field is not None):
            raise InputError("--text-field and --id-field apply to jsonl, csv, tsv and parquet input; "
                             f"{input_path} is read as text lines (see --input-format)")
        if fmt == "npy" and id_field is not None:
            raise InputError(f"--id-field: {output} is .npy output, which holds the embeddings alone (in input "
                             "order); write .jsonl or .parquet to keep the ids")
        text_option(prompt, "--prompt", empty=True)
        check_writable(output)
        records = open_records(input_path, in_fmt, text_field=text_field or "text", id_field=id_field,
                               errors=errors)
        ranges = _ranges(precision, ranges_path, calibration_path)
        encoder = Encoder.from_pretrained(model_path, device=device, dtype=dtype, max_length=max_length,
                                          cuda_graphs=cuda_graphs, layout=layout, tokenizer=tokenizer)
        post = dict(prompt_name=prompt_name, prompt=prompt, dimensions=dimensions, precision=precision,
                    ranges=ranges)
        stats = EncodeStats()
        start = time.perf_counter()
        show_bar = not quiet and sys.stderr.isatty()
        from tqdm import tqdm
        with tqdm(unit="line", disable=not show_bar, file=sys.stderr) as bar, \
                EmbeddingWriter(output, fmt, encoder.output_dim(pooling, dimensions=dimensions, precision=precision),
                                output_dtype(precision), key_name=records.key_name,
                                key_type=records.key_type) as writer:
            embed_records(encoder, records, writer, batch_tokens=batch_tokens, pooling=pooling,
                          normalize=normalize, truncate=truncate, stats=stats, progress=bar.update, **post)
        stats.seconds = time.perf_counter() - start
        encoder.close()
    if not quiet:
        busy = stats.device_seconds / stats.seconds if stats.seconds > 0 else 0.0
        click.echo(
            f"ftengine: {stats.lines} lines, {stats.tokens} tokens, {stats.truncated} truncated, "
            f"{encoder.output_dim(pooling)}-dim on {encoder.device} ({encoder.dtype}), "
            f"{stats.seconds:.2f} s, {rate(stats.lines, stats.seconds)} lines/s, device busy {100 * busy:.0f}% "
            f"-> {'stdout' if output == '-' else output}",
            err=True,
        )


@main.command(name="encode-dataset")
@click.argument("input_path", metavar="INPUT_GLOB_OR_DIR")
@click.option("-o", "--output-dir", required=True,
              help="Folder of the output: one Parquet file per input file, at the same relative path.")
@click.option("--input-format", "input_format_name", type=click.Choice(("parquet", "jsonl", "csv", "tsv")),
              default=None, help="Input format. Default: from the files' names.")
@click.option("--text-column", "--text-field", "text_column", default="text", show_default=True,
              help="The column (JSONL: field) holding the text.")
@click.option("--id-column", "--id-field", "id_column", default=None,
              help="A column carried to the output as each row's key (default: as encode, the line number for "
                   "JSONL, the row number for CSV/TSV/Parquet).")
@click.option("--model", "model_path", default=None,
              help="Model folder, readable by every worker. Default: the installed all-MiniLM-L6-v2.")
@click.option("--dtype", type=click.Choice(ENCODER_DTYPES), default=None,
              help="Compute precision. Default: fp16 on GPU workers, fp32 on CPU workers. fp8: e4m3 products (GPUs "
                   "of compute capability 8.9+).")
@click.option("--batch-tokens", type=click.IntRange(min=1), default=None, help="Token budget per device batch.")
@click.option("--max-length", type=click.IntRange(min=2), default=None,
              help="Longest tokenised text; longer texts are truncated. Default: the model folder's.")
@click.option("--pooling", default=None, help="Pooling mode(s), as for encode. Default: the model folder's.")
@click.option("--normalize/--no-normalize", default=None, help="L2-normalise embeddings. Default: the model folder's.")
@click.option("--prompt-name", default=None, help="Put the model's prompt of this name before each text.")
@click.option("--prompt", default=None, help="Put this text before each text.")
@click.option("--dimensions", type=click.IntRange(min=1), default=None,
              help="Keep the first N values of each embedding (Matryoshka models).")
@click.option("--errors", type=click.Choice(["strict", "replace"]), default="strict", show_default=True,
              help="Text that is not valid UTF-8 / Unicode: fail naming the file and row, or replace with U+FFFD.")
@click.option("--ray-address", default=None,
              help="The Ray cluster to run on (host:port, or 'auto'). Default: the cluster last started on this "
                   "machine (ray start), else a new local one.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Embedding workers (Ray actors), each with its own model. Default: as many as the "
                   "cluster's GPUs allow, or 1 without GPUs.")
@click.option("--gpus-per-worker", type=click.FloatRange(min=0), default=None,
              help="GPUs per worker; 0 runs the workers on the CPU. Default: 1 if the cluster has GPUs, else 0.")
@click.option("--cpus-per-worker", type=click.FloatRange(min=0), default=None,
              help="CPUs per worker, which its tokeniser uses (threads). Default: a GPU worker's share of its "
                   "machine's CPUs (CPUs x gpus-per-worker / GPUs), 1 for CPU workers.")
@click.option("--tokenizer", type=click.Choice(TOKENIZER_CHOICES), default="auto", show_default=True,
              help="Where WordPiece models are tokenised, as for encode.")
@click.option("--quiet", is_flag=True, help="No progress and no summary.")
def encode_dataset(input_path, output_dir, input_format_name, text_column, id_column, model_path, dtype,
                   batch_tokens, max_length, pooling, normalize, prompt_name, prompt, dimensions, errors, ray_address,
                   workers, gpus_per_worker, cpus_per_worker, tokenizer, quiet):
    """Embed a dataset of Parquet, JSONL, CSV or TSV files (a folder, a glob, or one file) on a Ray
    cluster, one Parquet file out per file in, each written by the worker that embeds it (the
    output folder must be writable at the same path by every worker). Work is shared out by
    file: give at least as many files as workers. A file whose output exists is skipped, so a
    re-run after an interruption does only the rest. Needs the ray extra:
    pip install 'ftengine[ray]'."""
    try:
        import ray
        from .integrations.ray import (check_resources, check_shards, default_cpus_per_worker,
                                       encode_dataset as run_job, ftengine_error_in, plan_shards)
    except ImportError as e:
        fail(f"ftengine encode-dataset needs the ray extra (pip install 'ftengine[ray]'): {e}")
    try:
        text_option(prompt, "--prompt", empty=True)
        fmt, shards = plan_shards(input_path, output_dir, input_format_name)
        check_shards(shards, fmt, text_column, id_column, errors=errors)
        if not os.path.isdir(output_dir):
            os.makedirs(output_dir, exist_ok=True)
        if model_path is not None:  # a Hub id resolved here: the workers read the cache's folder
            model_path = os.path.abspath(model_folder(model_path))
    except OSError as e:
        fail(f"cannot create output folder {output_dir}: {e.strerror}")
    except FtengineError as e:
        fail(str(e))
    todo = sum(not s.done for s in shards)
    if todo and not ray.is_initialized():
        import logging
        try:
            ray.init(address=ray_address, logging_level=logging.ERROR if quiet else logging.WARNING,
                     log_to_driver=not quiet)
        except (ConnectionError, ValueError) as e:
            fail(f"cannot join the Ray cluster{f' at {ray_address}' if ray_address else ''}: {e}")
    if todo:
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus_per_worker is None:
            gpus_per_worker = 1.0 if gpus else 0.0
        if workers is None:
            workers = max(1, int(gpus // gpus_per_worker)) if gpus and gpus_per_worker else 1
        if gpus_per_worker and workers * gpus_per_worker > gpus:
            fail(f"{workers} workers x {gpus_per_worker:g} GPUs need {workers * gpus_per_worker:g} GPUs; the Ray "
                  f"cluster has {gpus:g} (see --workers, --gpus-per-worker)")
        if cpus_per_worker is None:
            cpus_per_worker = default_cpus_per_worker(gpus_per_worker)
        try:
            check_resources(min(workers, todo), cpus_per_worker, gpus_per_worker)
        except FtengineError as e:
            fail(str(e))
    embedder = dict(model=model_path, dtype=dtype, batch_tokens=batch_tokens, max_length=max_length, pooling=pooling,
                    normalize=normalize, prompt_name=prompt_name, prompt=prompt, dimensions=dimensions,
                    tokenizer=tokenizer)
    from tqdm import tqdm
    with exits_when_stopped(note=" (finished files are kept; run again to do the rest)"), \
            tqdm(unit="row", disable=quiet or not sys.stderr.isatty(), file=sys.stderr) as bar:
        try:
            stats = run_job(shards, fmt, text_column=text_column, id_column=id_column, errors=errors,
                            workers=workers or 1,
                            gpus_per_worker=gpus_per_worker or 0.0,
                            cpus_per_worker=1.0 if cpus_per_worker is None else cpus_per_worker,
                            embedder=embedder, progress=bar.update)
        except Exception as e:
            cause = ftengine_error_in(e)
            if cause is None:
                raise
            fail(str(cause).splitlines()[0])  # Ray appends retry advice that does not apply to bad input
    if not quiet:
        click.echo(f"ftengine: {stats.rows} rows from {stats.shards_written} files, {stats.shards_skipped} files "
                   f"already done, {stats.seconds:.2f} s, {rate(stats.rows, stats.seconds)} rows/s -> {output_dir}",
                   err=True)


def _ranges(precision: str, ranges_path, calibration_path):
    """The int8/uint8 ranges from --ranges or --calibration (checked against the model's
    dimension when encoding starts); None for other precisions."""
    if ranges_path and calibration_path:
        fail("give --ranges or --calibration, not both")
    if not needs_ranges(precision):
        if ranges_path or calibration_path:
            fail(f"--ranges and --calibration apply to int8 and uint8 only, not to --precision {precision}")
        return None
    if not (ranges_path or calibration_path):
        fail(f"--precision {precision} needs --ranges FILE.npy or --calibration FILE.npy: the ranges must be known "
              "before the first line is written")
    path = ranges_path or calibration_path
    try:
        array = np.load(path, allow_pickle=False)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError:  # NumPy's advice (allow_pickle) does not apply: only a plain array will do
        raise InputError(f"{path} is not a .npy array file (--ranges and --calibration take one, from numpy.save)") \
            from None
    if not isinstance(array, np.ndarray):
        raise InputError(f"{path} is a .npz archive, not a .npy array file (--ranges and --calibration take one)")
    if ranges_path:
        return array
    try:
        return calibration_ranges(array)
    except InputError as e:
        raise InputError(f"{path}: {e}") from None



@main.command()
@click.option("--model", "model_paths", multiple=True,
              help="Model folder or Hub id, NAME=PATH to name it; repeat to serve several models (the first of each "
                   "task answers the usual routes, every one its own under /models/NAME/). Default: the installed "
                   "all-MiniLM-L6-v2.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(ENCODER_DTYPES), default=None)
@click.option("--max-batch-tokens", type=click.IntRange(min=1), default=None,
              help="Token budget of one device batch (shared by concurrent requests).")
@click.option("--max-client-batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Most inputs in one request (413 above).")
@click.option("--max-input-length", type=click.IntRange(min=2), default=None,
              help="Longest input in tokens. Default: the model folder's.")
@click.option("--max-concurrent-requests", type=click.IntRange(min=1), default=512, show_default=True,
              help="Requests in progress at once (429 with Retry-After above).")
@click.option("--api-key", envvar="FTENGINE_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every route but /health (401 otherwise). Prefer the "
                   "FTENGINE_API_KEY environment variable or --api-key-file: a command-line argument is visible "
                   "to other users in ps.")
@click.option("--api-key-file", type=click.Path(dir_okay=False), default=None,
              help="Read the API key from this file (its first line).")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Service processes on one port, each with its own copy of the model: HTTP and JSON work "
                   "in parallel, batches packed per process.")
@click.option("--tokenizer", type=click.Choice(TOKENIZER_CHOICES), default="auto", show_default=True,
              help="Where WordPiece models are tokenised, as for encode (NER models: the CPU).")
@click.option("--engine-processes", type=click.IntRange(min=1), default=None,
              help="With --workers N: run the models in this many processes of their own, the workers (which "
                   "then only speak HTTP) shared out among them, a copy of each model on the device per "
                   "process. N: the fastest under heavy load; 1: the models once on the device "
                   "(docs/service.md). Default: each worker runs its own.")
@click.option("--shared-engine", is_flag=True, help="The same as --engine-processes 1.")
def serve(model_paths, host, port, device, dtype, max_batch_tokens, max_client_batch_size, max_input_length,
          max_concurrent_requests, api_key, api_key_file, workers, tokenizer, engine_processes, shared_engine):
    """Serve a model over HTTP: an embedding model at TEI's POST /embed and OpenAI's POST
    /v1/embeddings, a reranker (a cross-encoder) at TEI's POST /rerank and Cohere's / Jina's POST
    /v1/rerank, a classifier at TEI's POST /predict, a token classifier (NER) at POST /ner (needs
    the `serve` extra: pip install ftengine[serve])."""
    try:
        from .reranker import model_task
        from .serve import ServeLimits
        from .serve_process import WorkerSettings, load_models, serve as run_service, serve_workers
        import uvicorn  # noqa: F401  (refused here, not mid-start, when the extra is missing)
    except ImportError as e:
        fail(f"ftengine serve needs the serve extra (pip install 'ftengine[serve]'): {e}")
    if api_key_file is not None:
        if api_key is not None:
            fail("give the API key once: --api-key (or FTENGINE_API_KEY) or --api-key-file")
        try:
            with open(api_key_file, encoding="utf-8") as f:
                api_key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            fail(f"cannot read the API key file {api_key_file}: {getattr(e, 'strerror', None) or e}")
    if api_key is not None and not api_key:
        fail("the API key is empty")
    limits = ServeLimits(max_client_batch_size=max_client_batch_size, max_concurrent_requests=max_concurrent_requests,
                         max_batch_tokens=max_batch_tokens, api_key=api_key)
    specs = []
    try:
        for given in model_paths or (None,):
            name, path = (given.split("=", 1) if given and "=" in given and not os.path.exists(given)
                          else (given or "sentence-transformers/all-MiniLM-L6-v2", given))
            if not name or any(name == s[0] for s in specs):
                raise InputError(f"--model {given}: each model needs a name of its own (NAME=PATH)")
            specs.append([name, path, model_task(path)])
    except FtengineError as e:
        fail(str(e))
    if shared_engine:
        if engine_processes not in (None, 1):
            fail(f"--shared-engine is --engine-processes 1, not {engine_processes}: give one of them")
        engine_processes = 1
    if engine_processes and workers < 2:
        fail(f"--{'shared-engine' if shared_engine else 'engine-processes'} runs the models for the "
             "workers: it needs --workers 2 or more")
    if engine_processes and engine_processes > workers:
        fail(f"--engine-processes {engine_processes} is more than --workers {workers}: the others would idle")
    if workers > 1:  # each worker loads the models and reports its own errors
        settings = WorkerSettings(models=specs, device=device, dtype=dtype, max_length=max_input_length,
                                  limits=limits, tokenizer=tokenizer, engine_processes=engine_processes or 0)
        try:
            started = serve_workers(settings, host=host, port=port, workers=workers)
        except FtengineError as e:
            fail(f"an engine process could not start: {e}")
        if not started:
            fail("a service worker could not start (its error is above)")
        return
    try:
        loaded = load_models(specs, device=device, dtype=dtype, max_length=max_input_length,
                             batch_tokens=max_batch_tokens, tokenizer=tokenizer)
        run_service(loaded, host=host, port=port, limits=limits)
    except FtengineError as e:
        fail(str(e))


RERANK_WINDOW = 4096  # documents scored per call: only their scores are kept


@main.command()
@click.argument("input_path", metavar="[INPUT|-]", default="-")
@click.option("--query", required=True, help="The query every document (one per input line) is scored against.")
@click.option("--model", "model_path", required=True, help="Cross-encoder folder (...ForSequenceClassification).")
@click.option("--top-k", type=click.IntRange(min=1), default=None, help="Print only the best K documents.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(ENCODER_DTYPES), default=None)
@click.option("--max-length", type=click.IntRange(min=2), default=None,
              help="Longest query + document in tokens (longer pairs are cut longest-first).")
@click.option("--batch-tokens", type=click.IntRange(min=1), default=None)
@click.option("--errors", type=click.Choice(["strict", "replace"]), default="strict", show_default=True)
def rerank(input_path, query, model_path, top_k, device, dtype, max_length, batch_tokens, errors):
    """Score each line of INPUT against --query with a cross-encoder; print JSONL
    {"index": line number from 0, "score": ...}, best first (CrossEncoder.rank's order)."""
    reranker = None
    with closes_on_failure(lambda: close_engine(reranker)):
        text_option(query, "--query")
        lines = iter_lines(input_path, errors=errors)
        reranker = Reranker.from_pretrained(model_path, device=device, dtype=dtype, max_length=max_length)
        if reranker.num_labels != 1:
            raise InputError(f"{model_path}: rerank needs one score per pair; this model has "
                             f"{reranker.num_labels} labels")
        parts = []
        while window := list(islice(lines, RERANK_WINDOW)):
            parts.append(reranker.predict([(query, d) for d in window], batch_tokens=batch_tokens))
        reranker.close()
        if not parts:
            raise InputError(f"no documents in {'<stdin>' if input_path == '-' else input_path}: rerank scores "
                             "one document a line")
    scores = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    order = np.argsort(-scores, kind="stable")[:top_k]
    for i in order:  # line by line: one huge write to a pipe whose reader left can end without an error
        sys.stdout.write(json.dumps({"index": int(i), "score": float(scores[i])}) + "\n")
    sys.stdout.flush()


WARMUP_WORDS = ("the quick brown fox jumps over the lazy dog while a small river runs past the old mill and "
                "people walk home after work").split()
# (texts, words per text) a model's warm-up runs: one text, a short batch, long batches of the
# sizes whose products take the algorithm file's timed choices
WARMUP_BATCHES = ((1, 8), (32, 16), (256, 100), (1024, 100))


@main.command()
@click.option("--dtype", "dtypes", type=click.Choice(ENCODER_DTYPES), multiple=True,
              help="Compile for these dtypes only (repeatable). Default: every dtype (fp8 where the GPU has it).")
@click.option("--model", "model_path", default=None,
              help="Also load this model (folder or Hub id) and run it on a few batches of several sizes: what it "
                   "compiles and the algorithm file's product choices are then on disk.")
def warmup(dtypes, model_path):
    """Compile every CUDA kernel into the on-disk kernel cache (e.g. while building a container
    image), so that a first run starts without compiling; with --model, also run that model
    once on batches of several sizes."""
    from .backends import cuda_available
    if not cuda_available():
        fail("warmup compiles CUDA kernels and needs a usable GPU (CuPy and a CUDA device)")
    if model_path is not None:
        with closes_on_failure(lambda: None):
            seconds = _warm_model(model_path, dtypes[0] if dtypes else None)
        click.echo(f"ftengine: {model_path} run once on {len(WARMUP_BATCHES)} batch sizes in {seconds:.1f} s", err=True)
    from .backends.cuda import families, kernels, ops
    from .models.bert import FP8_FILES
    start = time.perf_counter()
    if "fp8" in dtypes:
        try:
            ops.check_fp8()
        except DeviceError as e:
            fail(str(e))
    elif not dtypes:
        try:
            ops.check_fp8()
            dtypes = ENCODER_DTYPES
        except DeviceError:
            dtypes = DTYPES
    types = [kernels.CUDA_TYPES[np.dtype(ops.STORAGE[d]).name] for d in dtypes]
    files = [f for f in sorted(families.FAMILIES) if (f not in FP8_FILES or "fp8" in dtypes)
             and (f not in kernels.ARCH_SPECIFIC or ops.context().wgmma)]
    kernels.prepare(files, types)
    click.echo(f"ftengine: kernels compiled for {', '.join(dtypes)} in {time.perf_counter() - start:.1f} s", err=True)


def _warm_model(model_path: str, dtype) -> float:
    """Run the model at model_path (an encoder, a reranker or classifier, a translator or GPT-2)
    on the CUDA backend over WARMUP_BATCHES; the seconds it took."""
    from .config import SEQ2SEQ_FAMILIES, read_json
    from .reranker import model_task
    start = time.perf_counter()
    folder = model_folder(model_path)
    model_type = read_json(folder / "config.json", "model config").get("model_type")
    texts = [[" ".join(WARMUP_WORDS[(i + k) % len(WARMUP_WORDS)] for k in range(words)) for i in range(count)]
             for count, words in WARMUP_BATCHES]
    if model_type in SEQ2SEQ_FAMILIES or model_type == "gpt2":
        from .generator import Generator
        from .translator import Translator
        kind = Translator if model_type in SEQ2SEQ_FAMILIES else Generator
        if dtype == "fp8":
            raise InputError("--dtype fp8 is for the encoders")
        model = kind.from_pretrained(folder, device="cuda", dtype=dtype)
        try:
            for batch in texts[:3]:
                for beams in (1, 4):
                    if kind is Translator:
                        languages = {"tgt_lang": min(model.text.codes)} if model.text.target_codes else {}
                        model.translate(batch, max_new_tokens=4, num_beams=beams, **languages)
                    else:
                        model.generate(batch, max_new_tokens=4, num_beams=beams)
        finally:
            model.close()
        return time.perf_counter() - start
    task = model_task(folder)
    from .classifier import Classifier
    from .token_classifier import TokenClassifier
    kind = {"embed": Encoder, "rerank": Reranker, "classify": Classifier, "ner": TokenClassifier}[task]
    with kind.from_pretrained(folder, device="cuda", dtype=dtype) as model:
        for batch in texts:
            if task == "embed":
                model.encode(batch)
            elif task == "rerank":
                model.predict([(WARMUP_WORDS[0], t) for t in batch])
            else:
                model.predict(batch)
    return time.perf_counter() - start


for command in (generate, translate, classify, ner):
    main.add_command(command)


if __name__ == "__main__":
    main()
