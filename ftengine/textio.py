"""Reading text lines for the CLI, lazily, line by line: a file or stdin, each line decoded as
UTF-8 with --errors' rule (strict: an error naming the file and line; replace: U+FFFD)."""

from __future__ import annotations

import os
import re
import sys

import numpy as np

from .errors import InputError


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


BLOCK_BYTES = 1 << 20  # text files are read and decoded in blocks of about this much, whole lines each


def iter_block_lines(f, *, source: str, errors: str = "strict"):
    """As decode_lines over a binary file's lines, read in blocks: each block of whole lines is
    decoded and split in one call (no Python work per line but the yield); a block that does not
    decode goes line by line, for the error that names its line. `read1` returns what a pipe has,
    so a stream's lines come as they arrive."""
    number = 0
    for whole in _line_blocks(f, BLOCK_BYTES):
        yield from _decoded_block(whole, number, source, errors)
        number += whole.count(b"\n") + 1


def _line_blocks(f, size: int):
    """A binary file's bytes in blocks of whole lines (joined by their newlines, without the last
    one), each read with up to `size` bytes; a line longer than that is one block of its own."""
    read = getattr(f, "read1", f.read)
    rest = []   # the pieces of a line not yet ended
    while True:
        block = read(size)
        if not block:
            break
        cut = block.rfind(b"\n")
        if cut < 0:
            rest.append(block)
            continue
        yield b"".join([*rest, block[:cut]])
        rest = [block[cut + 1:]]
    if any(rest):
        yield b"".join(rest)


def _decoded_block(data: bytes, before: int, source: str, errors: str):
    """The lines of `data` (no final newline), the first numbered before + 1."""
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        lines = [_decode(line, before + i, source, errors) for i, line in enumerate(data.split(b"\n"), start=1)]
    else:
        if b"\r" in data:
            lines = [line[:-1] if line.endswith("\r") else line for line in lines]
        if before == 0 and lines[0].startswith("\ufeff"):
            lines[0] = lines[0][1:]
    yield from lines


def decode_lines(data: bytes, *, source: str, errors: str = "strict") -> list[str]:
    """All lines of `data`, decoded a line at a time ('\\n'-terminated, a trailing '\\r' dropped; a
    final newline ends the last line rather than starting an empty one). Invalid UTF-8 is an
    error naming the line, or replaced by U+FFFD with errors='replace'."""
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()
    return [_decode(line, number, source, errors) for number, line in enumerate(raw, start=1)]


def iter_lines(path: str, *, errors: str = "strict"):
    """Lines of a UTF-8 file, or of standard input for '-', read lazily. The file is opened
    (and an unreadable one refused) at the call, not at the first line."""
    if path == "-":
        return iter_block_lines(sys.stdin.buffer, source="<stdin>", errors=errors)
    return _lines_of(_open(path), path, errors)


def _open(path: str):
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot read input {path}: {e.strerror}") from None
    if os.path.isdir(path):
        f.close()
        raise InputError(f"cannot read input {path}: it is a directory")
    return f


def _lines_of(f, path: str, errors: str):
    with f:
        try:
            yield from iter_block_lines(f, source=path, errors=errors)
        except OSError as e:
            raise InputError(f"cannot read input {path}: {e.strerror}") from None


RAW_BLOCK_BYTES = 16 << 20  # a raw reader's blocks (whole lines each)


class RawTexts:
    """Lines of a text file as undecoded UTF-8: line first + i is data[starts[i]:stops[i]]
    (without its newline; a carriage return before it kept), for a tokenizer that takes bytes.
    decoded() gives them as iter_lines would (its --errors rule, the first line's BOM dropped)."""

    def __init__(self, data: bytes, starts: np.ndarray, stops: np.ndarray, *, first: int, source: str, errors: str):
        self.data, self.starts, self.stops = data, starts, stops   # (N,) int64 each
        self.first, self.source, self.errors = first, source, errors

    def __len__(self) -> int:
        return len(self.starts)

    def span(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the bytes the lines cover (uint8, no copy), their starts and stops within them)."""
        if not len(self):
            return np.zeros(0, np.uint8), self.starts, self.stops
        a, b = int(self.starts[0]), int(self.stops[-1])
        return np.frombuffer(memoryview(self.data)[a:b], np.uint8), self.starts - a, self.stops - a

    def decoded(self, rows=None) -> list[str]:
        """Lines `rows` (all by default) as str."""
        rows = range(len(self)) if rows is None else rows
        return [_decode(self.data[self.starts[i]:self.stops[i]], self.first + i, self.source, self.errors)
                for i in map(int, rows)]


class RawLines:
    """A text file's lines (or stdin's, for '-'), read in blocks: iterated, as str (iter_lines);
    through windows(), as RawTexts of up to `size` lines split with NumPy, with no Python object a
    line. Each line read puts its number on `keys`. The file is opened (and an unreadable one
    refused) at construction."""

    def __init__(self, path: str, *, errors: str = "strict", keys=None):
        self.path, self.errors, self.keys = path, errors, keys
        self.source = source_name(path)
        self._file = sys.stdin.buffer if path == "-" else _open(path)

    def __iter__(self):
        lines = iter_block_lines(self._file, source=self.source, errors=self.errors) if self.path == "-" else \
            _lines_of(self._file, self.path, self.errors)
        for number, text in enumerate(lines, start=1):
            if self.keys is not None:
                self.keys.append(number)
            yield text

    def windows(self, size: int):
        first = 1
        try:
            for whole in _line_blocks(self._file, RAW_BLOCK_BYTES):
                for window in _raw_windows(whole, size, first, self.source, self.errors):
                    first += len(window)
                    if self.keys is not None:
                        self.keys.extend(range(window.first, first))
                    yield window
        except OSError as e:
            raise InputError(f"cannot read input {self.source}: {e.strerror}") from None
        finally:
            if self.path != "-":
                self._file.close()


def _raw_windows(whole: bytes, size: int, first: int, source: str, errors: str):
    """The lines of `whole` (lines joined by newlines, no final one) as RawTexts of up to `size`."""
    nl = np.flatnonzero(np.frombuffer(whole, np.uint8) == 10)
    starts = np.concatenate([[0], nl + 1]).astype(np.int64)
    stops = np.concatenate([nl, [len(whole)]]).astype(np.int64)
    for a in range(0, len(starts), size):
        yield RawTexts(whole, starts[a:a + size], stops[a:a + size], first=first + a, source=source, errors=errors)


def source_name(path: str) -> str:
    """How errors name an input: its path, or <stdin> for '-'."""
    return "<stdin>" if path == "-" else path


REPLACE_HINT = " (use --errors replace to substitute U+FFFD)"


def unicode_text(text: str, where: str, errors: str, *, hint: str = REPLACE_HINT) -> str:
    """text, where it is valid Unicode; a lone surrogate (which JSON's \\udXXX escapes and
    invalid UTF-8 in command-line arguments produce) refused naming `where`, or with
    errors='replace' replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        if errors == "replace":
            return _SURROGATES.sub("\ufffd", text)
        raise InputError(f"{where} holds a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start + 1}: "
                         f"not valid Unicode{hint}") from None


_SURROGATES = re.compile("[\ud800-\udfff]")
