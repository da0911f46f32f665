"""What a request to `ftengine serve` may hold: the expected HTTP errors (HTTPFailure), the readers of
its JSON fields, each naming the field it refuses, and the encoding of the answers."""

from __future__ import annotations


class HTTPFailure(Exception):
    """An expected error: status, message, TEI error_type; extra headers."""

    def __init__(self, status: int, message: str, kind: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers or {}


def validation(message: str) -> HTTPFailure:
    return HTTPFailure(422, message, "Validation")


def texts_field(value, field: str) -> list:
    """A str or a non-empty list of str."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise validation(f"{field} must be a string or a list of strings")
    if not value:
        raise validation(f"{field} must not be empty")
    for i, t in enumerate(value):
        if not isinstance(t, str):
            raise validation(f"{field}[{i}] must be a string, found {type(t).__name__}")
    return value


def token_ids_field(value: list, field: str) -> list | None:
    """[int] or [[int]] as a list of sequences; None if `value` is not token ids (its first item
    is neither a number nor a list)."""
    first = value[0] if value else None
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        value = [value]
    elif not isinstance(first, list):
        return None
    for i, seq in enumerate(value):
        if not isinstance(seq, list):
            raise validation(f"{field}[{i}] must be a list of token ids, found {type(seq).__name__}")
        if not seq:
            raise validation(f"{field}[{i}] is an empty token list")
        for t in seq:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2 ** 31:
                raise validation(f"{field}[{i}] must hold token ids (integers within 0..2^31-1), found {t!r}")
    return value


def dumps(value) -> bytes:
    """JSON with float32 arrays written by orjson: about 40x faster than json.dumps of
    tolist() for a batch of embeddings, which otherwise sets the service's ceiling."""
    import orjson
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


def bool_field(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise validation(f"{key} must be true or false, found {value!r}")
    return value
