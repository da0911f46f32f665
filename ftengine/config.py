"""Model configurations, built key by key from a checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

SUPPORTED_BERT_TYPES = ("bert",)
# hidden_act value -> the GELU form the ops implement
GELU_FORMS = {
    "gelu": "erf",
    "gelu_new": "tanh",
    "gelu_pytorch_tanh": "tanh",
}
SUPPORTED_POSITION_TYPES = ("absolute",)


def read_json(path: Path, what: str) -> dict:
    """Parse a JSON object from `path`, naming the file in every error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


class _Keys:
    """Typed access to config.json values; every error names the file and the key."""

    def __init__(self, data: dict, path: Path):
        self.data = data
        self.path = path

    def _check(self, key, value, kind):
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            raise ConfigError(
                f"{self.path}: key {key!r} must be {kind.__name__}, found {value!r}"
            )
        return value

    def required(self, key, kind):
        if key not in self.data:
            raise ConfigError(f"{self.path}: required key {key!r} is missing")
        return self._check(key, self.data[key], kind)

    def optional(self, key, kind, default):
        value = self.data.get(key)
        return default if value is None else self._check(key, value, kind)

    def positive_float(self, key, default):
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{self.path}: key {key!r} must be a number > 0, found {value!r}")
        return float(value)

    def positive(self, key):
        value = self.required(key, int)
        if value < 1:
            raise ConfigError(f"{self.path}: key {key!r} must be >= 1, found {value}")
        return value


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int                # 30522
    hidden_size: int               # 768 (384 for all-MiniLM-L6-v2)
    num_hidden_layers: int         # 12
    num_attention_heads: int       # 12
    intermediate_size: int         # 3072
    max_position_embeddings: int   # 512
    type_vocab_size: int           # 2
    layer_norm_eps: float          # 1e-12
    gelu: str                      # "erf" or "tanh", from hidden_act
    pad_token_id: int              # 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, data: dict, path: Path) -> "BertConfig":
        keys = _Keys(data, path)
        model_type = keys.required("model_type", str)
        if model_type not in SUPPORTED_BERT_TYPES:
            raise ConfigError(
                f"{path}: model_type {model_type!r} is not supported by the encoder; "
                f"supported: {', '.join(SUPPORTED_BERT_TYPES)}"
            )
        act = keys.required("hidden_act", str)
        if act not in GELU_FORMS:
            raise ConfigError(
                f"{path}: hidden_act {act!r} is not supported; supported: {', '.join(GELU_FORMS)}"
            )
        position_type = keys.optional("position_embedding_type", str, "absolute")
        if position_type not in SUPPORTED_POSITION_TYPES:
            raise ConfigError(
                f"{path}: position_embedding_type {position_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_POSITION_TYPES)}"
            )
        hidden = keys.positive("hidden_size")
        heads = keys.positive("num_attention_heads")
        if hidden % heads:
            raise ConfigError(
                f"{path}: hidden_size {hidden} is not divisible by num_attention_heads {heads}"
            )
        eps = keys.positive_float("layer_norm_eps", 1e-12)
        return cls(
            vocab_size=keys.positive("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=keys.positive("num_hidden_layers"),
            num_attention_heads=heads,
            intermediate_size=keys.positive("intermediate_size"),
            max_position_embeddings=keys.positive("max_position_embeddings"),
            type_vocab_size=keys.optional("type_vocab_size", int, 2),
            layer_norm_eps=eps,
            gelu=GELU_FORMS[act],
            pad_token_id=keys.optional("pad_token_id", int, 0),
        )


def load_bert_config(model_dir: Path) -> BertConfig:
    path = Path(model_dir) / "config.json"
    return BertConfig.from_dict(read_json(path, "model config"), path)
