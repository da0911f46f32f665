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
