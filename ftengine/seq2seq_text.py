"""Text <-> token ids for the encoder-decoders, through the checkpoint's own files: Marian's
source.spm / target.spm + vocab.json with the `sentencepiece` library (the `translate` extra), as
HF MarianTokenizer splits and joins them."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ConfigError, InputError

MARIAN_FILES = ("source.spm", "target.spm", "vocab.json")


class MarianText:
    """HF MarianTokenizer's encode (an optional leading >>lang<< code kept whole, the rest split by the
    source sentencepiece model, pieces looked up in vocab.json, </s> appended) and decode with
    skip_special_tokens=True (pieces joined by the sentencepiece model, as HF joins them for a
    shared vocabulary)."""

    def __init__(self, folder: Path):
        missing = [name for name in MARIAN_FILES if not (folder / name).is_file()]
        if missing:
            raise ConfigError(f"{folder}: Marian's tokenizer files are missing: {', '.join(missing)}")
        try:
            import sentencepiece
        except ImportError:
            raise ConfigError("Marian checkpoints tokenise with sentencepiece: pip install 'ftengine[translate]'") \
                from None
        settings = {}
        if (folder / "tokenizer_config.json").is_file():
            settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        if settings.get("separate_vocabs"):
            raise ConfigError(f"{folder}: separate source and target vocabularies are not supported")
        self.vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        self.pieces = {i: piece for piece, i in self.vocab.items()}
        names = {kind: _token(settings.get(f"{kind}_token"), default)
                 for kind, default in (("eos", "</s>"), ("unk", "<unk>"), ("pad", "<pad>"))}
        for kind, name in names.items():
            if name not in self.vocab:
                raise ConfigError(f"{folder}/vocab.json has no {kind} token {name!r}")
        self.eos_id, self.unk_id, self.pad_id = (self.vocab[names[k]] for k in ("eos", "unk", "pad"))
        self.special = {self.eos_id, self.unk_id, self.pad_id}
        self.codes = {piece for piece in self.vocab if piece.startswith(">>") and piece.endswith("<<")}
        try:
            # HF decodes a shared vocabulary with the source model
            self.source = sentencepiece.SentencePieceProcessor(model_file=str(folder / "source.spm"))
        except (OSError, RuntimeError) as e:
            raise ConfigError(f"{folder}/source.spm: cannot load the sentencepiece model ({e})") from None

    def encode(self, text: str) -> list:
        """The source's token ids, </s> last."""
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[:end + 2]], text[end + 2:]
        pieces = code + self.source.encode(text, out_type=str)
        return [self.vocab.get(piece, self.unk_id) for piece in pieces] + [self.eos_id]

    def decode(self, ids) -> str:
        """Generated ids as text, special tokens left out."""
        pieces = [self.pieces.get(i) or self.source.id_to_piece(i) for i in ids if i not in self.special]
        return self.source.decode_pieces(pieces).replace("\u2581", " ").strip()

    def check_language(self, code: str | None, where: str):
        """Refuse a >>lang<< code the vocabulary lacks, listing the ones it has."""
        if code is not None and f">>{code}<<" not in self.codes:
            known = ", ".join(sorted(c[2:-2] for c in self.codes)) or "none (a single-target model)"
            raise InputError(f"{where}: unknown target language {code!r}; this model knows: {known}")


def _token(value, default: str) -> str:
    if isinstance(value, dict):  # an AddedToken saved as a dict
        value = value.get("content")
    return value if isinstance(value, str) else default


def load_text(folder: Path, model_type: str):
    """The tokenizer a checkpoint's family uses."""
    if model_type == "marian":
        return MarianText(folder)
    raise ConfigError(f"{folder}: no tokenizer for model_type {model_type!r}")
