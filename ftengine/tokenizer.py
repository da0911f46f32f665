"""Tokenisation (HF `tokenizers`) and the sentence-transformers folder settings.

The folder files decide how an encoder model is used, as sentence-transformers does:
  modules.json                 which modules run (Transformer, Pooling, Normalize)
  sentence_bert_config.json    max_seq_length (wins over the tokenizer's own limit), do_lower_case
  1_Pooling/config.json        pooling modes (legacy booleans or the newer `pooling_mode`)
A plain BERT folder without them: mean pooling, no normalisation, max length = max positions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import read_json
from .errors import ConfigError, InputError

# sentence-transformers concatenates pooled vectors in this order.
POOLING_ORDER = ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}
_POOLING_NAMES = {
    "cls": "cls", "max": "max", "mean": "mean", "lasttoken": "lasttoken",
    "mean_sqrt_len": "mean_sqrt_len", "mean_sqrt_len_tokens": "mean_sqrt_len",
}
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"


def parse_pooling(value, where: str) -> tuple[str, ...]:
    """A mode name, a comma-separated string or a list of names -> modes in sentence-transformers' order."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names:
        raise ConfigError(f"{where}: pooling must be a mode name or a list of them, found {value!r}")
    modes = set()
    for n in names:
        key = str(n).strip().lower()
        if key not in _POOLING_NAMES:
            raise ConfigError(
                f"{where}: pooling mode {n!r} is not supported; supported: {', '.join(POOLING_ORDER)}"
            )
        modes.add(_POOLING_NAMES[key])
    return tuple(m for m in POOLING_ORDER if m in modes)


def _pooling_from_config(path: Path) -> tuple[str, ...]:
    cfg = read_json(path, "pooling config")
    if "pooling_mode" in cfg and not any(k in cfg for k in _LEGACY_POOLING_KEYS):
        return parse_pooling(cfg["pooling_mode"], str(path))
    if cfg.get("pooling_mode_weightedmean_tokens"):
        raise ConfigError(
            f"{path}: weightedmean pooling is not supported; supported: {', '.join(POOLING_ORDER)}"
        )
    modes = [mode for key, mode in _LEGACY_POOLING_KEYS.items() if cfg.get(key)]
    if not modes:
        raise ConfigError(f"{path}: no pooling mode is switched on")
    return parse_pooling(modes, str(path))


@dataclass(frozen=True)
class FolderSettings:
    """How a model folder is meant to be used for sentence embeddings."""
    model_dir: Path              # where config.json and the weights live
    max_length: int | None       # None: the model's max_position_embeddings
    pooling: tuple[str, ...]
    normalize: bool
    lowercase_text: bool         # sentence-transformers' do_lower_case (text, before tokenising)


def read_folder_settings(folder: Path) -> FolderSettings:
    folder = Path(folder)
    model_dir = folder
    pooling = ("mean",)
    normalize = False
    modules_path = folder / "modules.json"
    if modules_path.is_file():
        try:
            modules = json.loads(modules_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{modules_path} is not valid JSON: {e}") from None
        if not isinstance(modules, list):
            raise ConfigError(f"{modules_path} must hold a list of modules")
        for m in modules:
            kind = m.get("type", "") if isinstance(m, dict) else ""
            sub = folder / (m.get("path") or "") if isinstance(m, dict) else folder
            if kind == ST_TRANSFORMER:
                model_dir = sub
            elif kind == ST_POOLING:
                pooling = _pooling_from_config(sub / "config.json")
            elif kind == ST_NORMALIZE:
                normalize = True
            else:
                raise ConfigError(
                    f"{modules_path}: module {kind or m!r} is not supported; ftengine runs "
                    "Transformer, Pooling and Normalize modules"
                )
    max_length = None
    lowercase = False
    st_config = folder / "sentence_bert_config.json"
    if not st_config.is_file() and model_dir != folder:
        st_config = model_dir / "sentence_bert_config.json"
    if st_config.is_file():
        cfg = read_json(st_config, "sentence-transformers config")
        max_length = cfg.get("max_seq_length")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
            raise ConfigError(f"{st_config}: max_seq_length must be an integer >= 2, found {max_length!r}")
        lowercase = bool(cfg.get("do_lower_case", False))
    return FolderSettings(model_dir, max_length, pooling, normalize, lowercase)


@dataclass
class TokenizedText:
    ids: list           # token ids, special tokens included
    type_ids: list
    truncated: bool


class Tokenizer:
    """`tokenizer.json` through HF `tokenizers`, or a WordPiece `vocab.txt` as a fallback."""

    def __init__(self, model_dir: Path, *, max_length: int, lowercase_text: bool = False):
        from tokenizers import Tokenizer as HFTokenizer
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if path.is_file():
            try:
                tok = HFTokenizer.from_file(str(path))
            except Exception as e:  # tokenizers raises a bare Exception for malformed files
                raise ConfigError(f"{path}: cannot load tokenizer ({e})") from None
        elif (model_dir / "vocab.txt").is_file():
            tok = self._wordpiece(model_dir)
        else:
            raise ConfigError(f"no tokenizer.json or vocab.txt in {model_dir}")
        tok.no_padding()
        tok.enable_truncation(max_length=max_length)
        self._tok = tok
        self.max_length = max_length
        self.lowercase_text = lowercase_text

    @staticmethod
    def _wordpiece(model_dir: Path):
        from tokenizers.implementations import BertWordPieceTokenizer
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = read_json(cfg_path, "tokenizer config") if cfg_path.is_file() else {}
        lowercase = bool(cfg.get("do_lower_case", True))
        strip_accents = cfg.get("strip_accents")
        return BertWordPieceTokenizer(
            str(model_dir / "vocab.txt"),
            lowercase=lowercase,
            strip_accents=lowercase if strip_accents is None else bool(strip_accents),
            handle_chinese_chars=bool(cfg.get("tokenize_chinese_chars", True)),
        )._tokenizer

    def encode(self, texts: list[str]) -> list[TokenizedText]:
        """Tokenise stripped texts; over-long texts are cut to max_length and flagged."""
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise InputError(f"text {i} is a {type(t).__name__}, not a str")
        prepared = [t.strip() for t in texts]
        if self.lowercase_text:
            prepared = [t.lower() for t in prepared]
        encodings = self._tok.encode_batch(prepared)
        return [TokenizedText(e.ids, e.type_ids, bool(e.overflowing)) for e in encodings]
