"""Ray Data: embed a dataset's text column on every GPU (or CPU) of a Ray cluster.

    import ray
    from ftengine.integrations.ray import FtengineEmbedder

    ds = ray.data.read_parquet("s3://bucket/corpus/")
    ds = ds.map_batches(FtengineEmbedder, fn_constructor_kwargs={"text_column": "text"},
                        batch_format="pyarrow", batch_size=16384, num_gpus=1,
                        compute=ray.data.ActorPoolStrategy(size=4))
    ds.write_parquet("s3://bucket/embeddings/")

Each actor loads the model once, on the GPU Ray gives it (or on the CPU with num_gpus=0), and
appends an embedding column to every batch: a fixed-size list of float32 for pyarrow batches,
a 2-D array for numpy batches, a column of arrays for pandas ones. Ray restarts an actor that
dies and runs its batches again, so a lost worker costs time, not rows. Needs the `ray` extra.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..encoder import Encoder, EncodeStats
from ..errors import FtengineError, InputError
from ..records import embed_records, open_records
from ..writers import EmbeddingWriter

PATH_COLUMN = "path"  # the source file of each row, where the dataset was read with include_paths=True


class FtengineEmbedder:
    """A Ray Data callable class: `ds.map_batches(FtengineEmbedder, fn_constructor_kwargs={...},
    batch_format="pyarrow" | "numpy" | "pandas", num_gpus=1, concurrency=N)`.

    model: a model folder every worker can read (None: the installed default model);
    text_column: the column embedded; embedding_column: the column added. device, dtype,
    max_length, batch_tokens, pooling, normalize, prompt_name, prompt, dimensions and
    truncate mean what they mean for Encoder.encode; layout, cuda_graphs and tokenizer what they
    mean for Encoder.from_pretrained. Calls are safe from several threads
    (threaded actors: ActorPoolStrategy's max_concurrent_calls_per_actor); the encoder packs
    concurrent batches together."""

    def __init__(self, model: str | None = None, *, text_column: str = "text", embedding_column: str = "embedding",
                 device: str = "auto", dtype: str | None = None, max_length: int | None = None,
                 batch_tokens: int | None = None, pooling=None, normalize: bool | None = None,
                 prompt_name: str | None = None, prompt: str | None = None, dimensions: int | None = None,
                 truncate: bool = True, layout: str = "auto", cuda_graphs: bool = True, tokenizer: str = "auto"):
        self.encoder = Encoder.from_pretrained(model, device=device, dtype=dtype, max_length=max_length,
                                               layout=layout, cuda_graphs=cuda_graphs, tokenizer=tokenizer)
        self.text_column, self.embedding_column = text_column, embedding_column
        self.options = dict(batch_tokens=batch_tokens, pooling=pooling, normalize=normalize, prompt_name=prompt_name,
                            prompt=prompt, dimensions=dimensions)
        self.encoder.check_options(batch_tokens=batch_tokens, pooling=pooling)
        self.dim = self.encoder.output_dim(pooling, dimensions=dimensions)
        self.truncate = truncate

    def __call__(self, batch):
        if isinstance(batch, dict):
            return self._numpy(batch)
        if hasattr(batch, "schema") and hasattr(batch, "append_column"):
            return self._arrow(batch)
        if hasattr(batch, "columns") and hasattr(batch, "assign"):
            return self._pandas(batch)
        raise InputError(f"FtengineEmbedder takes pyarrow, numpy or pandas batches, not {type(batch).__name__}")

    def _embed(self, texts: list, where) -> np.ndarray:
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                found = "null" if text is None else type(text).__name__
                raise InputError(f"{where(i)}: column {self.text_column!r} holds {found}, not a string")
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        return self.encoder.encode_with_stats(texts, truncate=self.truncate, **self.options)[0]

    def _where(self, paths):
        """i -> where the batch's row i came from, as precisely as the batch says."""
        if paths is None:
            return lambda i: f"batch row {i + 1}"
        return lambda i: f"{paths[i]} (batch row {i + 1})"

    def _missing(self, columns) -> InputError:
        return InputError(f"no text column {self.text_column!r} in the dataset (columns: "
                          f"{', '.join(map(repr, columns)) or 'none'})")

    def _arrow(self, table):
        import pyarrow as pa
        if self.text_column not in table.column_names:
            raise self._missing(table.column_names)
        paths = table.column(PATH_COLUMN).to_pylist() if PATH_COLUMN in table.column_names else None
        embeddings = self._embed(table.column(self.text_column).to_pylist(), self._where(paths))
        flat = pa.array(embeddings.reshape(-1))
        column = pa.FixedSizeListArray.from_arrays(flat, embeddings.shape[1])
        if self.embedding_column in table.column_names:
            table = table.drop_columns([self.embedding_column])
        return table.append_column(self.embedding_column, column)

    def _numpy(self, batch: dict):
        if self.text_column not in batch:
            raise self._missing(list(batch))
        paths = batch.get(PATH_COLUMN)
        texts = [t.item() if isinstance(t, np.generic) else t for t in batch[self.text_column].tolist()]
        out = dict(batch)
        out[self.embedding_column] = self._embed(texts, self._where(None if paths is None else list(paths)))
        return out

    def _pandas(self, frame):
        if self.text_column not in frame.columns:
            raise self._missing(list(frame.columns))
        paths = list(frame[PATH_COLUMN]) if PATH_COLUMN in frame.columns else None
        texts = [None if isinstance(t, float) and t != t else t for t in frame[self.text_column].tolist()]  # NaN: null
        embeddings = self._embed(texts, self._where(paths))
        return frame.assign(**{self.embedding_column: list(embeddings)})


# ---------------------------------------------------------------- `ftengine encode-dataset`

DATASET_FORMATS = ("parquet", "jsonl", "csv", "tsv")
_SHARD_EXTENSIONS = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
                     ".tsv": "tsv"}


@dataclass
class Shard:
    source: str   # the input file, absolute
    target: str   # its output Parquet file
    done: bool    # the output exists already: a re-run skips the shard


@dataclass
class DatasetStats:
    rows: int = 0
    shards_written: int = 0
    shards_skipped: int = 0
    seconds: float = 0.0


def plan_shards(input_path: str, output_dir: str, fmt: str | None) -> tuple[str, list[Shard]]:
    """(format, shards): the input files of a folder (searched recursively), a glob or one file,
    in sorted order, each with the Parquet file it becomes under `output_dir` (same relative
    path, extension .parquet)."""
    if fmt is not None and fmt not in DATASET_FORMATS:
        raise InputError(f"input format {fmt!r} is not one of {', '.join(DATASET_FORMATS)}")
    out = os.path.abspath(output_dir)
    # an output folder inside the input folder holds the outputs of an earlier run, not inputs (the
    # input folder itself as the output is refused below, file by file)
    skip = out if os.path.abspath(input_path) != out else None
    if os.path.isdir(input_path):
        base = input_path
        files = [str(p) for p in Path(input_path).rglob("*") if p.is_file() and not p.name.startswith((".", "_"))
                 and not _inside(str(p), skip)]
        files = [f for f in files if _shard_format(f) is not None and (fmt is None or _shard_format(f) == fmt)]
        if not files:
            wanted = fmt or "/".join(sorted(set(_SHARD_EXTENSIONS)))
            raise InputError(f"no {wanted} files in {input_path}")
    else:
        files = [f for f in glob.glob(input_path, recursive=True) if os.path.isfile(f) and not _inside(f, skip)]
        if not files:
            raise InputError(f"no input files match {input_path}")
        base = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    files = sorted(os.path.abspath(f) for f in files)
    formats = {fmt or _shard_format(f) for f in files}
    if None in formats:
        unknown = next(f for f in files if _shard_format(f) is None)
        raise InputError(f"cannot tell the format of {unknown} from its name: give --input-format")
    if len(formats) > 1:
        raise InputError(f"the input mixes formats ({', '.join(sorted(formats))}): give one with --input-format")
    base = os.path.abspath(base)
    shards, targets = [], {}
    for f in files:
        target = os.path.join(out, os.path.splitext(os.path.relpath(f, base))[0] + ".parquet")
        if target in targets:
            raise InputError(f"{targets[target]} and {f} would both be written to {target}")
        if target == f:
            raise InputError(f"the output of {f} would overwrite it: choose another output folder")
        targets[target] = f
        shards.append(Shard(f, target, os.path.exists(target)))
    return formats.pop(), shards


def check_shards(shards: list[Shard], fmt: str, text_column: str, id_column: str | None, *, errors: str = "strict"):
    """Refuse, before any worker starts, a shard still to do whose columns (CSV, Parquet) or
    first record (JSONL) lack the text or id column."""
    for shard in shards:
        if not shard.done:
            records = open_records(shard.source, fmt, text_field=text_column, id_field=id_column, errors=errors)
            next(iter(records.texts), None)
            records.texts.close()


def _inside(path: str, folder: str | None) -> bool:
    """Whether `path` lies inside the absolute `folder` (None: no folder)."""
    return folder is not None and os.path.commonpath([os.path.abspath(path), folder]) == folder


def _shard_format(path: str) -> str | None:
    return _SHARD_EXTENSIONS.get(os.path.splitext(path)[1].lower())


class ShardEncoder:
    """The worker of `encode-dataset`, run as a Ray actor: it loads the model once, then embeds
    whole input files, each read and written as `ftengine encode FILE -o OUT.parquet` does (the
    records streamed through the encoder, the output written beside its target and renamed into
    place when complete), so a worker's tokeniser and device stay busy for a whole file and
    its rows never cross the object store."""

    def __init__(self, fmt: str, text_column: str, id_column: str | None, embedder: dict, errors: str = "strict"):
        self.fmt, self.text_column, self.id_column, self.errors = fmt, text_column, id_column, errors
        self.error = None
        try:
            self.embedder = FtengineEmbedder(**embedder, text_column=text_column)
        except FtengineError as e:  # raised by each call: an actor whose constructor fails dies without its message
            self.error = e

    def ready(self) -> bool:
        """Answered once the worker runs: the driver hands files only to workers that do."""
        return True

    def encode_shard(self, source: str, target: str) -> tuple[int, int]:
        """Embed `source` into the Parquet file `target`; (rows, tokens)."""
        if self.error is not None:
            raise self.error
        e = self.embedder
        records = open_records(source, self.fmt, text_field=self.text_column, id_field=self.id_column,
                               errors=self.errors)
        stats = EncodeStats()
        with EmbeddingWriter(target, "parquet", e.dim, key_name=records.key_name, key_type=records.key_type) as writer:
            embed_records(e.encoder, records, writer, truncate=e.truncate, stats=stats, **e.options)
        return stats.lines, stats.tokens


STOP_WAIT_SECONDS = 30  # after a failure or an interruption, how long the driver waits for killed workers to go
WAIT_SLICE_SECONDS = 0.5  # the driver waits on Ray in slices this long, so that Ctrl-C and SIGTERM act at once
START_WAIT_SECONDS = 600  # how long the job waits for a first worker to start (a model to load) before giving up


def placeable_workers(nodes: list, cpus_per_worker: float, gpus_per_worker: float) -> int:
    """How many workers of these CPUs and GPUs the live nodes (ray.nodes()) hold at once."""
    total = 0
    for node in nodes:
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        fits = [resources.get(name, 0) / need for name, need in (("CPU", cpus_per_worker), ("GPU", gpus_per_worker))
                if need > 0]
        total += int(min(fits) + 1e-9) if fits else 1 << 30
    return total


def check_resources(workers: int, cpus_per_worker: float, gpus_per_worker: float):
    """Refuse, before any worker starts, workers the Ray cluster cannot run at once: each would wait
    for resources that never come."""
    import ray
    fit = placeable_workers(ray.nodes(), cpus_per_worker, gpus_per_worker)
    if workers > fit:
        have = ray.cluster_resources()
        need = f"{cpus_per_worker:g} CPUs" + (f" and {gpus_per_worker:g} GPUs" if gpus_per_worker else "")
        raise InputError(f"{workers} workers of {need} each do not fit in the Ray cluster ({have.get('CPU', 0):g} CPUs, "
                         f"{have.get('GPU', 0):g} GPUs; room for {fit} such workers at once): see --workers, "
                         "--cpus-per-worker, --gpus-per-worker")


def default_cpus_per_worker(gpus_per_worker: float) -> float:
    """A GPU worker's share of its machine's CPUs (the smallest share any machine with GPUs
    gives), at least 1; 1 for CPU workers. Needs ray.init()."""
    import ray
    if not gpus_per_worker:
        return 1.0
    shares = [node["Resources"].get("CPU", 0) * gpus_per_worker / node["Resources"]["GPU"]
              for node in ray.nodes() if node["Alive"] and node["Resources"].get("GPU")]
    return float(max(1, int(min(shares)))) if shares else 1.0


def encode_dataset(shards: list[Shard], fmt: str, *, text_column: str = "text", id_column: str | None = None,
                   errors: str = "strict", workers: int = 1, gpus_per_worker: float = 1.0, cpus_per_worker: float = 1.0,
                   embedder: dict | None = None, progress=None) -> DatasetStats:
    """Embed the shards not yet done on the Ray cluster this process is connected to: `workers`
    ShardEncoder actors, each with `gpus_per_worker` GPUs (0: on the CPU) and `cpus_per_worker`
    CPUs (its tokeniser's threads), take the files one at a time and write one Parquet file per
    shard: the key column (`id_column`, or the line / row number as `ftengine encode` numbers
    them) and `embedding`. Ray restarts a worker that dies and gives it its file again; a file
    is renamed into place only when complete, so an interrupted job leaves finished shards
    only, and a re-run does the rest. `progress(n)`: a shard of n rows written."""
    import ray
    start = time.perf_counter()
    stats = DatasetStats(shards_skipped=sum(s.done for s in shards))
    pending = [s for s in shards if not s.done]
    if not pending:
        return stats
    _remove_partial_files(pending)  # of workers killed in an earlier job
    for shard in pending:
        os.makedirs(os.path.dirname(shard.target), exist_ok=True)
    kwargs = dict(embedder or {})
    if gpus_per_worker == 0:
        kwargs.setdefault("device", "cpu")
    threads = str(max(1, int(cpus_per_worker)))
    worker = ray.remote(ShardEncoder).options(
        num_gpus=gpus_per_worker, num_cpus=cpus_per_worker, max_restarts=-1, max_task_retries=-1,
        runtime_env={"env_vars": {"RAYON_NUM_THREADS": threads}})
    actors = [worker.remote(fmt, text_column, id_column, kwargs, errors) for _ in range(min(workers, len(pending)))]
    starting = {actor.ready.remote(): actor for actor in actors}
    idle, todo, running = [], list(reversed(pending)), {}
    waited = 0.0
    try:
        while todo or running:
            while idle and todo:
                shard, actor = todo.pop(), idle.pop()
                running[actor.encode_shard.remote(shard.source, shard.target)] = actor
            done, _ = ray.wait([*running, *(starting if todo else ())], num_returns=1, timeout=WAIT_SLICE_SECONDS)
            if not done:
                waited = 0.0 if running else waited + WAIT_SLICE_SECONDS
                if waited > START_WAIT_SECONDS:
                    raise InputError(f"no worker started in {START_WAIT_SECONDS} s: the Ray cluster has "
                                     f"{ray.available_resources()} free (see --workers, --cpus-per-worker, "
                                     "--gpus-per-worker)")
                continue
            ref = done[0]
            if ref in starting:
                ray.get(ref)
                idle.append(starting.pop(ref))
                continue
            idle.append(running.pop(ref))
            rows, _tokens = ray.get(ref)
            stats.rows += rows
            stats.shards_written += 1
            if progress is not None:
                progress(rows)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if running:  # a failure or an interruption: let the killed workers go before their files are removed
            ray.wait(list(running), num_returns=len(running), timeout=STOP_WAIT_SECONDS)
        _remove_partial_files(pending)
    stats.seconds = time.perf_counter() - start
    return stats


def _remove_partial_files(shards: list[Shard]):
    """The temporary files that killed workers left beside the shards' targets."""
    for shard in shards:
        folder, name = os.path.split(shard.target)
        for path in glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(name)}.*.tmp")):
            try:
                os.unlink(path)
            except OSError:
                pass


def ftengine_error_in(error: BaseException):
    """The FtengineError behind an exception Ray raises for a failed task or actor, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        cause = getattr(error, "cause", None)  # a RayTaskError's original exception (its own text is a traceback)
        if isinstance(error, FtengineError) and not isinstance(cause, BaseException):
            return error
        error = cause if isinstance(cause, BaseException) else error.__cause__ or error.__context__
    return None
