import pytest

from ftengine.errors import InputError
from ftengine.textio import decode_lines


@pytest.mark.parametrize("data, lines", [
    (b"a\nb\n", ["a", "b"]),
    (b"a\nb", ["a", "b"]),
    (b"a\r\n\r\nb\r\n", ["a", "", "b"]),
    (b"\n\n", ["", ""]),
    (b"", []),
    ("\ufeffbom first\n".encode(), ["bom first"]),
])
def test_lines(data, lines):
    assert decode_lines(data, source="f") == lines


def test_invalid_utf8_line_number_and_replace():
    with pytest.raises(InputError, match=r"f, line 2: invalid UTF-8 at byte 1"):
        decode_lines(b"ok\nx\xc3(\n", source="f")
    assert decode_lines(b"ok\nx\xc3(\n", source="f", errors="replace") == ["ok", "x\ufffd("]


FILES = [b"a\nb\n", b"a\nb", b"a\r\n\r\nb\r\n", b"x\r\r\n", b"\n\n", b"", b"\n", "\ufeffbom\n\ufeffagain\n".encode(),
         "\ufeff\ufeff\n".encode(), b"ok\nx\xc3(\n\xff\xfe\n", "é\n日本\n".encode() * 3]


@pytest.mark.parametrize("data", FILES)
@pytest.mark.parametrize("block", [1, 3, 1 << 20])
def test_block_and_raw_readers_give_the_lines_of_the_line_reader(tmp_path, monkeypatch, data, block):
    """iter_lines (blocks decoded whole), RawLines iterated and RawLines.windows decoded: the lines
    decode_lines gives (a line at a time), their numbers as keys, blocks cutting lines anywhere."""
    from collections import deque
    from ftengine import textio
    monkeypatch.setattr(textio, "BLOCK_BYTES", block)
    monkeypatch.setattr(textio, "RAW_BLOCK_BYTES", block)
    path = tmp_path / "in.txt"
    path.write_bytes(data)
    want = decode_lines(data, source=str(path), errors="replace")
    assert list(textio.iter_lines(str(path), errors="replace")) == want
    keys = deque()
    assert list(textio.RawLines(str(path), errors="replace", keys=keys)) == want
    assert list(keys) == list(range(1, len(want) + 1))
    keys = deque()
    windows = list(textio.RawLines(str(path), errors="replace", keys=keys).windows(2))
    assert [t for w in windows for t in w.decoded()] == want
    assert list(keys) == list(range(1, len(want) + 1)) == [w.first + i for w in windows for i in range(len(w))]


def test_raw_lines_name_the_invalid_line(tmp_path):
    from ftengine.textio import RawLines
    path = tmp_path / "in.txt"
    path.write_bytes(b"ok\nfine\nx\xc3(\n")
    windows = list(RawLines(str(path)).windows(2))
    assert windows[0].decoded() == ["ok", "fine"]
    with pytest.raises(InputError, match=r"in.txt, line 3: invalid UTF-8 at byte 1"):
        windows[1].decoded()
