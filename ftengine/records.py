"""Texts with their keys from .txt, .jsonl, .csv/.tsv and .parquet inputs, read as a stream.

Each record is (key, text). The key is the value of the id field/column when one is named,
otherwise the record's place in the file: `line` (1-based line number) for .txt and .jsonl (.json
files are read as JSON Lines, one object a line, as encode-dataset reads them), `row` (1-based data
row) for .csv, .tsv and .parquet. Errors name the file and the line or row (Parquet: the row group
too, for a damaged one); text that is not valid Unicode follows --errors (strict: an error naming
where; replace: U+FFFD in its place).
CSV, TSV and Parquet are read with pyarrow (the `data` extra), in blocks, so memory does not
grow with the file; JSONL is read line by line with the standard json module.
"""

from __future__ import annotations

import json
import os
import sys
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from .errors import InputError
from .textio import REPLACE_HINT, RawLines, iter_lines, source_name, unicode_text

INPUT_FORMATS = ("txt", "jsonl", "csv", "tsv", "parquet")
_EXTENSIONS = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
               ".tsv": "tsv", ".parquet": "parquet"}
CSV_BLOCK_BYTES = 1 << 20
# pyarrow's CSV reader needs a row within one block: a file with longer rows is read again with
# blocks this many times larger, up to CSV_MAX_BLOCK_BYTES
CSV_BLOCK_GROWTH, CSV_MAX_BLOCK_BYTES = 8, 1 << 30
PARQUET_BATCH_ROWS = 8192


def input_format(path: str, fmt: str | None) -> str:
    """The input's format: given, or from the file name; stdin and unknown extensions are text lines."""
    if fmt is not None:
        if fmt not in INPUT_FORMATS:
            raise InputError(f"input format {fmt!r} is not one of {', '.join(INPUT_FORMATS)}")
        return fmt
    return _EXTENSIONS.get(os.path.splitext(path)[1].lower(), "txt") if path != "-" else "txt"


def require_pyarrow(what: str):
    """The pyarrow module, or an error saying which extra brings it."""
    try:
        import pyarrow
    except ImportError:
        raise InputError(f"{what} needs pyarrow: pip install 'ftengine[data]'") from None
    return pyarrow


@dataclass
class Records:
    """One input's texts, with their keys queued as the texts are read: whoever takes n
    embeddings back takes the next n keys from `keys`. `key_name` names the key column;
    `key_type` is its pyarrow type where known before the first record (Parquet), else None."""
    texts: object
    key_name: str
    key_type: object = None
    keys: deque = field(default_factory=deque)

    def take_keys(self, n: int) -> list:
        return [self.keys.popleft() for _ in range(n)]

    def windows(self, size: int):
        """(keys, texts) of the next `size` records at a time (fewer at the end), as they are read."""
        texts = iter(self.texts)
        while window := list(islice(texts, size)):
            yield self.take_keys(len(window)), window


def embed_records(encoder, records: Records, writer, **options):
    """Every record's embedding through `writer` (an EmbeddingWriter), with its key, as the
    encoder's stream yields them; `options` go to encoder.encode_stream."""
    for chunk in encoder.encode_stream(records.texts, **options):
        writer.write(chunk, records.take_keys(len(chunk)))


def open_records(path: str, fmt: str, *, text_field: str = "text", id_field: str | None = None,
                 errors: str = "strict") -> Records:
    """The records of `path` ('-': stdin, not for Parquet) in format `fmt`. The file is opened,
    and for CSV/Parquet its columns checked, now; the texts are read as they are iterated."""
    if fmt == "txt":  # read in blocks: the encoder may take them undecoded (RawLines.windows)
        records = Records(None, "line")
        records.texts = RawLines(path, errors=errors, keys=records.keys)
        return records
    if fmt == "jsonl":
        lines = iter_lines(path, errors=errors)
        records = Records(None, id_field or "line")
        records.texts = _jsonl(lines, source_name(path), text_field, id_field, records.keys, errors)
        return records
    if fmt in ("csv", "tsv"):
        return _csv(path, fmt, text_field, id_field, errors)
    if fmt == "parquet":
        return _parquet(path, text_field, id_field, errors)
    raise InputError(f"input format {fmt!r} is not one of {', '.join(INPUT_FORMATS)}")


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def _jsonl(lines, source: str, text_field: str, id_field: str | None, keys: deque, errors: str):
    id_kind = None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue  # blank lines (a trailing one, say) hold no record
        where = f"{source}, line {number}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise InputError(f"{where}: not valid JSON ({e}){_json_lines_note(source)}") from None
        if not isinstance(record, dict):
            raise InputError(f"{where}: expected a JSON object, found {_JSON_TYPES[type(record)]}"
                             f"{_json_lines_note(source)}")
        text = _field(record, text_field, where)
        if not isinstance(text, str):
            raise InputError(f"{where}: field {text_field!r} is {_JSON_TYPES[type(text)]}, not a string")
        text = unicode_text(text, f"{where}: field {text_field!r}", errors)
        if id_field is None:
            keys.append(number)
        else:
            key = _field(record, id_field, where)
            kind = str if isinstance(key, str) else int if isinstance(key, int) and not isinstance(key, bool) else None
            if kind is None:
                raise InputError(f"{where}: id field {id_field!r} is {_JSON_TYPES[type(key)]}; ids must be strings "
                                 "or integers")
            if kind is int and not -(1 << 63) <= key < (1 << 63):
                raise InputError(f"{where}: id {key} does not fit in a 64-bit integer")
            if id_kind is not None and kind is not id_kind:
                raise InputError(f"{where}: id field {id_field!r} is {_JSON_TYPES[kind]}, earlier ids are "
                                 f"{'strings' if id_kind is str else 'integers'}")
            id_kind = kind
            keys.append(unicode_text(key, f"{where}: id field {id_field!r}", "strict", hint="") if kind is str else key)
        yield text


def _json_lines_note(source: str) -> str:
    return " (a .json file is read as JSON Lines: one object a line)" if source.lower().endswith(".json") else ""


def _field(record: dict, name: str, where: str):
    if name not in record:
        known = ", ".join(map(repr, list(record)[:10])) or "none"
        raise InputError(f"{where}: no field {name!r} (fields: {known})")
    return record[name]


def _columns_error(path: str, kind: str, name: str, columns) -> InputError:
    return InputError(f"{path}: no {kind} column {name!r} (columns: {', '.join(map(repr, columns)) or 'none'})")


def _csv(path: str, fmt: str, text_field: str, id_field: str | None, errors: str) -> Records:
    pa = require_pyarrow(f"{fmt} input")
    from pyarrow import csv
    if path != "-" and os.path.isdir(path):
        raise InputError(f"cannot read input {path}: it is a directory")
    wanted = [text_field] + ([id_field] if id_field is not None and id_field != text_field else [])
    # every value as bytes: texts are decoded here (naming the row), ids kept as written
    convert = csv.ConvertOptions(include_columns=wanted, column_types={c: pa.binary() for c in wanted},
                                 strings_can_be_null=False, quoted_strings_can_be_null=False)
    parse = csv.ParseOptions(delimiter="\t" if fmt == "tsv" else ",", newlines_in_values=True)
    if path != "-":
        _check_unique_columns(path, parse.delimiter, wanted)

    def open_reader(block: int):
        """(source, reader) with blocks of `block` bytes; a row longer than a block is reopened
        with larger ones where the input can be read again (a file, not stdin)."""
        while True:
            if path == "-":
                source = sys.stdin.buffer
            else:
                try:
                    source = open(path, "rb")
                except OSError as e:
                    raise InputError(f"cannot read input {path}: {e.strerror}") from None
            try:
                return source, block, csv.open_csv(source, read_options=csv.ReadOptions(block_size=block),
                                                   parse_options=parse, convert_options=convert)
            except (pa.ArrowInvalid, pa.ArrowKeyError, KeyError) as e:
                if source is not sys.stdin.buffer:
                    source.close()
                if not _longer_than_block(e, path, block):
                    raise _csv_open_error(path, e, wanted, parse) from None
                block *= CSV_BLOCK_GROWTH

    opened = open_reader(CSV_BLOCK_BYTES)
    records = Records(None, id_field or "row", None if id_field is None else pa.string())
    records.texts = _csv_texts(opened, open_reader, path, text_field, id_field, errors, records.keys)
    return records


def _longer_than_block(error, path: str, block: int) -> bool:
    """Whether pyarrow refused a row longer than its block and the file can be read again with larger ones."""
    return "straddl" in str(error) and path != "-" and block * CSV_BLOCK_GROWTH <= CSV_MAX_BLOCK_BYTES


def _check_unique_columns(path: str, delimiter: str, wanted: list):
    """Refuse a file whose header names a wanted column twice (pyarrow would read the first silently)."""
    import csv as header_csv
    import io
    try:
        with open(path, "rb") as f:
            header = next(header_csv.reader(io.TextIOWrapper(f, encoding="utf-8-sig", errors="replace", newline=""),
                                            delimiter=delimiter), [])
    except (OSError, header_csv.Error):
        return  # pyarrow's open reports an unreadable file
    for name in wanted:
        if header.count(name) > 1:
            raise InputError(f"{path}: {header.count(name)} columns are named {name!r}; rename all but the one to "
                             "read")


def _csv_open_error(path: str, error, wanted: list, parse) -> InputError:
    """A clear message for a CSV that pyarrow cannot open with these columns."""
    header = None
    if path != "-":
        from pyarrow import csv
        try:
            with csv.open_csv(path, parse_options=parse) as probe:
                header = probe.schema.names
        except Exception:  # the file itself is unreadable: pyarrow's own message says why
            header = None
    if header is not None:
        for name in wanted:
            if name not in header:
                kind = "text" if name == wanted[0] else "id"
                return _columns_error(path, kind, name, header)
    if "straddl" in str(error):
        return InputError(f"cannot read {source_name(path)} as CSV: {_long_row(path)}")
    return InputError(f"cannot read {source_name(path)} as CSV: {error}")


def _long_row(path: str) -> str:
    if path == "-":
        return ("a row is longer than pyarrow's read block; give the file by name (a file is read again with larger "
                "blocks), or convert it to JSONL")
    return f"a row is longer than {CSV_MAX_BLOCK_BYTES >> 20} MiB"


def _csv_texts(opened, open_reader, path: str, text_field: str, id_field: str | None, errors: str, keys: deque):
    import pyarrow as pa
    where = source_name(path)
    source, block, reader = opened
    row = skip = 0  # skip: rows already read before a reopen with larger blocks
    try:
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except pa.ArrowInvalid as e:
                if not _longer_than_block(e, path, block):
                    detail = _long_row(path) if "straddl" in str(e) else e
                    raise InputError(f"cannot read {where} as CSV after row {row}: {detail}") from None
                reader.close()
                source.close()
                source, block, reader = open_reader(block * CSV_BLOCK_GROWTH)
                skip = row
                continue
            if skip:
                drop = min(skip, batch.num_rows)
                batch, skip = batch.slice(drop), skip - drop
            texts = batch.column(text_field).to_pylist()
            ids = batch.column(id_field).to_pylist() if id_field is not None else None
            for i, raw in enumerate(texts):
                row += 1
                try:
                    text = raw.decode("utf-8", errors=errors)
                except UnicodeDecodeError as e:
                    raise InputError(f"{where}, row {row}: invalid UTF-8 in column {text_field!r} at byte {e.start} "
                                     "(use --errors replace to substitute U+FFFD)") from None
                if ids is None:
                    keys.append(row)
                else:
                    try:
                        keys.append(ids[i].decode("utf-8"))
                    except UnicodeDecodeError:
                        raise InputError(f"{where}, row {row}: invalid UTF-8 in id column {id_field!r}") from None
                yield text
    finally:
        if source is not sys.stdin.buffer:
            source.close()


def _parquet(path: str, text_field: str, id_field: str | None, errors: str = "strict") -> Records:
    pa = require_pyarrow("parquet input")
    import pyarrow.parquet as pq
    if path == "-":
        raise InputError("parquet input cannot come from stdin (the file's footer is read first): give a file")
    if os.path.isdir(path):
        raise InputError(f"cannot read input {path}: it is a directory")
    try:
        source = open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot read input {path}: {e.strerror}") from None
    try:
        file = pq.ParquetFile(source)
    except (OSError, pa.ArrowInvalid) as e:
        source.close()
        raise InputError(f"cannot read {path} as Parquet: {e}") from None
    schema = file.schema_arrow
    try:
        check_text_column(schema, text_field, path)
        if id_field is not None and id_field not in schema.names:
            raise _columns_error(path, "id", id_field, schema.names)
    except InputError:
        source.close()
        raise
    records = Records(None, id_field or "row", schema.field(id_field).type if id_field else None)
    records.texts = _parquet_texts(file, source, path, text_field, id_field, errors, records.keys)
    return records


def check_text_column(schema, name: str, where: str):
    """Refuse a schema without a string column `name`, naming `where`."""
    import pyarrow as pa
    if name not in schema.names:
        raise _columns_error(where, "text", name, schema.names)
    kind = schema.field(name).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or _is_string_view(kind)):
        raise InputError(f"{where}: column {name!r} holds {kind}, not strings")


def _is_string_view(kind) -> bool:
    import pyarrow as pa
    check = getattr(pa.types, "is_string_view", None)
    return bool(check and check(kind))


def _parquet_texts(file, source, where: str, text_field: str, id_field: str | None, errors: str, keys: deque):
    """The texts of `file` row group by row group (so that a damaged one is named), in batches."""
    import pyarrow as pa
    columns = [text_field] + ([id_field] if id_field is not None and id_field != text_field else [])
    row = 0
    groups = file.num_row_groups
    try:
        for group in range(groups):
            batches = file.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=columns)
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                except (OSError, pa.ArrowException) as e:
                    size = file.metadata.row_group(group).num_rows
                    raise InputError(f"cannot read {where} as Parquet: row group {group + 1} of {groups} (rows "
                                     f"{row + 1}..{row + size}) is damaged: {e}") from None
                texts = batch.column(text_field)
                if texts.null_count:
                    first = next(i for i, valid in enumerate(texts.is_valid().to_pylist()) if not valid)
                    raise InputError(f"{where}, row {row + first + 1}: column {text_field!r} is null, not a string")
                texts = _parquet_strings(texts, where, row, f"column {text_field!r}", errors)
                ids = batch.column(id_field) if id_field is not None else None
                if ids is not None and (pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)
                                        or _is_string_view(ids.type)):
                    ids = _parquet_strings(ids, where, row, f"id column {id_field!r}", "strict")
                elif ids is not None:
                    ids = ids.to_pylist()
                for i, text in enumerate(texts):
                    row += 1
                    keys.append(row if ids is None else ids[i])
                    yield text
    finally:
        file.close()
        source.close()


def _parquet_strings(array, where: str, row: int, what: str, errors: str) -> list:
    """A string array's values (nulls as None); invalid UTF-8 (which Parquet writers do not always
    refuse) refused naming the row (`row`: the rows before the array), or replaced by U+FFFD."""
    import pyarrow as pa
    try:
        return array.to_pylist()
    except UnicodeDecodeError:
        pass
    kind = array.type
    raw = array.view(pa.large_binary() if pa.types.is_large_string(kind) else
                     pa.binary_view() if _is_string_view(kind) else pa.binary()).to_pylist()
    out = []
    for i, value in enumerate(raw):
        try:
            out.append(None if value is None else value.decode("utf-8", errors=errors))
        except UnicodeDecodeError as e:
            hint = REPLACE_HINT if what.startswith("column") else ""
            raise InputError(f"{where}, row {row + i + 1}: invalid UTF-8 in {what} at byte {e.start}{hint}") from None
    return out
