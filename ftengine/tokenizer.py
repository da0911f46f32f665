"""Tokenisation (HF `tokenizers`) and the sentence-transformers folder settings.

The folder files decide how an encoder model is used, as sentence-transformers does:
  modules.json                 which modules run (Transformer, Pooling, Normalize)
  sentence_bert_config.json    max_seq_length (wins over the tokenizer's own limit), do_lower_case
  1_Pooling/config.json        pooling modes (legacy booleans or the newer `pooling_mode`)
A plain BERT folder without them: mean pooling, no normalisation, max length = max positions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np

from .config import read_json
from .errors import ConfigError, InputError
from .textio import unicode_text

# sentence-transformers concatenates pooled vectors in this order.
POOLING_ORDER = ("cls", "max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken")  # sentence-transformers' order
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_POOLING_NAMES = {
    "cls": "cls", "max": "max", "mean": "mean", "lasttoken": "lasttoken",
    "mean_sqrt_len": "mean_sqrt_len", "mean_sqrt_len_tokens": "mean_sqrt_len", "weightedmean": "weightedmean",
}
# modules.json "type" -> module kind: the classic names, and where sentence-transformers 5+ saves them
ST_MODULES = {
    "sentence_transformers.models.Transformer": "Transformer",
    "sentence_transformers.models.Pooling": "Pooling",
    "sentence_transformers.models.Dense": "Dense",
    "sentence_transformers.models.Normalize": "Normalize",
    "sentence_transformers.base.modules.transformer.Transformer": "Transformer",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling": "Pooling",
    "sentence_transformers.base.modules.dense.Dense": "Dense",
    "sentence_transformers.sentence_transformer.modules.normalize.Normalize": "Normalize",
}
# Dense "activation_function" -> the head activation the ops apply
DENSE_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu",
}


@dataclass(frozen=True)
class DenseModule:
    """A sentence-transformers Dense module: its folder (weights in model.safetensors) and config."""
    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str   # a DENSE_ACTIVATIONS value


def _dense_from_config(folder: Path) -> DenseModule:
    path = folder / "config.json"
    cfg = read_json(path, "Dense module config")
    sizes = {}
    for key in ("in_features", "out_features"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{path}: {key} must be an integer >= 1, found {value!r}")
        sizes[key] = value
    act = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
    if act not in DENSE_ACTIVATIONS:
        raise ConfigError(f"{path}: activation_function {act!r} is not supported; supported: "
                          f"{', '.join(DENSE_ACTIVATIONS)}")
    if cfg.get("use_residual"):
        raise ConfigError(f"{path}: use_residual=true is not supported")
    return DenseModule(folder, sizes["in_features"], sizes["out_features"], bool(cfg.get("bias", True)),
                       DENSE_ACTIVATIONS[act])


def parse_pooling(value, where: str, *, ordered: bool = False) -> tuple[str, ...]:
    """A mode name, a comma-separated string or a list of names -> modes in sentence-transformers'
    legacy order (cls, max, mean, ...), or as given with ordered=True (a Pooling config's
    `pooling_mode` list, which sentence-transformers 5+ concatenates in its own order)."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names:
        raise ConfigError(f"{where}: pooling must be a mode name or a list of them, found {value!r}")
    modes = []
    for n in names:
        key = str(n).strip().lower()
        if key not in _POOLING_NAMES:
            raise ConfigError(
                f"{where}: pooling mode {n!r} is not supported; supported: {', '.join(POOLING_ORDER)}"
            )
        modes.append(_POOLING_NAMES[key])
    return tuple(modes) if ordered else tuple(m for m in POOLING_ORDER if m in modes)


def _pooling_from_config(path: Path) -> tuple[tuple[str, ...], bool]:
    """The pooling modes and include_prompt (false: the prompt's tokens are left out of pooling)."""
    cfg = read_json(path, "pooling config")
    include_prompt = cfg.get("include_prompt", True)
    if not isinstance(include_prompt, bool):
        raise ConfigError(f"{path}: include_prompt must be true or false, found {include_prompt!r}")
    if "pooling_mode" in cfg and not any(k in cfg for k in _LEGACY_POOLING_KEYS):
        return parse_pooling(cfg["pooling_mode"], str(path), ordered=True), include_prompt
    modes = [mode for key, mode in _LEGACY_POOLING_KEYS.items() if cfg.get(key)]
    if not modes:
        raise ConfigError(f"{path}: no pooling mode is switched on")
    return parse_pooling(modes, str(path)), include_prompt


@dataclass(frozen=True)
class FolderSettings:
    """How a model folder is meant to be used for sentence embeddings."""
    model_dir: Path              # where config.json and the weights live
    max_length: int | None       # None: the model's max_position_embeddings
    pooling: tuple[str, ...]
    normalize: bool
    lowercase_text: bool         # sentence-transformers' do_lower_case (text, before tokenising)
    prompts: dict = field(default_factory=dict)  # name -> text put before each input
    default_prompt_name: str | None = None
    dense: tuple = ()            # DenseModule, in order, between pooling and normalisation
    include_prompt: bool = True  # False: a prompt's tokens are left out of pooling


def _read_prompts(folder: Path) -> tuple[dict, str | None]:
    """config_sentence_transformers.json's `prompts` and `default_prompt_name`."""
    path = folder / "config_sentence_transformers.json"
    if not path.is_file():
        return {}, None
    cfg = read_json(path, "sentence-transformers config")
    prompts = cfg.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise ConfigError(f"{path}: prompts must map names to strings, found {prompts!r}")
    default = cfg.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ConfigError(f"{path}: default_prompt_name {default!r} is not one of the prompts "
                          f"({', '.join(prompts) or 'none defined'})")
    return prompts, default


def read_folder_settings(folder: Path) -> FolderSettings:
    folder = Path(folder)
    model_dir = folder
    pooling = ("mean",)
    include_prompt = True
    normalize = False
    dense = []
    modules_path = folder / "modules.json"
    if modules_path.is_file():
        try:
            modules = json.loads(modules_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{modules_path} is not valid JSON: {e}") from None
        if not isinstance(modules, list):
            raise ConfigError(f"{modules_path} must hold a list of modules")
        for m in modules:
            name = m.get("type", "") if isinstance(m, dict) else ""
            kind = ST_MODULES.get(name)
            sub = folder / (m.get("path") or "") if isinstance(m, dict) else folder
            if kind == "Transformer":
                model_dir = sub
            elif kind == "Pooling":
                pooling, include_prompt = _pooling_from_config(sub / "config.json")
            elif kind == "Dense" and not normalize:
                dense.append(_dense_from_config(sub))
            elif kind == "Normalize":
                normalize = True
            else:
                raise ConfigError(
                    f"{modules_path}: module {name or m!r} is not supported{' after Normalize' if kind else ''}; "
                    "ftengine runs Transformer, Pooling, Dense and Normalize modules, in that order"
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
    return FolderSettings(model_dir, max_length, pooling, normalize, lowercase, *_read_prompts(folder), tuple(dense),
                          include_prompt)


@dataclass
class TokenizedTexts:
    """Texts tokenised into flat arrays: sequence i owns ids[starts[i]:starts[i] + lengths[i]]."""
    ids: np.ndarray          # (T,) int32, special tokens included
    type_ids: np.ndarray     # (T,) int32
    lengths: np.ndarray      # (N,) int32
    truncated: np.ndarray    # (N,) bool: cut to max_length

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)[:-1]])

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def split(self, counts) -> list["TokenizedTexts"]:
        """Consecutive runs of counts[0], counts[1], ... texts, copies that own their arrays (the
        token offsets summed once, not once a part: a group can hold thousands of requests)."""
        texts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        tokens = np.append(self.starts, self.tokens)[texts].tolist()
        texts = texts.tolist()
        return [TokenizedTexts(self.ids[a:b].copy(), self.type_ids[a:b].copy(), self.lengths[f:t].copy(),
                               self.truncated[f:t].copy())
                for f, t, a, b in zip(texts, texts[1:], tokens, tokens[1:])]


def check_texts(texts, *, first: int = 1):
    """Refuse anything but a list of strings; `first` is the 1-based number of texts[0]."""
    if isinstance(texts, (str, bytes)):
        raise InputError("texts must be a list of strings, not one string")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InputError(f"text {first + i} is a {type(t).__name__}, not a str")


def check_pairs(pairs, *, first: int = 1):
    """Refuse anything but (text, text) pairs; `first` is the 1-based number of pairs[0]."""
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise InputError(f"pair {first + i} must be two strings, found {pair!r}"[:200])


def _single_text_types_are_zero(processor) -> bool:
    """Whether a tokenizer.json post-processor gives type id 0 to every token of a single text
    (unknown kinds: no, and the type ids are read from each encoding)."""
    if processor is None:
        return True
    kind = processor.get("type")
    if kind == "TemplateProcessing":
        return all(next(iter(piece.values())).get("type_id", 0) == 0 for piece in processor.get("single", []))
    if kind in ("BertProcessing", "RobertaProcessing", "ByteLevel"):
        return True
    if kind == "Sequence":
        return all(_single_text_types_are_zero(p) for p in processor.get("processors", []))
    return False


def _sentencepiece_whitespace(text: str) -> str:
    """tokenizer.json with white space split off before a bare Metaspace pre-tokenizer.

    Files converted from sentencepiece (XLM-R, CamemBERT, e5, bge-m3) pre-tokenise with Metaspace
    alone, so a trailing or doubled space becomes a token of its own; sentencepiece itself, and
    transformers (>= 5, what sentence-transformers tokenises with), drop such white space first."""
    data = json.loads(text)
    pre = data.get("pre_tokenizer")
    if not (isinstance(pre, dict) and pre.get("type") == "Metaspace"):
        return text
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, pre]}
    return json.dumps(data)


# a text longer than max_length x PREFIX_CHARS_PER_TOKEN characters is tokenised from a prefix
# (Tokenizer._bounded): a bound on the characters a kept token and the white space before it take,
# not a mean, so that the prefix nearly always holds the kept tokens at the first try
PREFIX_CHARS_PER_TOKEN = 32
# a prefix is also taken where its kept tokens end this many characters before the cut (a run without
# white space: no pre-tokeniser's piece reaches that far back from it)
PREFIX_MARGIN_CHARS = 1024
_WHITE_SPACE = re.compile(r"\s")


class Tokenizer:
    """`tokenizer.json` through HF `tokenizers`, or a WordPiece `vocab.txt` as a fallback."""

    def __init__(self, model_dir: Path, *, max_length: int, lowercase_text: bool = False):
        from tokenizers import Tokenizer as HFTokenizer
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if path.is_file():
            try:
                tok = HFTokenizer.from_str(_sentencepiece_whitespace(path.read_text(encoding="utf-8")))
            except Exception as e:  # tokenizers raises a bare Exception for malformed files
                raise ConfigError(f"{path}: cannot load tokenizer ({e})") from None
        elif (model_dir / "vocab.txt").is_file():
            tok = self._wordpiece(model_dir)
        else:
            raise ConfigError(f"no tokenizer.json or vocab.txt in {model_dir}")
        tok.no_padding()
        tok.enable_truncation(max_length=max_length)
        self._tok = tok
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we never use
        self._encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
        self.max_length = max_length
        self.lowercase_text = lowercase_text
        self._untruncated = None  # a copy without truncation, for token counts in errors
        self._prompt_lengths = {}  # prompt -> prompt_length(prompt)
        self._strides = {}  # stride -> a copy of the tokenizer cutting overlapping windows
        # converting ids to arrays is a third of the tokenising time: skip the type ids when the
        # post-processor gives every token of a single text type 0 (BERT's template does)
        self._zero_types = _single_text_types_are_zero(json.loads(tok.to_str()).get("post_processor"))

    @property
    def definition(self) -> dict:
        """The tokenizer as tokenizer.json holds it (parsed)."""
        return json.loads(self._tok.to_str())

    def prompt_length(self, prompt: str) -> int:
        """How many leading tokens of a text that starts with `prompt` sentence-transformers
        counts as the prompt's (include_prompt=false leaves them out of pooling): the prompt
        tokenised alone, special tokens included, less a trailing special token."""
        if prompt not in self._prompt_lengths:
            encoding = self._tok.encode(prompt.lower() if self.lowercase_text else prompt)
            special = encoding.special_tokens_mask  # 1 for the template's tokens ([SEP], </s>, ...)
            self._prompt_lengths[prompt] = len(encoding.ids) - (1 if special and special[-1] else 0)
        return self._prompt_lengths[prompt]

    def _bounded(self, text: str, limit: int) -> str:
        """A prefix of `text` whose first max_length tokens are the whole text's, so that a huge text
        costs the tokenizer (time and memory) what its kept tokens do: tokenised from `limit`
        characters on, doubled until the prefix overflows max_length with a white space after its
        last kept token (the pre-tokenisers split words there, so no later character changes a kept
        token) or PREFIX_MARGIN_CHARS characters between that token and the cut; the whole text
        where none does."""
        cut = limit
        while cut < len(text):
            encoding = self._tok.encode(text[:cut])  # truncated to max_length, with offsets into the text
            if encoding.overflowing:
                ends = [end for (_, end), special in zip(encoding.offsets, encoding.special_tokens_mask) if not special]
                last = max(ends, default=0)
                if cut - last >= PREFIX_MARGIN_CHARS or _WHITE_SPACE.search(text, last, cut - 1):
                    return text[:cut]
            cut *= 2
        return text

    def with_offsets(self, texts: list, *, add_special_tokens: bool = True) -> list:
        """Per text its tokens as (id, token text, special, (start, stop) character offsets), as
        encode would cut them (truncated to max_length, each text from a bounded prefix)."""
        encodings = self.encodings(texts, add_special_tokens=add_special_tokens)
        return [list(zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets)) for e in encodings]

    def encodings(self, texts: list, *, add_special_tokens: bool = True, stride: int = 0) -> list:
        """Per text the `tokenizers` Encoding (ids, type ids, tokens, offsets, special-token mask),
        cut as encode cuts it; stride > 0: the whole text, the windows after the first in the
        Encoding's `overflowing`, each overlapping the one before by `stride` tokens."""
        check_texts(texts)
        limit = self.max_length * PREFIX_CHARS_PER_TOKEN
        prepared = texts if stride else [self._bounded(t, limit) if len(t) > limit else t for t in texts]
        prepared = [t.lower() for t in prepared] if self.lowercase_text else prepared
        tok = self._strided(stride) if stride else self._tok
        try:
            encodings = tok.encode_batch(prepared, add_special_tokens=add_special_tokens)
        except Exception:
            for i, text in enumerate(prepared):
                unicode_text(text, f"text {i + 1}", "strict", hint="")
            raise
        return encodings

    def _strided(self, stride: int):
        """A copy of the tokenizer that truncates into windows overlapping by `stride` tokens."""
        found = self._strides.get(stride)
        if found is None:
            from tokenizers import Tokenizer as HFTokenizer
            found = HFTokenizer.from_str(self._tok.to_str())
            found.no_padding()
            try:
                found.enable_truncation(max_length=self.max_length, stride=stride)
            except Exception as e:  # tokenizers' own check of the stride against the length
                raise InputError(f"stride {stride}: {e}") from None
            self._strides[stride] = found
        return found

    def join_tokens(self, tokens: list) -> str:
        """Tokens (their text) joined as the tokenizer's decoder joins them (HF's
        convert_tokens_to_string)."""
        decoder = self._tok.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    @property
    def marks_subwords(self) -> bool:
        """Whether the model marks word continuations (WordPiece's "##"): HF's test of a
        tokenizer that knows words."""
        return bool(json.loads(self._tok.to_str())["model"].get("continuing_subword_prefix"))

    @property
    def unk_id(self) -> int | None:
        """The unknown token's id: WordPiece / BPE name it, Unigram numbers it."""
        model = json.loads(self._tok.to_str())["model"]
        if isinstance(model.get("unk_token"), str):
            return self._tok.token_to_id(model["unk_token"])
        return model.get("unk_id")

    def decode(self, sequences: list, *, skip_special_tokens: bool = True) -> list:
        """Token id sequences back to text, as the tokenizer decodes them."""
        return self._tok.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

    def special_tokens(self, *, pair: bool) -> int:
        """How many special tokens the post-processor adds to one text, or to a pair."""
        processor = self._tok.post_processor
        return 0 if processor is None else processor.num_special_tokens_to_add(pair)

    def untruncated_length(self, text: str) -> int:
        """Tokens in `text` (prepared as encode does, special tokens included) without truncation."""
        if self._untruncated is None:  # built on first use: only error messages need it
            from tokenizers import Tokenizer as HFTokenizer
            self._untruncated = HFTokenizer.from_str(self._tok.to_str())
            self._untruncated.no_truncation()
        return len(self._untruncated.encode(text.lower() if self.lowercase_text else text))

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

    def encode(self, texts: list[str], *, first: int = 1) -> TokenizedTexts:
        """Tokenise texts into flat arrays; over-long texts are cut to max_length and flagged.
        Texts are not stripped: sentence-transformers (6.x) keeps their white space, which
        byte-level BPE and sentencepiece tokenizers turn into tokens. No per-token Python object
        outlives the call. `first`: the 1-based number of texts[0], for error messages."""
        check_texts(texts, first=first)
        prepared = [t.lower() for t in texts] if self.lowercase_text else texts
        return self._arrays(self._encoded(prepared, first), zero_types=self._zero_types)

    def encode_pairs(self, pairs: list, *, first: int = 1) -> TokenizedTexts:
        """Tokenise (text, text) pairs as the model's tokenizer joins them (BERT: [CLS] a [SEP] b
        [SEP] with token types 0 and 1; RoBERTa: <s> a </s></s> b </s>); an over-long pair is
        cut longest-first to max_length, as transformers' truncation=True does."""
        check_pairs(pairs, first=first)
        prepared = [(a.lower(), b.lower()) if self.lowercase_text else (a, b) for a, b in pairs]
        return self._arrays(self._encoded(prepared, first, what="pair"), zero_types=False)

    def _encoded(self, prepared: list, first: int, *, what: str = "text") -> list:
        """encode_batch of texts or pairs, each very long text cut first to a prefix that gives its
        kept tokens (_bounded); a text that is not valid Unicode (a lone surrogate, which
        `tokenizers` refuses with a message naming no text) refused naming it."""
        limit = self.max_length * PREFIX_CHARS_PER_TOKEN
        if any(len(item) > limit if isinstance(item, str) else max(map(len, item)) > limit for item in prepared):
            prepared = [self._bounded(item, limit) if isinstance(item, str) else
                        tuple(self._bounded(text, limit) for text in item) for item in prepared]
        try:
            return self._encode_batch(prepared)
        except Exception:
            for i, item in enumerate(prepared):
                for text in (item if isinstance(item, tuple) else (item,)):
                    unicode_text(text, f"{what} {first + i}", "strict", hint="")
            raise

    def _arrays(self, encodings, *, zero_types: bool) -> TokenizedTexts:
        n = len(encodings)
        lengths = np.fromiter((len(e) for e in encodings), np.int32, n)
        total = int(lengths.sum())
        ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), np.int32, total)
        if zero_types:
            type_ids = np.zeros(total, dtype=np.int32)
        else:
            type_ids = np.fromiter(chain.from_iterable(e.type_ids for e in encodings), np.int32, total)
        truncated = np.zeros(n, dtype=bool)
        for i in np.flatnonzero(lengths >= self.max_length):  # only these can have overflowed
            truncated[i] = bool(encodings[i].overflowing)
        return TokenizedTexts(ids, type_ids, lengths, truncated)

