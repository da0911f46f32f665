"""Reading text lines and writing embeddings for the CLI: checked up front, written atomically."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from .errors import InputError

FORMATS = ("npy", "jsonl")


def decode_lines(data: bytes, *, source: str, errors: str = "strict") -> list[str]:
    """Split bytes into lines ('\\n', with a trailing '\\r' dropped); a final newline ends the
    last line rather than starting an empty one. Invalid UTF-8 is an error naming the line,
    or replaced by U+FFFD with errors='replace'."""
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()
    lines = []
    for number, line in enumerate(raw, start=1):
        if line.endswith(b"\r"):
            line = line[:-1]
        try:
            lines.append(line.decode("utf-8", errors=errors))
        except UnicodeDecodeError as e:
            raise InputError(
                f"{source}, line {number}: invalid UTF-8 at byte {e.start} "
                "(use --errors replace to substitute U+FFFD)"
            ) from None
    if lines and lines[0].startswith("\ufeff"):
        lines[0] = lines[0][1:]
    return lines


def read_lines(path: str, *, errors: str = "strict") -> list[str]:
    """Lines of a UTF-8 file, or of standard input for '-'."""
    if path == "-":
        return decode_lines(sys.stdin.buffer.read(), source="<stdin>", errors=errors)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputError(f"cannot read input {path}: {e.strerror}") from None
    return decode_lines(data, source=path, errors=errors)


def output_format(path: str, fmt: str | None) -> str:
    """The format to write: given, or from the file name (.npy / .jsonl); stdout is JSONL."""
    if fmt is None:
        fmt = "npy" if path != "-" and path.endswith(".npy") else "jsonl"
    if fmt not in FORMATS:
        raise InputError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if path == "-" and fmt == "npy":
        raise InputError("npy output is binary; give a file with -o, or use --format jsonl for stdout")
    return fmt


def check_writable(path: str):
    """Refuse an output path that cannot be written, before any work is done."""
    if path == "-":
        return
    p = Path(path)
    if p.is_dir():
        raise InputError(f"output {path} is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"output folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise InputError(f"output {path} is not writable")


def write_embeddings(path: str, fmt: str, embeddings: np.ndarray):
    """Write (N, dim) float32 embeddings. A file is written beside its target and renamed
    into place, so a failure never leaves a half-written or truncated output."""
    if path == "-":
        _write_jsonl(sys.stdout, embeddings)
        sys.stdout.flush()
        return
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "wb" if fmt == "npy" else "w", encoding=None if fmt == "npy" else "utf-8") as f:
            if fmt == "npy":
                np.save(f, embeddings.astype(np.float32, copy=False))
            else:
                _write_jsonl(f, embeddings)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def _write_jsonl(f, embeddings: np.ndarray):
    for i, row in enumerate(embeddings, start=1):
        f.write(json.dumps({"line": i, "embedding": row.tolist()}) + "\n")
