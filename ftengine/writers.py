"""Writing embeddings (.npy, .jsonl, .parquet) for the CLI and the dataset workers, streaming.

Output is written as it comes: to a temporary file beside the target, renamed into place at the
end, so an error, Ctrl-C or SIGTERM leaves neither a partial output nor a temporary file; the
result gets the permissions a normally created file would. A target that is not a regular file
(/dev/stdout, a pipe) is written directly.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from pathlib import Path

import numpy as np

from .errors import InputError, OutputError
from .records import require_pyarrow

FORMATS = ("npy", "jsonl", "parquet")
NPY_HEADER_BYTES = 128  # room for any (rows, dim) shape; patched when the row count is known
PARQUET_ROW_GROUP_BYTES = 32 << 20  # embeddings buffered before a Parquet row group is written


def output_format(path: str, fmt: str | None) -> str:
    """The format to write: given, or from the file name (.npy / .parquet / .jsonl); stdout is JSONL."""
    if fmt is None:
        suffix = os.path.splitext(path)[1].lower() if path != "-" else ""
        fmt = {".npy": "npy", ".parquet": "parquet"}.get(suffix, "jsonl")
    if fmt not in FORMATS:
        raise InputError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if path == "-" and fmt != "jsonl":
        raise InputError(f"{fmt} output is binary; give a file with -o, or use --format jsonl for stdout")
    if fmt == "parquet":
        require_pyarrow("parquet output")
    return fmt


def _target(path: str) -> tuple[Path, bool]:
    """(where the data goes, whether it is a regular file to replace atomically). A symlink is
    written through (its target replaced), never replaced itself."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return Path(os.path.realpath(path)), True
    except OSError as e:
        raise _output_error(path, e, e.strerror) from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"output {path} is a directory")
    if stat.S_ISREG(st.st_mode):
        return Path(os.path.realpath(path)), True
    return Path(path), False


def check_writable(path: str):
    """Refuse an output path that cannot be written, before any work is done."""
    if path == "-":
        return
    target, regular = _target(path)
    if not regular:
        if not os.access(target, os.W_OK):
            raise OutputError(f"output {path} is not writable")
        return
    parent = target.parent
    if not parent.is_dir():
        raise OutputError(f"output folder {Path(path).parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise OutputError(f"output {path} is not writable")


def _new_file_mode(existing: Path) -> int:
    """The mode open() would give: an existing file keeps its own, a new one 0o666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(existing).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


class EmbeddingWriter:
    """Rows of embeddings written as they come, in order. Use as a context manager: leaving
    it normally commits the output, leaving by any exception removes every trace of it.

    Each row has a key: its line number (from 1) unless `write` is given keys. JSONL rows
    carry it under `key_name`; Parquet files have a `key_name` column (type `key_type`, or
    taken from the first keys) and an `embedding` column of fixed-size lists; .npy holds the
    embeddings alone."""

    def __init__(self, path: str, fmt: str, dim: int, dtype=np.float32, *, key_name: str = "line",
                 key_type=None):
        self.path, self.fmt, self.dim = path, fmt, dim
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.key_name, self.key_type = key_name, key_type
        self.rows = 0
        self._tmp = None
        self._spool = None
        self._parquet = self._schema = None
        self._pending, self._pending_bytes = [], 0
        if path == "-":
            self._file, self._target = sys.stdout.buffer, None
            return
        self._target, regular = _target(path)
        try:
            if regular:
                fd, self._tmp = tempfile.mkstemp(prefix=f".{self._target.name}.", suffix=".tmp",
                                                 dir=self._target.parent)
                self._file = os.fdopen(fd, "wb")
            else:
                self._file = open(self._target, "wb")
                if fmt == "npy":  # a pipe cannot be patched: the rows wait in a spool file
                    self._spool = tempfile.TemporaryFile()
        except OSError as e:
            self._discard()
            raise _output_error(path, e, e.strerror) from None
        if fmt == "npy" and self._spool is None:
            self._write(self._header(0), spool=False)  # the row count is patched in commit()

    def _header(self, rows: int) -> bytes:
        text = repr({"descr": self.dtype.str, "fortran_order": False, "shape": (rows, self.dim)})
        pad = NPY_HEADER_BYTES - 10 - len(text) - 1
        return b"\x93NUMPY\x01\x00" + (NPY_HEADER_BYTES - 10).to_bytes(2, "little") + \
            text.encode("latin1") + b" " * pad + b"\n"

    def _write(self, data: bytes, *, spool: bool = True):
        f = self._spool if spool and self._spool is not None else self._file
        try:
            f.write(data)
        except OSError as e:
            raise _output_error(self.path, e, e.strerror) from None

    def write(self, embeddings: np.ndarray, keys=None):
        """Append (n, dim) rows; `keys`: their n keys (default: their line numbers)."""
        if keys is None:
            keys = range(self.rows + 1, self.rows + 1 + len(embeddings))
        if self.fmt == "npy":
            self._write(np.ascontiguousarray(embeddings, dtype=self.dtype).tobytes())
        elif self.fmt == "parquet":
            self._pending.append((list(keys), np.ascontiguousarray(embeddings, dtype=self.dtype)))
            self._pending_bytes += embeddings.nbytes
            if self._pending_bytes >= PARQUET_ROW_GROUP_BYTES:
                self._write_row_group()
        else:
            self._write("".join(
                json.dumps({self.key_name: key, "embedding": row}) + "\n"
                for key, row in zip(keys, embeddings.tolist())).encode("utf-8"))
            if self._target is None:
                self._flush()
        self.rows += len(embeddings)

    def _write_row_group(self):
        """The buffered rows as one Parquet row group (the file's writer made at the first)."""
        import pyarrow as pa
        import pyarrow.parquet as pq
        keys = [k for part, _ in self._pending for k in part]
        values = np.concatenate([e for _, e in self._pending]) if self._pending else \
            np.zeros((0, self.dim), self.dtype)
        self._pending, self._pending_bytes = [], 0
        if self._parquet is None:
            key_type = self.key_type
            if key_type is None:
                key_type = pa.string() if keys and isinstance(keys[0], str) else pa.int64()
            self._schema = schema = pa.schema([(self.key_name, key_type),
                                ("embedding", pa.list_(pa.from_numpy_dtype(self.dtype.newbyteorder("=")), self.dim))])
            try:
                self._parquet = pq.ParquetWriter(self._file, schema, use_dictionary=[self.key_name],
                                                 write_statistics=[self.key_name])
            except OSError as e:
                raise _output_error(self.path, e, e) from None
        schema = self._schema
        try:
            column = pa.array(keys, type=schema.field(0).type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
            raise InputError(f"the keys of {self.path} do not fit its {self.key_name!r} column "
                             f"({schema.field(0).type}): {e}") from None
        flat = pa.array(values.reshape(-1).astype(values.dtype.newbyteorder("="), copy=False))
        table = pa.Table.from_arrays([column, pa.FixedSizeListArray.from_arrays(flat, self.dim)], schema=schema)
        try:
            self._parquet.write_table(table, row_group_size=max(1, PARQUET_ROW_GROUP_BYTES // values[:1].nbytes)
                                      if len(values) else None)
        except OSError as e:
            raise _output_error(self.path, e, e) from None

    def _flush(self):
        try:
            self._file.flush()
        except OSError as e:
            raise _output_error(self.path, e, e.strerror) from None

    def commit(self):
        """Finish the file: the npy header's row count or the Parquet footer, then the rename into place."""
        if self.fmt == "parquet":
            if self._pending or self._parquet is None:
                self._write_row_group()
            try:
                self._parquet.close()
            except OSError as e:
                raise _output_error(self.path, e, e) from None
        if self.fmt == "npy":
            if self._spool is not None:
                self._write(self._header(self.rows), spool=False)
                self._spool.seek(0)
                while block := self._spool.read(1 << 20):
                    self._write(block, spool=False)
            else:
                try:
                    self._file.seek(0)
                except OSError as e:
                    raise _output_error(self.path, e, e.strerror) from None
                self._write(self._header(self.rows), spool=False)
        self._flush()
        if self._target is None:
            return
        try:
            if self._tmp is not None:
                os.fsync(self._file.fileno())
            self._file.close()
            if self._tmp is not None:
                os.chmod(self._tmp, _new_file_mode(self._target))
                os.replace(self._tmp, self._target)
                self._tmp = None
        except OSError as e:
            raise _output_error(self.path, e, e.strerror) from None

    def _discard(self):
        if self._parquet is not None and self._parquet.is_open:  # its footer goes to the file removed below
            try:
                self._parquet.close()
            except OSError:
                pass
        for f in (getattr(self, "_file", None), self._spool):
            if f is not None and f is not sys.stdout.buffer:
                try:
                    f.close()
                except OSError:
                    pass
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except OSError:
                pass
            self._tmp = None

    def __enter__(self) -> "EmbeddingWriter":
        return self

    def __exit__(self, kind, value, tb):
        try:
            if kind is None:
                self.commit()
        finally:
            self._discard()
        return False


class LineWriter(EmbeddingWriter):
    """Lines of text (a translation, or a JSON object, a line) written as they come, committed or
    removed as EmbeddingWriter's are: to a temporary file renamed into place at the end, or to
    stdout ('-') and other targets that are not regular files directly, flushed each time."""

    def __init__(self, path: str):
        super().__init__(path, "text", 0)

    def write_lines(self, lines: list):
        self._write("".join(line + "\n" for line in lines).encode("utf-8"))
        if self._target is None:
            self._flush()
        self.rows += len(lines)


class RecordWriter(EmbeddingWriter):
    """Records (dicts of one shape: a key, then values) written as they come, as JSON lines or
    Parquet rows (the schema from the first batch), committed or removed as EmbeddingWriter's are."""

    def __init__(self, path: str, fmt: str):
        if fmt == "parquet":
            if path == "-":
                raise InputError("parquet output is binary; give a file with -o, or write JSONL to stdout")
            require_pyarrow("parquet output")
        super().__init__(path, "records", 0)
        self.kind = fmt
        self._records = self._record_schema = None

    def write_records(self, rows: list):
        if self.kind != "parquet":
            self._write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
            if self._target is None:
                self._flush()
        elif rows:
            import pyarrow as pa
            import pyarrow.parquet as pq
            table = pa.Table.from_pylist(rows, schema=self._record_schema)
            try:
                if self._records is None:
                    self._record_schema = table.schema
                    self._records = pq.ParquetWriter(self._file, table.schema)
                self._records.write_table(table)
            except OSError as e:
                raise _output_error(self.path, e, e) from None
        self.rows += len(rows)

    def commit(self):
        if self.kind == "parquet":
            try:
                if self._records is None:  # no record: an empty file with no columns
                    import pyarrow as pa
                    import pyarrow.parquet as pq
                    pq.write_table(pa.table({}), self._file)
                else:
                    self._records.close()
            except OSError as e:
                raise _output_error(self.path, e, e) from None
        super().commit()

    def _discard(self):
        if self._records is not None and self._records.is_open:
            try:
                self._records.close()
            except OSError:
                pass
        super()._discard()


def write_embeddings(path: str, fmt: str, embeddings: np.ndarray):
    """Write (N, dim) float32 embeddings in one go (atomically, as EmbeddingWriter)."""
    with EmbeddingWriter(path, fmt, embeddings.shape[1]) as writer:
        writer.write(embeddings)


def _output_error(path: str, error: OSError, detail) -> Exception:
    """The error to raise for a failed write: a broken pipe as itself (the reader went away: the
    command stops quietly, as Unix filters do), anything else as an OutputError naming the output."""
    if isinstance(error, BrokenPipeError):
        return error
    return OutputError(f"cannot write output {path}: {detail}")
