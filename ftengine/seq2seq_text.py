"""Text <-> token ids for the encoder-decoders, through the checkpoint's own files: Marian's
source.spm / target.spm + vocab.json with the `sentencepiece` library (the `translate` extra), as
HF MarianTokenizer splits and joins them; BART's, mBART's and NLLB's tokenizer.json with
`tokenizers`, with the language codes placed as HF's tokenizers place them.

Each splits a source into (prefix, body, suffix) ids, so that a long source is cut in its body,
and says what a target language changes in the decoder (its start token, its forced first token)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .errors import ConfigError, InputError

MARIAN_FILES = ("source.spm", "target.spm", "vocab.json")


class MarianText:
    """HF MarianTokenizer's encode (an optional leading >>lang<< code kept whole, the rest split by the
    source sentencepiece model, pieces looked up in vocab.json, </s> appended) and decode with
    skip_special_tokens=True (pieces joined by the sentencepiece model, as HF joins them: the
    source's for a shared vocabulary; with separate ones (separate_vocabs), the target's, its ids
    looked up in target_vocab.json)."""

    def __init__(self, folder: Path):
        settings = {}
        if (folder / "tokenizer_config.json").is_file():
            settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        separate = bool(settings.get("separate_vocabs"))
        missing = [name for name in MARIAN_FILES + (("target_vocab.json",) if separate else ())
                   if not (folder / name).is_file()]
        if missing:
            raise ConfigError(f"{folder}: Marian's tokenizer files are missing: {', '.join(missing)}")
        try:
            import sentencepiece
        except ImportError:
            raise ConfigError("Marian checkpoints tokenise with sentencepiece: pip install 'ftengine[translate]'") \
                from None
        self.vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        target = json.loads((folder / "target_vocab.json").read_text(encoding="utf-8")) if separate else self.vocab
        self.pieces = {i: piece for piece, i in target.items()}
        names = {kind: _token(settings.get(f"{kind}_token"), default)
                 for kind, default in (("eos", "</s>"), ("unk", "<unk>"), ("pad", "<pad>"))}
        for kind, name in names.items():
            if name not in self.vocab:
                raise ConfigError(f"{folder}/vocab.json has no {kind} token {name!r}")
        self.eos_id, self.unk_id, self.pad_id = (self.vocab[names[k]] for k in ("eos", "unk", "pad"))
        # HF skips the special tokens' ids as the source vocabulary numbers them, whichever side decodes
        self.special = {self.eos_id, self.unk_id, self.pad_id}
        self.special_text, self.unk = set(names.values()), names["unk"]
        self.codes = {piece for piece in self.vocab if piece.startswith(">>") and piece.endswith("<<")}
        models = {}
        for side in ("source", "target") if separate else ("source",):
            try:
                models[side] = sentencepiece.SentencePieceProcessor(model_file=str(folder / f"{side}.spm"))
            except (OSError, RuntimeError) as e:
                raise ConfigError(f"{folder}/{side}.spm: cannot load the sentencepiece model ({e})") from None
        # HF decodes a shared vocabulary with the source model, separate ones with the target's
        self.source, self.output = models["source"], models.get("target", models["source"])

    def encode(self, text: str) -> list:
        """The source's token ids, </s> last."""
        return [t for part in self.source_parts(text) for t in part]

    def source_parts(self, text: str, src_lang: str | None = None, tgt_lang: str | None = None) -> tuple:
        """([], the pieces' ids (a >>tgt_lang<< code first, or one the text starts with), [</s>])."""
        if tgt_lang is not None:
            text = f">>{tgt_lang}<< {text}"
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[:end + 2]], text[end + 2:]
        pieces = code + self.source.encode(text, out_type=str)
        return [], [self.vocab.get(piece, self.unk_id) for piece in pieces], [self.eos_id]

    target_codes = frozenset()  # the decoder never needs a language code: it goes in the source

    def target(self, tgt_lang: str | None) -> dict:
        """What the target language sets in the decoder: nothing."""
        return {}

    def decode(self, ids) -> str:
        """Generated ids as text, special tokens left out; a special token's text that is still
        there (a target id whose number differs from the source's) is kept whole, as HF keeps it."""
        text, run = "", []
        for i in ids:
            if i in self.special:
                continue
            piece = self.pieces.get(i) or self.output.id_to_piece(i) or self.unk
            if piece in self.special_text:
                text, run = text + self.output.decode_pieces(run) + piece + " ", []
            else:
                run.append(piece)
        return (text + self.output.decode_pieces(run)).replace("\u2581", " ").strip()

    def check_languages(self, src_lang: str | None, tgt_lang: str | None, names=("src_lang", "tgt_lang")):
        """Marian models translate from one source language; refuse a >>lang<< code the vocabulary
        lacks, listing the ones it has."""
        if src_lang is not None:
            raise InputError(f"{names[0]}: this Marian model translates from one source language; leave it out")
        if tgt_lang is not None and f">>{tgt_lang}<<" not in self.codes:
            known = ", ".join(sorted(c[2:-2] for c in self.codes)) or "none (a single-target model)"
            raise InputError(f"{names[1]}: unknown target language {tgt_lang!r}; this model knows: {known}")


# language codes as the Hub's files spell them: mBART's en_XX, NLLB's eng_Latn, M2M100's __en__
LANGUAGE_CODE = re.compile(r"[a-z]{2,3}_[A-Z][A-Za-z]{1,3}|__[a-z]{2,3}(_[a-z]+)?__")
# the source language HF's tokenizers assume when none is given
DEFAULT_SOURCE = ("eng_Latn", "en_XX")
# tokenizer classes that put the language code after </s> and start the decoder with the target's
SUFFIX_CODE_CLASSES = ("MBartTokenizer", "MBartTokenizerFast")


class TokenizerJsonText:
    """tokenizer.json through `tokenizers`, as HF's BART, mBART(-50) and NLLB tokenizers use it:
    without language codes the file's post-processor places the special tokens; with them the
    source is [src_lang] + text + [</s>] (mBART-50, NLLB) or text + [</s>, src_lang] (mBART, NLLB's
    legacy_behaviour), and the target language is the decoder's forced first token (mBART-50,
    NLLB) or its start token (mBART). Decoding is HF's decode(skip_special_tokens=True)."""

    def __init__(self, folder: Path):
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{folder}: no tokenizer.json (this family's tokenizer is read from it)")
        from tokenizers import Tokenizer
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise ConfigError(f"{path}: cannot read the tokenizer ({e})") from None
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        settings = {}
        if (folder / "tokenizer_config.json").is_file():
            settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        listed = settings.get("extra_special_tokens") or settings.get("additional_special_tokens") or []
        if not isinstance(listed, list):
            listed = []
        added = [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]
        names = [_token(n, "") for n in listed] or added
        self.codes = {n: self.tokenizer.token_to_id(n) for n in names
                      if LANGUAGE_CODE.fullmatch(n) and self.tokenizer.token_to_id(n) is not None}
        eos = _token(settings.get("eos_token"), "</s>")
        self.eos_id = self.tokenizer.token_to_id(eos)
        if self.codes and self.eos_id is None:
            raise ConfigError(f"{path} has no eos token {eos!r}")
        self.suffix_codes = settings.get("tokenizer_class") in SUFFIX_CODE_CLASSES \
            or bool(settings.get("legacy_behaviour"))
        default = settings.get("src_lang")
        self.default_source = default if default in self.codes else \
            next((c for c in DEFAULT_SOURCE if c in self.codes), None)
        self.clean_up = bool(settings.get("clean_up_tokenization_spaces", False))
        empty = self.tokenizer.encode("").ids
        probe = self.tokenizer.encode("a", add_special_tokens=False).ids
        full = self.tokenizer.encode("a").ids
        cut = next((k for k in range(len(empty) + 1) if full[k:k + len(probe)] == probe), 0)
        self.specials = (empty[:cut], empty[cut:])  # the post-processor's tokens before and after the text

    def source_parts(self, text: str, src_lang: str | None = None, tgt_lang: str | None = None) -> tuple:
        body = self.tokenizer.encode(text, add_special_tokens=False).ids
        if not self.codes:
            return list(self.specials[0]), body, list(self.specials[1])
        code = self.codes[src_lang or self.default_source]
        if self.suffix_codes:
            return [], body, [self.eos_id, code]
        return [code], body, [self.eos_id]

    @property
    def target_codes(self) -> frozenset:
        """The language codes' ids: a multilingual decoder starts with or is forced to one."""
        return frozenset(self.codes.values())

    def target(self, tgt_lang: str | None) -> dict:
        if tgt_lang is None:
            return {}
        code = self.codes[tgt_lang]
        return {"decoder_start_token_id": code} if self.suffix_codes else {"forced_bos_token_id": code}

    def decode(self, ids) -> str:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return _clean_up_spaces(text) if self.clean_up else text

    def check_languages(self, src_lang: str | None, tgt_lang: str | None, names=("src_lang", "tgt_lang")):
        _check_codes(self.codes, self.default_source, src_lang, tgt_lang, names)


M2M100_FILES = ("sentencepiece.bpe.model", "vocab.json")
SPECIAL_PIECES = ("<s>", "</s>", "<pad>", "<unk>")


class M2M100Text:
    """HF's M2M100Tokenizer (the m2m100_418M / 1.2B checkpoints, which ship no tokenizer.json):
    sentencepiece pieces looked up in vocab.json, the language codes (__en__, ...) numbered after
    the vocabulary in the order the tokenizer's files list them; a source is [__src__] + text +
    [</s>], the target language the decoder's forced first token; decoding leaves the special
    tokens out and joins the pieces with sentencepiece."""

    def __init__(self, folder: Path):
        missing = [name for name in M2M100_FILES if not (folder / name).is_file()]
        if missing:
            raise ConfigError(f"{folder}: no tokenizer.json, and M2M100's tokenizer files are missing: "
                              f"{', '.join(missing)}")
        try:
            import sentencepiece
        except ImportError:
            raise ConfigError("M2M100 checkpoints without tokenizer.json tokenise with sentencepiece: "
                              "pip install 'ftengine[translate]'") from None
        self.vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        listed = []
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (folder / name).is_file() and not listed:
                settings = json.loads((folder / name).read_text(encoding="utf-8"))
                listed = settings.get("extra_special_tokens") or settings.get("additional_special_tokens") or []
        names = [n for n in (_token(x, "") for x in listed) if re.fullmatch(r"__[a-z]{2,3}(_[a-z]+)?__", n)]
        if not names:
            raise ConfigError(f"{folder}: the tokenizer's files list no language codes (__en__, ...)")
        self.codes = {n[2:-2]: len(self.vocab) + i for i, n in enumerate(names)}
        self.eos_id, self.unk_id = self.vocab["</s>"], self.vocab["<unk>"]
        self.special = {self.vocab[t] for t in SPECIAL_PIECES if t in self.vocab}
        self.special |= set(self.codes.values())
        self.pieces = {i: piece for piece, i in self.vocab.items()}
        self.default_source = "en" if "en" in self.codes else None
        try:
            self.model = sentencepiece.SentencePieceProcessor(model_file=str(folder / "sentencepiece.bpe.model"))
        except (OSError, RuntimeError) as e:
            raise ConfigError(f"{folder}/sentencepiece.bpe.model: cannot load the sentencepiece model ({e})") from None

    @property
    def target_codes(self) -> frozenset:
        return frozenset(self.codes.values())

    def source_parts(self, text: str, src_lang: str | None = None, tgt_lang: str | None = None) -> tuple:
        body = [self.vocab.get(piece, self.unk_id) for piece in self.model.encode(text, out_type=str)]
        return [self.codes[src_lang or self.default_source]], body, [self.eos_id]

    def target(self, tgt_lang: str | None) -> dict:
        return {} if tgt_lang is None else {"forced_bos_token_id": self.codes[tgt_lang]}

    def decode(self, ids) -> str:
        """As HF's decode(skip_special_tokens=True): an id outside the vocabulary and the codes
        reads "<unk>", which, as a special token's text, is kept verbatim between the decoded
        runs of pieces."""
        out, run = "", []
        for i in ids:
            if i in self.special:
                continue
            piece = self.pieces.get(i, "<unk>")
            if piece in SPECIAL_PIECES:
                out, run = out + self.model.decode(run) + piece, []
            else:
                run.append(piece)
        return (out + self.model.decode(run)).strip()

    def check_languages(self, src_lang: str | None, tgt_lang: str | None, names=("src_lang", "tgt_lang")):
        _check_codes(self.codes, self.default_source, src_lang, tgt_lang, names)


def _check_codes(codes: dict, default_source: str | None, src_lang, tgt_lang, names):
    """Refuse codes the tokenizer lacks (listing those it has), and a multilingual model's source
    without a language where the tokenizer assumes none."""
    for name, code in zip(names, (src_lang, tgt_lang)):
        if code is None or code in codes:
            continue
        known = ", ".join(sorted(codes)) or "none (not a multilingual model)"
        raise InputError(f"{name}: unknown language {code!r}; this model knows: {known}")
    if codes and src_lang is None and default_source is None:
        raise InputError(f"{names[0]}: this model takes the source's language; one of {', '.join(sorted(codes))}")


def _clean_up_spaces(text: str) -> str:
    """HF's clean_up_tokenization: no space before punctuation and English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _token(value, default: str) -> str:
    if isinstance(value, dict):  # an AddedToken saved as a dict
        value = value.get("content")
    return value if isinstance(value, str) else default


def load_text(folder: Path, model_type: str):
    """The tokenizer a checkpoint's family uses."""
    if model_type == "marian":
        return MarianText(folder)
    if model_type == "m2m_100" and not (folder / "tokenizer.json").is_file():
        return M2M100Text(folder)
    return TokenizerJsonText(folder)
