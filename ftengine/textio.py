"""Reading text lines and writing embeddings for the CLI, both streaming.

Input is read lazily, line by line. Output is written as it comes: to a temporary file beside
the target, renamed into place at the end, so an error, Ctrl-C or SIGTERM leaves neither a
partial output nor a temporary file; the result gets the permissions a normally created file
would. A target that is not a regular file (/dev/stdout, a pipe) is written directly.
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

FORMATS = ("npy", "jsonl")
NPY_HEADER_BYTES = 128  # room for any (rows, dim) shape; patched when the row count is known


def _decode(line: bytes, number: int, source: str, errors: str) -> str:
    if line.endswith(b"\n"):
        line = line[:-1]
    if line.endswith(b"\r"):
        line = line[:-1]
    try:
        text = line.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise InputError(
            f"{source}, line {number}: invalid UTF-8 at byte {e.start} "
            "(use --errors replace to substitute U+FFFD)"
        ) from None
    if number == 1 and text.startswith("\ufeff"):
        text = text[1:]
    return text


def iter_decoded(raw_lines, *, source: str, errors: str = "strict"):
    """Lines ('\\n'-terminated, a trailing '\\r' dropped) of a binary line iterator as str; a
    final newline ends the last line rather than starting an empty one. Invalid UTF-8 is an
    error naming the line, or replaced by U+FFFD with errors='replace'."""
    for number, line in enumerate(raw_lines, start=1):
        yield _decode(line, number, source, errors)


def decode_lines(data: bytes, *, source: str, errors: str = "strict") -> list[str]:
    """All lines of `data` (see iter_decoded)."""
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()
    return list(iter_decoded(raw, source=source, errors=errors))


def iter_lines(path: str, *, errors: str = "strict"):
    """Lines of a UTF-8 file, or of standard input for '-', read lazily. The file is opened
    (and an unreadable one refused) at the call, not at the first line."""
    if path == "-":
        return iter_decoded(sys.stdin.buffer, source="<stdin>", errors=errors)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot read input {path}: {e.strerror}") from None
    if os.path.isdir(path):
        f.close()
        raise InputError(f"cannot read input {path}: it is a directory")
    return _lines_of(f, path, errors)


def _lines_of(f, path: str, errors: str):
    with f:
        try:
            yield from iter_decoded(f, source=path, errors=errors)
        except OSError as e:
            raise InputError(f"cannot read input {path}: {e.strerror}") from None


def read_lines(path: str, *, errors: str = "strict") -> list[str]:
    """Every line of a file (or stdin for '-')."""
    return list(iter_lines(path, errors=errors))


def output_format(path: str, fmt: str | None) -> str:
    """The format to write: given, or from the file name (.npy / .jsonl); stdout is JSONL."""
    if fmt is None:
        fmt = "npy" if path != "-" and path.endswith(".npy") else "jsonl"
    if fmt not in FORMATS:
        raise InputError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if path == "-" and fmt == "npy":
        raise InputError("npy output is binary; give a file with -o, or use --format jsonl for stdout")
    return fmt


def _target(path: str) -> tuple[Path, bool]:
    """(where the data goes, whether it is a regular file to replace atomically). A symlink is
    written through (its target replaced), never replaced itself."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return Path(os.path.realpath(path)), True
    except OSError as e:
        raise OutputError(f"cannot write output {path}: {e.strerror}") from None
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
    it normally commits the output, leaving by any exception removes every trace of it."""

    def __init__(self, path: str, fmt: str, dim: int, dtype=np.float32):
        self.path, self.fmt, self.dim = path, fmt, dim
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.rows = 0
        self._tmp = None
        self._spool = None
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
            raise OutputError(f"cannot write output {path}: {e.strerror}") from None
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
            raise OutputError(f"cannot write output {self.path}: {e.strerror}") from None

    def write(self, embeddings: np.ndarray):
        """Append (n, dim) rows."""
        if self.fmt == "npy":
            self._write(np.ascontiguousarray(embeddings, dtype=self.dtype).tobytes())
        else:
            self._write("".join(
                json.dumps({"line": self.rows + i, "embedding": row}) + "\n"
                for i, row in enumerate(embeddings.tolist(), start=1)).encode("utf-8"))
            if self._target is None:
                self._flush()
        self.rows += len(embeddings)

    def _flush(self):
        try:
            self._file.flush()
        except OSError as e:
            raise OutputError(f"cannot write output {self.path}: {e.strerror}") from None

    def commit(self):
        """Finish the file: the npy header's row count, then the rename into place."""
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
                    raise OutputError(f"cannot write output {self.path}: {e.strerror}") from None
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
            raise OutputError(f"cannot write output {self.path}: {e.strerror}") from None

    def _discard(self):
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


def write_embeddings(path: str, fmt: str, embeddings: np.ndarray):
    """Write (N, dim) float32 embeddings in one go (atomically, as EmbeddingWriter)."""
    with EmbeddingWriter(path, fmt, embeddings.shape[1]) as writer:
        writer.write(embeddings)
