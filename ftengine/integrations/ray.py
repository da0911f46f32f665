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
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..encoder import Encoder
from ..errors import FtengineError, InputError
from ..records import open_records
from ..textio import EmbeddingWriter

PATH_COLUMN = "path"  # the source file of each row, where the dataset was read with include_paths=True


class FtengineEmbedder:
    """A Ray Data callable class: `ds.map_batches(FtengineEmbedder, fn_constructor_kwargs={...},
    batch_format="pyarrow" | "numpy" | "pandas", num_gpus=1, concurrency=N)`.

    model: a model folder every worker can read (None: the installed default model);
    text_column: the column embedded; embedding_column: the column added. device, dtype,
    max_length, batch_tokens, pooling, normalize, prompt_name, prompt, dimensions and
    truncate mean what they mean for Encoder.encode. Calls are safe from several threads
    (threaded actors: ActorPoolStrategy's max_concurrent_calls_per_actor); the encoder packs
    concurrent batches together."""

    def __init__(self, model: str | None = None, *, text_column: str = "text", embedding_column: str = "embedding",
                 device: str = "auto", dtype: str | None = None, max_length: int | None = None,
                 batch_tokens: int | None = None, pooling=None, normalize: bool | None = None,
                 prompt_name: str | None = None, prompt: str | None = None, dimensions: int | None = None,
                 truncate: bool = True, layout: str = "auto", cuda_graphs: bool = True):
        self.encoder = Encoder.from_pretrained(model, device=device, dtype=dtype, max_length=max_length,
                                               layout=layout, cuda_graphs=cuda_graphs)
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
    if os.path.isdir(input_path):
        base = input_path
        files = [str(p) for p in Path(input_path).rglob("*") if p.is_file() and not p.name.startswith((".", "_"))]
        files = [f for f in files if _shard_format(f) is not None and (fmt is None or _shard_format(f) == fmt)]
        if not files:
            wanted = fmt or "/".join(sorted(set(_SHARD_EXTENSIONS)))
            raise InputError(f"no {wanted} files in {input_path}")
    else:
        files = [f for f in glob.glob(input_path, recursive=True) if os.path.isfile(f)]
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
    base, out = os.path.abspath(base), os.path.abspath(output_dir)
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


def check_shards(shards: list[Shard], fmt: str, text_column: str, id_column: str | None):
    """Refuse, before any worker starts, a shard still to do whose columns (CSV, Parquet) or
    first record (JSONL) lack the text or id column."""
    for shard in shards:
        if not shard.done:
            records = open_records(shard.source, fmt, text_field=text_column, id_field=id_column)
            next(iter(records.texts), None)
            records.texts.close()


def _shard_format(path: str) -> str | None:
    return _SHARD_EXTENSIONS.get(os.path.splitext(path)[1].lower())


def _read(fmt: str, paths: list, text_column: str, id_column: str | None):
    """The shards as one Ray dataset of the text (and id) column with each row's source path."""
    import pyarrow as pa
    import ray.data
    columns = [text_column] + ([id_column] if id_column is not None and id_column != text_column else [])
    common = dict(include_paths=True, partitioning=None, file_extensions=None)
    if fmt == "parquet":
        return ray.data.read_parquet(paths, columns=columns, **common)
    if fmt == "jsonl":
        return ray.data.read_json(paths, **common).select_columns(columns + [PATH_COLUMN])
    from pyarrow import csv
    return ray.data.read_csv(
        paths, parse_options=csv.ParseOptions(delimiter="\t" if fmt == "tsv" else ",", newlines_in_values=True),
        convert_options=csv.ConvertOptions(include_columns=columns, column_types={c: pa.string() for c in columns},
                                           strings_can_be_null=False, quoted_strings_can_be_null=False),
        **common)


def encode_dataset(shards: list[Shard], fmt: str, *, text_column: str = "text", id_column: str | None = None,
                   workers: int = 1, gpus_per_worker: float = 1.0, cpus_per_worker: float = 1.0,
                   batch_rows: int = 16384, batches_per_worker: int = 1, embedder: dict | None = None,
                   progress=None) -> DatasetStats:
    """Embed the shards not yet done on the Ray cluster this process is connected to: read with
    Ray Data, embedded by `workers` FtengineEmbedder actors, each with `gpus_per_worker` GPUs
    (0: on the CPU) and `batches_per_worker` batches of `batch_rows` in flight, and written
    here, one Parquet file per shard: the key column (`id_column`,
    or `row`, the row's number in its shard from 1) and `embedding`. Each file is written
    beside its target and renamed into place when its last row is in, so an interrupted job
    leaves finished shards only, and a re-run does the rest. `progress(n)`: n more rows written."""
    import ray.data
    start = time.perf_counter()
    stats = DatasetStats(shards_skipped=sum(s.done for s in shards))
    pending = [s for s in shards if not s.done]
    if not pending:
        return stats
    kwargs = dict(embedder or {}, text_column=text_column, embedding_column="embedding")
    if gpus_per_worker == 0:
        kwargs.setdefault("device", "cpu")
    # a dataset keeps the context of its creation; each shard's rows must arrive together, in order
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.raise_original_map_exception = True  # the worker's InputError, not a generic wrapper
    ds = _read(fmt, [s.source for s in pending], text_column, id_column)
    # one batch a block, so that every worker has blocks to take (a read task may cover many files)
    ds = ds.repartition(target_num_rows_per_block=batch_rows)
    ds = ds.map_batches(FtengineEmbedder, fn_constructor_kwargs=kwargs, batch_format="pyarrow",
                        batch_size=batch_rows, num_gpus=gpus_per_worker, num_cpus=cpus_per_worker,
                        compute=ray.data.ActorPoolStrategy(size=workers,
                                                           max_concurrent_calls_per_actor=batches_per_worker))
    writers = _ShardWriters(pending, id_column)
    # a failed task is raised here, once; Ray Data's own log of it would repeat it as a traceback
    data_log = logging.getLogger("ray.data")
    level = data_log.level
    data_log.setLevel(logging.CRITICAL)
    try:
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            stats.rows += writers.write(batch)
            if progress is not None:
                progress(batch.num_rows)
        writers.finish(kwargs)
    except BaseException:
        writers.discard()
        raise
    finally:
        data_log.setLevel(level)
    stats.shards_written = len(pending)
    stats.seconds = time.perf_counter() - start
    return stats


class _ShardWriters:
    """Rows coming back in shard order -> one committed Parquet file per shard."""

    def __init__(self, pending: list[Shard], id_column: str | None):
        self.pending = pending
        self.by_source = {os.path.realpath(s.source): s for s in pending}
        self.id_column = id_column
        self.position = 0          # shards before this one in self.pending are committed
        self.current = None        # (shard, writer) of the shard being written
        self.dim = None
        self.key_type = None

    def write(self, batch) -> int:
        """Write a batch (rows of one or more shards, in order); its row count."""
        paths = batch.column(PATH_COLUMN).to_pylist()
        begin = 0
        for i in range(1, len(paths) + 1):
            if i == len(paths) or paths[i] != paths[begin]:
                self._write_run(batch.slice(begin, i - begin), self._shard_of(paths[begin]))
                begin = i
        return len(paths)

    def _write_run(self, part, shard: Shard):
        import pyarrow.compute as pc
        embeddings = part.column("embedding")
        self.dim = embeddings.type.list_size
        if self.id_column is not None:
            self.key_type = part.column(self.id_column).type
        values = pc.list_flatten(embeddings).to_numpy(zero_copy_only=False).reshape(-1, self.dim)
        # without an id column the writer numbers the shard's rows from 1
        keys = None if self.id_column is None else part.column(self.id_column).to_pylist()
        self._writer_for(shard).write(values, keys)

    def _shard_of(self, path: str) -> Shard:
        shard = self.by_source.get(os.path.realpath(path))
        if shard is None:
            raise InputError(f"Ray returned rows of {path}, which is not one of this job's inputs")
        return shard

    def _writer_for(self, shard: Shard):
        if self.current is not None and self.current[0] is shard:
            return self.current[1]
        index = self.pending.index(shard)
        if index < self.position:
            raise InputError(f"rows of {shard.source} came back after its file was finished")
        self._commit_current()
        self._write_empty(self.pending[self.position:index])  # shards with no rows: Ray returns nothing for them
        self.position = index
        self.current = (shard, self._open(shard))
        return self.current[1]

    def _open(self, shard: Shard):
        import pyarrow as pa
        os.makedirs(os.path.dirname(shard.target), exist_ok=True)
        writer = EmbeddingWriter(shard.target, "parquet", self.dim, key_name=self.id_column or "row",
                                 key_type=self.key_type or (pa.string() if self.id_column else None))
        return writer.__enter__()

    def _commit_current(self):
        if self.current is not None:
            self.current[1].__exit__(None, None, None)
            self.current = None
            self.position += 1

    def _write_empty(self, shards: list):
        for shard in shards:
            self._open(shard).__exit__(None, None, None)

    def finish(self, embedder: dict):
        self._commit_current()
        if self.position < len(self.pending):
            if self.dim is None:  # not one row in the whole job: the model says how wide rows are
                probe = FtengineEmbedder(**dict(embedder, device="cpu", dtype=None))
                self.dim = probe.dim
                probe.encoder.close()
            self._write_empty(self.pending[self.position:])
            self.position = len(self.pending)

    def discard(self):
        if self.current is not None:
            self.current[1].__exit__(RuntimeError, RuntimeError("discarded"), None)
            self.current = None


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
