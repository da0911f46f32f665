"""A WordPiece `tokenizer.json` compiled into the tables the GPU tokenizer (kernels_cu/wordpiece.cu)
and its NumPy twin (backends/reference/wordpiece.py) read.

What is covered: the BertNormalizer (every flag), the BertPreTokenizer, the WordPiece model, and a
TemplateProcessing / BertProcessing / RobertaProcessing post-processor that gives a single text
type id 0 (BERT, DistilBERT, MPNet, the MiniLM / bge / e5 / gte families); anything else stays on
the CPU path (`unsupported` says why).

The normaliser acts on each code point alone, so it becomes a table: each code point's normalised
expansion (nothing, one code point, or a few), each expanded code point tagged with the
pre-tokeniser's class (word, white space, punctuation). The table is measured from the installed
`tokenizers` (every code point through its normaliser and its pre-tokeniser), so that the two agree
whatever Unicode version each was built with, and kept on disk per `tokenizers` version and
normaliser. The one effect that is not per code point, NFD's reordering of combining marks (when
accents are stripped), can only matter for a mark that survives the stripping: such code points
are tagged SENSITIVE, and a text holding one is tokenised on the CPU. So is a text in which an added
token's normalised form appears (`tokenizers` splits the text there first).

The vocabulary is a trie of code points (root 0: a word's first piece; root 1: continuing pieces,
their prefix removed) stored as a hash table of (node, code point) -> child, so that the longest
match is one probe per character; kept on disk per vocabulary (building it is a third of a second of
Python, which would hold the GIL while a process starts).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import say_once

CODE_POINTS = 0x110000
CP_MASK = (1 << 21) - 1
CLASS_SHIFT = 21                    # 2 bits: the pre-tokeniser's class of the (single) result
WORD, SPACE, PUNCT = 0, 1, 2
MULTI = 1 << 23                     # the low 21 bits are an offset into `expansions`
LEN_SHIFT = 24                      # 5 bits: the expansion's length (MULTI)
SENSITIVE = 1 << 29                 # a text holding this code point goes to the CPU path
DELETED = 1 << 30                   # the normaliser removes the code point
MAX_WORD = 128                      # the kernel's word buffer: max_input_chars_per_word at most this
MAX_PATTERN = 32                    # the kernel's ring of recent characters: added tokens at most this long
TRUNCATED, ON_CPU = 1, 2           # a text's flags: cut to max_length; the CPU path must tokenise it
EMPTY_KEY = np.uint64(0xFFFFFFFFFFFFFFFF)
FORMAT = 1


@dataclass(frozen=True, eq=False)
class WordPieceTables:
    """Everything the kernel reads, as host arrays (the CUDA launcher uploads them once)."""
    char_map: np.ndarray        # (0x110000,) uint32: code point -> class | code point, or MULTI | length | offset
    expansions: np.ndarray      # (E,) uint32: class | code point of each multi-character expansion
    trie_keys: np.ndarray       # (S,) uint64: node << 21 | code point, EMPTY_KEY for a free slot; S a power of 2
    trie_children: np.ndarray   # (S,) int32: the child node of each key
    node_token: np.ndarray      # (nodes,) int32: the token id a node spells, -1 if none
    patterns: np.ndarray        # (P,) int32: the added tokens' normalised code points, one after the other
    pattern_offsets: np.ndarray  # (added + 1,) int32
    prefix: np.ndarray          # (a,) int32: the post-processor's ids before a text
    suffix: np.ndarray          # (b,) int32: and after it
    unk: int                    # the unknown token's id
    max_word: int               # max_input_chars_per_word
    max_length: int             # ids per text at most, special tokens included

    @property
    def tail(self) -> int:
        """Characters checked after the one that truncates a text: an added token that begins at or
        before it ends within them."""
        return max(0, int(np.diff(self.pattern_offsets).max(initial=0)) - 1)

    @property
    def capacity(self) -> int:
        """A text's own tokens before it counts as truncated."""
        return self.max_length - len(self.prefix) - len(self.suffix)


def unsupported(data: dict) -> str | None:
    """Why a parsed tokenizer.json cannot go through the GPU tokenizer (None: it can)."""
    normalizer, pre, model = data.get("normalizer"), data.get("pre_tokenizer"), data.get("model") or {}
    if not isinstance(normalizer, dict) or normalizer.get("type") != "BertNormalizer":
        return f"its normalizer is {_kind(normalizer)}, not BertNormalizer"
    if not isinstance(pre, dict) or pre.get("type") != "BertPreTokenizer":
        return f"its pre-tokenizer is {_kind(pre)}, not BertPreTokenizer"
    if model.get("type") != "WordPiece":
        return f"its model is {model.get('type')!r}, not WordPiece"
    if model.get("unk_token") not in (model.get("vocab") or {}):
        return "its unknown token is not in its vocabulary"
    if not 1 <= int(model.get("max_input_chars_per_word", 100)) <= MAX_WORD:
        return f"its max_input_chars_per_word is over {MAX_WORD}"
    if not model.get("continuing_subword_prefix"):
        return "it has no continuing_subword_prefix"
    try:
        _specials(data.get("post_processor"))
    except ValueError as e:
        return str(e)
    return None


def _kind(part) -> str:
    return repr(part.get("type")) if isinstance(part, dict) else "none"


def _template(processor, key: str) -> tuple[list, list]:
    """A TemplateProcessing template (key "single" or "pair") as (the runs of special tokens around
    its texts, each a list of (id, type id): one run more than texts; its texts' (id, type id))."""
    runs, texts = [[]], []
    for piece in processor.get(key, []):
        (what, spec), = piece.items()
        if what == "Sequence":
            texts.append((spec.get("id"), spec.get("type_id", 0)))
            runs.append([])
        else:
            runs[-1].extend((int(i), spec.get("type_id", 0)) for i in processor["special_tokens"][spec["id"]]["ids"])
    return runs, texts


def _specials(processor) -> tuple[list, list]:
    """The ids the post-processor puts before and after a single text."""
    if processor is None:
        return [], []
    kind = processor.get("type")
    if kind in ("BertProcessing", "RobertaProcessing"):
        return [int(processor["cls"][1])], [int(processor["sep"][1])]
    if kind != "TemplateProcessing":
        raise ValueError(f"its post-processor is {kind!r}")
    runs, texts = _template(processor, "single")
    if any(t != 0 for _, t in texts + [p for run in runs for p in run]):
        raise ValueError("its template gives a single text a type id other than 0")
    if not texts:
        raise ValueError("its template has no text")
    if [name for name, _ in texts] != ["A"]:
        raise ValueError("its template is not one text between special tokens")
    return [i for i, _ in runs[0]], [i for i, _ in runs[1]]


@dataclass(frozen=True)
class PairLayout:
    """How the post-processor joins a pair of texts: (id, type id) of its tokens before the first
    text, between the two and after the second, and each text's type id."""
    before: tuple
    between: tuple
    after: tuple
    first_type: int
    second_type: int

    @property
    def specials(self) -> int:
        return len(self.before) + len(self.between) + len(self.after)


def pair_layout(processor) -> PairLayout:
    """The layout of a pair under a tokenizer.json post-processor (ValueError where it is not special
    tokens, the first text, special tokens, the second text, special tokens)."""
    kind = processor.get("type") if isinstance(processor, dict) else None
    if kind == "BertProcessing":
        cls, sep = int(processor["cls"][1]), int(processor["sep"][1])
        return PairLayout(((cls, 0),), ((sep, 0),), ((sep, 1),), 0, 1)
    if kind == "RobertaProcessing":  # tokenizers gives every token of the pair type id 0
        cls, sep = int(processor["cls"][1]), int(processor["sep"][1])
        return PairLayout(((cls, 0),), ((sep, 0), (sep, 0)), ((sep, 0),), 0, 0)
    if kind != "TemplateProcessing":
        raise ValueError(f"its post-processor is {kind!r}")
    runs, texts = _template(processor, "pair")
    if [name for name, _ in texts] != ["A", "B"]:
        raise ValueError("its pair template is not the first text, then the second, between special tokens")
    runs = [tuple((i, int(t)) for i, t in run) for run in runs]
    return PairLayout(*runs, int(texts[0][1]), int(texts[1][1]))


def build_tables(data: dict, *, max_length: int) -> WordPieceTables:
    """The tables of a parsed tokenizer.json that `unsupported` accepts."""
    cfg = data["normalizer"]
    char_map, expansions = unicode_tables(cfg)
    model = data["model"]
    vocab = model["vocab"]
    keys, children, node_token = trie(vocab, model["continuing_subword_prefix"])
    contents = [t["content"] for t in data.get("added_tokens", [])]
    normalised = [normalize(char_map, expansions, c) for c in contents]
    for content, cps in zip(contents, normalised):
        if not 1 <= len(cps) <= MAX_PATTERN:
            raise ValueError(f"added token {content!r} normalises to {len(cps)} characters (1..{MAX_PATTERN} covered)")
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in normalised], dtype=np.int64)]).astype(np.int32)
    patterns = np.array([c for cps in normalised for c in cps], dtype=np.int32)
    before, after = _specials(data.get("post_processor"))
    if len(before) + len(after) > max_length:
        raise ValueError(f"max_length {max_length} leaves no room for the {len(before) + len(after)} special tokens")
    return WordPieceTables(char_map, expansions, keys, children, node_token, patterns, offsets,
                           np.array(before, np.int32), np.array(after, np.int32), int(vocab[model["unk_token"]]),
                           int(model.get("max_input_chars_per_word", 100)), int(max_length))


def normalize(char_map: np.ndarray, expansions: np.ndarray, text: str) -> list[int]:
    """`text` through the table: its normalised code points (the tables' own normaliser)."""
    out = []
    for ch in text:
        entry = int(char_map[ord(ch)])
        if entry & DELETED:
            continue
        if entry & MULTI:
            at = entry & CP_MASK
            out.extend(int(e) & CP_MASK for e in expansions[at:at + ((entry >> LEN_SHIFT) & 31)])
        else:
            out.append(entry & CP_MASK)
    return out


# ------------------------------------------------------------ Unicode tables


def _normalizer(cfg: dict):
    from tokenizers.normalizers import BertNormalizer
    return BertNormalizer(clean_text=bool(cfg.get("clean_text", True)),
                          handle_chinese_chars=bool(cfg.get("handle_chinese_chars", True)),
                          strip_accents=cfg.get("strip_accents"), lowercase=bool(cfg.get("lowercase", True)))


def cache_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ftengine"


def unicode_tables(cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """(char_map, expansions) for a BertNormalizer config: from the disk cache, or measured in a
    child process (a few seconds of Python that would otherwise hold this process's GIL while the
    kernels compile) and kept there; in this process where no child can run."""
    import tokenizers
    flags = [bool(cfg.get("clean_text", True)), bool(cfg.get("handle_chinese_chars", True)),
             cfg.get("strip_accents"), bool(cfg.get("lowercase", True))]
    key = json.dumps([FORMAT, tokenizers.__version__, flags])
    path = cache_folder() / f"wordpiece_{hashlib.sha256(key.encode()).hexdigest()[:24]}.npz"
    found = _load(path, UNICODE_ARRAYS)
    if found is not None:
        return found
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = path.parent
    except OSError as e:
        say_once(f"ftengine: cannot keep the GPU tokenizer's Unicode tables in {path.parent} ({e}); "
                 "each process measures them again")
        folder = Path(tempfile.mkdtemp(prefix="ftengine-wordpiece-"))
        path = folder / path.name
    child = subprocess.run([sys.executable, "-m", "ftengine.wordpiece", json.dumps(cfg), str(path)],
                           capture_output=True, text=True)
    found = _load(path, UNICODE_ARRAYS) if child.returncode == 0 else None
    return found if found is not None else _save(path, UNICODE_ARRAYS, measure_unicode_tables(cfg))


UNICODE_ARRAYS, TRIE_ARRAYS = ("char_map", "expansions"), ("keys", "children", "node_token")


def _load(path: Path, names: tuple):
    """The arrays `names` of a file _save wrote, or None."""
    try:
        with np.load(path) as saved:
            return tuple(saved[name] for name in names)
    except (OSError, ValueError, KeyError):
        return None


def _save(path: Path, names: tuple, arrays: tuple, compress: bool = True):
    """Write the arrays under `names` (a temporary file renamed over `path`: a reader never sees half
    of one); a folder that cannot be written keeps nothing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npz", delete=False) as f:
            (np.savez_compressed if compress else np.savez)(f, **dict(zip(names, arrays)))
        os.replace(f.name, path)
    except OSError:
        pass
    return arrays


def _scalars() -> np.ndarray:
    cps = np.arange(CODE_POINTS, dtype=np.int64)
    return cps[(cps < 0xD800) | (cps > 0xDFFF)]


def measure_unicode_tables(cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """Every Unicode scalar value through the installed `tokenizers`: its normaliser (each code
    point alone) and its BertPreTokenizer (the class of each code point between two letters)."""
    normalizer = _normalizer(cfg)
    scalars = _scalars()
    results = [normalizer.normalize_str(chr(c)) for c in scalars.tolist()]
    sizes = np.fromiter(map(len, results), dtype=np.int64, count=len(results))
    classes = pre_token_classes().astype(np.uint32) << CLASS_SHIFT
    char_map = np.full(CODE_POINTS, DELETED, dtype=np.uint32)  # surrogates: never decoded from valid UTF-8
    single = np.flatnonzero(sizes == 1)
    codes = np.fromiter((ord(results[i]) for i in single.tolist()), dtype=np.uint32, count=len(single))
    char_map[scalars[single]] = classes[codes] | codes
    blob = []
    for i in np.flatnonzero(sizes > 1).tolist():
        if sizes[i] > 31:
            raise ValueError(f"U+{int(scalars[i]):04X} normalises to {sizes[i]} characters")
        char_map[scalars[i]] = MULTI | int(sizes[i]) << LEN_SHIFT | len(blob)
        blob.extend(int(classes[ord(ch)]) | ord(ch) for ch in results[i])
    strip = cfg.get("strip_accents")
    if bool(cfg.get("lowercase", True)) if strip is None else bool(strip):
        kept = scalars[sizes > 0]
        char_map[_reordered(normalizer, kept, [results[i] for i in np.flatnonzero(sizes > 0).tolist()])] |= SENSITIVE
    return char_map, np.array(blob, dtype=np.uint32)


# two marks that survive accent stripping, in the reverse of their canonical order (classes 226, 216)
_MARK_HIGH, _MARK_LOW = "\U0001D16D", "\U0001D165"


def _reordered(normalizer, kept: np.ndarray, results: list) -> np.ndarray:
    """The code points among `kept` whose normal forms hold a mark that NFD reorders: each normal
    form between two marks that are out of canonical order ("x" high form low), all in one call; the
    result differs from the forms joined exactly where the form has a combining class other than 0."""
    chunks = ["x" + _MARK_HIGH + r + _MARK_LOW for r in results]
    expected = np.frombuffer("".join(chunks).encode("utf-32-le"), dtype=np.uint32)
    found = np.frombuffer(normalizer.normalize_str("".join("x" + _MARK_HIGH + chr(c) + _MARK_LOW
                                                           for c in kept.tolist())).encode("utf-32-le"),
                          dtype=np.uint32)
    if len(found) != len(expected):
        raise ValueError("the normaliser does not act on each character alone")
    ends = np.cumsum(np.fromiter(map(len, chunks), dtype=np.int64, count=len(chunks)))
    differ = np.flatnonzero(found != expected)
    return kept[np.unique(np.searchsorted(ends, differ, side="right"))]


def pre_token_classes() -> np.ndarray:
    """(0x110000,) uint8: WORD, SPACE or PUNCT for each code point, as BertPreTokenizer splits it:
    every scalar value between letters ("a" c "a" ...) in one call; a punctuation mark is a piece of
    its own, white space is in no piece, a word character joins the letters' piece."""
    from tokenizers.pre_tokenizers import BertPreTokenizer
    scalars = _scalars()
    text = "a" + "a".join(map(chr, scalars.tolist())) + "a"
    classes = np.full(CODE_POINTS, WORD, dtype=np.uint8)
    covered = np.zeros(len(text), dtype=bool)
    alone = np.zeros(len(text), dtype=bool)
    for _, (start, stop) in BertPreTokenizer().pre_tokenize_str(text):
        covered[start:stop] = True
        if stop - start == 1:
            alone[start] = True
    at = 2 * np.arange(len(scalars)) + 1  # where each scalar value sits in `text`
    classes[scalars[~covered[at]]] = SPACE
    classes[scalars[alone[at]]] = PUNCT
    return classes


# ------------------------------------------------------------ the vocabulary trie


def mix(keys: np.ndarray) -> np.ndarray:
    """The hash of uint64 keys (splitmix64's finaliser; the kernel's `mix`)."""
    z = keys.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def trie(vocab: dict, prefix: str):
    """_trie's tables of this vocabulary, from the disk cache (keyed by the vocabulary and prefix)
    or built and kept there."""
    key = hashlib.sha256(json.dumps([FORMAT, prefix, vocab]).encode()).hexdigest()[:24]
    path = cache_folder() / f"wordpiece_trie_{key}.npz"
    found = _load(path, TRIE_ARRAYS)
    return found if found is not None else _save(path, TRIE_ARRAYS, _trie(vocab, prefix), compress=False)


def _trie(vocab: dict, prefix: str):
    """(keys, children, node_token): root 0 spells every token, root 1 the tokens after `prefix`."""
    edges = {}          # (node, code point) -> child
    node_token = [-1, -1]
    for token, token_id in vocab.items():
        for root, text in ((0, token), (1, token[len(prefix):] if token.startswith(prefix) else "")):
            if not text:
                continue
            node = root
            for ch in text:
                child = edges.get((node, ord(ch)))
                if child is None:
                    child = edges[(node, ord(ch))] = len(node_token)
                    node_token.append(-1)
                node = child
            node_token[node] = int(token_id)
    pairs = np.array(list(edges), dtype=np.uint64).reshape(-1, 2)
    keys = pairs[:, 0] << np.uint64(21) | pairs[:, 1]
    children = np.fromiter(edges.values(), dtype=np.int32, count=len(edges))
    size = 1 << max(4, int(2 * max(len(keys), 1) - 1).bit_length())  # at most half full
    table_keys = np.full(size, EMPTY_KEY, dtype=np.uint64)
    table_children = np.full(size, -1, dtype=np.int32)
    slots = (mix(keys) & np.uint64(size - 1)).astype(np.int64)
    pending = np.arange(len(keys))
    while pending.size:  # linear probing, all keys at once: one winner per free slot a round
        free = table_keys[slots[pending]] == EMPTY_KEY
        candidates = pending[free]
        _, first = np.unique(slots[candidates], return_index=True)
        won = candidates[first]
        table_keys[slots[won]] = keys[won]
        table_children[slots[won]] = children[won]
        placed = np.zeros(len(keys), dtype=bool)
        placed[won] = True
        pending = pending[~placed[pending]]
        moved = pending[table_keys[slots[pending]] != EMPTY_KEY]
        slots[moved] = (slots[moved] + 1) & (size - 1)
    return table_keys, table_children, np.array(node_token, dtype=np.int32)


if __name__ == "__main__":  # the child unicode_tables runs: python -m ftengine.wordpiece CONFIG_JSON PATH
    _save(Path(sys.argv[2]), UNICODE_ARRAYS, measure_unicode_tables(json.loads(sys.argv[1])))
