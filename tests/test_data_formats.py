"""`ftengine encode` on JSONL, CSV, TSV and Parquet input, and Parquet output: every format gives
the .txt path's embeddings on the same texts, keys go to the output, and every bad input is
one line naming the file, the line or row, and the field or column."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from cli import main
from ftengine import Encoder
from tests.tolerances import BATCHING_INVARIANCE_FP32

TEXTS = ["the quick brown fox", "", "hello, world", "   ", "a dog " * 30, 'a "quoted" text; with\ttab', "ünïcödé ✓",
         "text line 42"]
IDS = [f"doc-{i:03d}" for i in range(len(TEXTS))]


def run(*args, input=None):
    result = CliRunner().invoke(main, ["encode", *map(str, args)], input=input)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def write_inputs(folder, texts=TEXTS, ids=IDS) -> dict:
    """The same records as .txt, .jsonl, .csv, .tsv and .parquet (text column `body`, id `doc`)."""
    paths = {fmt: folder / f"in.{fmt}" for fmt in ("txt", "jsonl", "csv", "tsv", "parquet")}
    paths["txt"].write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    paths["jsonl"].write_text("".join(json.dumps({"doc": i, "body": t, "other": [1]}) + "\n"
                                      for i, t in zip(ids, texts)), encoding="utf-8")
    table = pa.table({"doc": ids, "n": list(range(len(texts))), "body": texts})
    pacsv.write_csv(table, paths["csv"])
    pacsv.write_csv(table, paths["tsv"], pacsv.WriteOptions(delimiter="\t"))
    pq.write_table(table, paths["parquet"], row_group_size=3)
    return paths


@pytest.fixture(scope="module")
def reference(st_model):
    with Encoder.from_pretrained(st_model, device="cpu") as encoder:
        return encoder.encode(TEXTS)


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "csv", "tsv", "parquet"])
def test_every_input_format_gives_the_txt_embeddings(st_model, reference, tmp_path, fmt):
    paths = write_inputs(tmp_path)
    columns = [] if fmt == "txt" else ["--text-field" if fmt == "jsonl" else "--text-column", "body"]
    out = tmp_path / "out.npy"
    r = run(paths[fmt], "-o", out, "--model", st_model, "--device", "cpu", *columns)
    assert r.exit_code == 0, r.stderr
    assert f"{len(TEXTS)} lines" in r.stderr
    assert np.abs(np.load(out) - reference).max() <= BATCHING_INVARIANCE_FP32


@pytest.mark.parametrize("fmt, key, keys", [
    ("txt", "line", list(range(1, len(TEXTS) + 1))),
    ("jsonl", "line", list(range(1, len(TEXTS) + 1))),
    ("csv", "row", list(range(1, len(TEXTS) + 1))),
    ("parquet", "row", list(range(1, len(TEXTS) + 1))),
])
def test_parquet_output_has_keys_and_fixed_size_embeddings(st_model, reference, tmp_path, fmt, key, keys):
    paths = write_inputs(tmp_path)
    columns = [] if fmt == "txt" else ["--text-column", "body"]
    out = tmp_path / "out.parquet"
    r = run(paths[fmt], "-o", out, "--model", st_model, "--device", "cpu", *columns)
    assert r.exit_code == 0, r.stderr
    table = pq.read_table(out)
    assert table.schema.names == [key, "embedding"]
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 32)
    assert table.column(key).to_pylist() == keys
    got = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    assert np.abs(got - reference).max() <= BATCHING_INVARIANCE_FP32


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "tsv", "parquet"])
def test_id_column_is_carried_to_parquet_and_jsonl(st_model, reference, tmp_path, fmt):
    paths = write_inputs(tmp_path)
    out = tmp_path / "out.parquet"
    r = run(paths[fmt], "-o", out, "--model", st_model, "--device", "cpu", "--text-column", "body", "--id-column", "doc")
    assert r.exit_code == 0, r.stderr
    table = pq.read_table(out)
    assert table.schema.names == ["doc", "embedding"] and table.column("doc").to_pylist() == IDS
    r = run(paths[fmt], "-o", "-", "--model", st_model, "--device", "cpu", "--text-field", "body", "--id-field", "doc")
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["doc"] for row in rows] == IDS
    assert np.abs(np.array([row["embedding"] for row in rows]) - reference).max() <= BATCHING_INVARIANCE_FP32


def test_parquet_ids_keep_their_type(st_model, tmp_path):
    source = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": TEXTS, "id": pa.array(range(100, 100 + len(TEXTS)), pa.int32())}), source)
    out = tmp_path / "out.parquet"
    r = run(source, "-o", out, "--model", st_model, "--device", "cpu", "--id-column", "id")
    assert r.exit_code == 0, r.stderr
    table = pq.read_table(out)
    assert table.schema.field("id").type == pa.int32()
    assert table.column("id").to_pylist() == list(range(100, 100 + len(TEXTS)))


def test_jsonl_on_stdin_and_blank_lines(st_model, reference):
    data = "".join(json.dumps({"text": t}) + "\n\n" for t in TEXTS)  # a blank line after each record
    r = run("-", "--input-format", "jsonl", "-o", "-", "--model", st_model, "--device", "cpu", "--quiet", input=data)
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["line"] for row in rows] == list(range(1, 2 * len(TEXTS), 2))  # the records' own line numbers
    assert np.abs(np.array([row["embedding"] for row in rows]) - reference).max() <= BATCHING_INVARIANCE_FP32


def test_quoted_newlines_in_csv_are_one_text(st_model, tmp_path):
    texts = ["first line\nsecond line", "plain"]
    source = tmp_path / "multi.csv"
    pacsv.write_csv(pa.table({"text": texts}), source)
    out = tmp_path / "out.npy"
    r = run(source, "-o", out, "--model", st_model, "--device", "cpu")
    assert r.exit_code == 0, r.stderr
    with Encoder.from_pretrained(st_model, device="cpu") as encoder:
        assert np.abs(np.load(out) - encoder.encode(texts)).max() <= BATCHING_INVARIANCE_FP32


def _bad_files(folder):
    """name -> (file, extra args, message)."""
    cases = {}

    def jsonl(name, lines, args=(), message=""):
        path = folder / f"{name}.jsonl"
        path.write_bytes(b"".join(line + b"\n" for line in lines))
        cases[name] = (path, list(args), message)

    jsonl("missing_field", [b'{"text": "ok"}', b'{"body": "x"}'], (), "bad.jsonl, line 2: no field 'text' (fields: 'body')")
    jsonl("number", [b'{"text": "ok"}', b'{"text": 5}'], (), "line 2: field 'text' is a number, not a string")
    jsonl("null", [b'{"text": null}'], (), "line 1: field 'text' is null, not a string")
    jsonl("not_json", [b'{"text": "ok"}', b'{"text": '], (), "line 2: not valid JSON")
    jsonl("array", [b'["text"]'], (), "line 1: expected a JSON object, found an array")
    jsonl("bad_utf8", [b'{"text": "ok"}', b'{"text": "\xff"}'], (), "line 2: invalid UTF-8 at byte 10")
    jsonl("mixed_ids", [b'{"text": "a", "id": 1}', b'{"text": "b", "id": "2"}'], ("--id-field", "id"),
          "line 2: id field 'id' is a string, earlier ids are integers")
    jsonl("float_id", [b'{"text": "a", "id": 1.5}'], ("--id-field", "id"),
          "line 1: id field 'id' is a number; ids must be strings or integers")
    jsonl("missing_id", [b'{"text": "a"}'], ("--id-field", "id"), "line 1: no field 'id' (fields: 'text')")
    csv = folder / "cols.csv"
    csv.write_text("a,b\n1,2\n")
    cases["csv_column"] = (csv, [], "cols.csv: no text column 'text' (columns: 'a', 'b')")
    cases["csv_id_column"] = (csv, ["--text-column", "a", "--id-column", "c"],
                              "cols.csv: no id column 'c' (columns: 'a', 'b')")
    ragged = folder / "ragged.csv"
    ragged.write_text("text\nfine\n" + "x\n" * 5 + "a,b\n")
    cases["csv_ragged"] = (ragged, [], "cannot read")
    bad_csv = folder / "utf.csv"
    bad_csv.write_bytes(b"text\nok\n\xffbad\n")
    cases["csv_utf8"] = (bad_csv, [], "utf.csv, row 2: invalid UTF-8 in column 'text' at byte 0")
    pq.write_table(pa.table({"body": ["a"]}), folder / "cols.parquet")
    cases["parquet_column"] = (folder / "cols.parquet", [], "cols.parquet: no text column 'text' (columns: 'body')")
    pq.write_table(pa.table({"text": [1, 2]}), folder / "ints.parquet")
    cases["parquet_type"] = (folder / "ints.parquet", [], "ints.parquet: column 'text' holds int64, not strings")
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), folder / "nulls.parquet", row_group_size=2)
    cases["parquet_null"] = (folder / "nulls.parquet", [], "nulls.parquet, row 3: column 'text' is null, not a string")
    (folder / "junk.parquet").write_bytes(b"not parquet at all")
    cases["parquet_junk"] = (folder / "junk.parquet", [], "cannot read")
    cases["txt_with_field"] = (folder / "cols.csv", ["--input-format", "txt", "--text-field", "a"],
                               "--text-field and --id-field apply to jsonl, csv, tsv and parquet input")
    return cases


BAD = ["missing_field", "number", "null", "not_json", "array", "bad_utf8", "mixed_ids", "float_id", "missing_id",
       "csv_column", "csv_id_column", "csv_ragged", "csv_utf8", "parquet_column", "parquet_type", "parquet_null",
       "parquet_junk", "txt_with_field"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_naming_the_place_and_writes_nothing(st_model, tmp_path, case):
    path, args, message = _bad_files(tmp_path)[case]
    if case == "missing_field":
        path = path.rename(tmp_path / "bad.jsonl")
    out = tmp_path / "out.parquet"
    out.write_bytes(b"precious")
    r = run(path, "-o", out, "--model", st_model, "--device", "cpu", *args)
    assert r.exit_code == 1, r.output
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert out.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_replace_errors_in_csv(st_model, tmp_path):
    path = tmp_path / "utf.csv"
    path.write_bytes(b"text\nok\n\xffbad\n")
    out = tmp_path / "out.npy"
    r = run(path, "-o", out, "--model", st_model, "--device", "cpu", "--errors", "replace")
    assert r.exit_code == 0, r.stderr
    with Encoder.from_pretrained(st_model, device="cpu") as encoder:
        assert np.abs(np.load(out) - encoder.encode(["ok", "\ufffdbad"])).max() <= BATCHING_INVARIANCE_FP32


def test_parquet_input_from_stdin_is_refused(st_model):
    r = run("-", "--input-format", "parquet", "--model", st_model, "--device", "cpu", input="")
    assert r.exit_code == 1 and "parquet input cannot come from stdin" in r.stderr


def test_parquet_output_on_stdout_is_refused(st_model, tmp_path):
    paths = write_inputs(tmp_path)
    r = run(paths["txt"], "-o", "-", "--format", "parquet", "--model", st_model, "--device", "cpu")
    assert r.exit_code == 1 and "parquet output is binary" in r.stderr


def test_large_parquet_output_in_row_groups(st_model, tmp_path, monkeypatch):
    """More rows than one row group holds: every row group in order, nothing lost between them."""
    import ftengine.writers
    monkeypatch.setattr(ftengine.writers, "PARQUET_ROW_GROUP_BYTES", 32 * 4 * 100)  # 100 rows a group
    texts = [f"text number {i} " + "word " * (i % 7) for i in range(1000)]
    source = tmp_path / "many.parquet"
    pq.write_table(pa.table({"text": texts, "key": [f"k{i}" for i in range(1000)]}), source, row_group_size=64)
    out = tmp_path / "out.parquet"
    r = run(source, "-o", out, "--model", st_model, "--device", "cpu", "--id-column", "key")
    assert r.exit_code == 0, r.stderr
    result = pq.ParquetFile(out)
    assert result.metadata.num_row_groups >= 10
    table = result.read()
    assert table.column("key").to_pylist() == [f"k{i}" for i in range(1000)]
    with Encoder.from_pretrained(st_model, device="cpu") as encoder:
        ref = encoder.encode(texts)
    got = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    assert np.abs(got - ref).max() <= BATCHING_INVARIANCE_FP32


def test_parquet_output_in_int8_and_binary(st_model, tmp_path):
    """Quantised embeddings go to Parquet as fixed-size lists of their own integer type."""
    from ftengine.output import calibration_ranges, quantize
    paths = write_inputs(tmp_path)
    with Encoder.from_pretrained(st_model, device="cpu") as encoder:
        calibration = encoder.encode(TEXTS + [t + " more" for t in TEXTS])
        ref = encoder.encode(TEXTS)
    np.save(tmp_path / "cal.npy", calibration)
    ranges = calibration_ranges(calibration)
    for precision, kind, width in (("int8", pa.int8(), 32), ("ubinary", pa.uint8(), 4)):
        out = tmp_path / f"{precision}.parquet"
        args = ["--calibration", tmp_path / "cal.npy"] if precision == "int8" else []
        r = run(paths["parquet"], "-o", out, "--model", st_model, "--device", "cpu", "--text-column", "body",
                "--precision", precision, *args)
        assert r.exit_code == 0, r.stderr
        table = pq.read_table(out)
        assert table.schema.field("embedding").type == pa.list_(kind, width)
        got = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
        np.testing.assert_array_equal(got, quantize(ref, precision, ranges if precision == "int8" else None))
