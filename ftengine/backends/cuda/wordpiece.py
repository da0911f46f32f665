"""Launchers of kernels_cu/wordpiece.cu: the GPU tokenizer (its tables: ftengine/wordpiece.py)."""

from __future__ import annotations

import threading
import weakref

import numpy as np

from ...wordpiece import CLASS_SHIFT, CP_MASK, DELETED, MULTI, SENSITIVE, SPACE
from .kernels import prepare
from .runtime import context, launch_held, to_device

TEXT_WARPS = 2       # warps a block
WARP_SLOTS = 32      # warps a multiprocessor is given before a warp takes more than one text
# a warp of this many texts or fewer cuts each into segments, a lane each (more: a lane a text, which
# measured faster there: bench/results/tokenizer.md)
SEGMENTED_TEXTS = 2
PACK_THREADS = 128
_uploads = weakref.WeakKeyDictionary()  # tables -> {device id: their arrays on that device}
_uploads_lock = threading.Lock()
_ARRAYS = ("char_map", "expansions", "patterns", "pattern_offsets", "prefix", "suffix")


def _on_device(tables) -> dict:
    """The tables' arrays on the current device, uploaded once."""
    device = context().cupy.cuda.Device().id
    with _uploads_lock:
        per_device = _uploads.setdefault(tables, {})
        if device not in per_device:
            per_device[device] = {name: to_device(getattr(tables, name)) for name in _ARRAYS}
            per_device[device]["trie_slots"] = to_device(_trie_slots(tables))
            per_device[device]["last_chars"] = _last_chars(tables)
            per_device[device]["splits"] = _splits_at_spaces(tables)
            context().stream.synchronize()
        return per_device[device]


def _trie_slots(tables) -> np.ndarray:
    """(S, 2) uint64: each slot's key, and its child | the child's token << 32 (one load a trie step)."""
    children = tables.trie_children
    tokens = np.where(children >= 0, tables.node_token[np.maximum(children, 0)], -1)
    value = children.astype(np.uint32).astype(np.uint64) | tokens.astype(np.uint32).astype(np.uint64) << np.uint64(32)
    return np.stack([tables.trie_keys, value], axis=1)


def _last_chars(tables) -> np.uint32:
    """Bit c % 32 set for the last character c of each added token: the kernel looks for one only there."""
    lasts = tables.patterns[tables.pattern_offsets[1:] - 1].astype(np.uint32) & np.uint32(31)
    return np.bitwise_or.reduce(np.uint32(1) << lasts, initial=np.uint32(0)).astype(np.uint32)


def text_lanes(n: int) -> int:
    """Texts a warp takes for a call of n: as few as give every multiprocessor WARP_SLOTS warps."""
    return max(1, min(32, -(-n // (WARP_SLOTS * context().sm_count))))


def warp_layout(n: int, splits: bool) -> tuple[int, int]:
    """(texts a warp, lanes a text) for a call of n: where a warp takes SEGMENTED_TEXTS texts or
    fewer and `splits`, each text's lanes walk segments of it side by side; else a lane a text."""
    texts = text_lanes(n)
    if not splits or texts > SEGMENTED_TEXTS:
        return texts, 1
    return texts, 32 // texts


def _splits_at_spaces(tables) -> bool:
    """Whether a text may be cut after its spaces: the normaliser keeps a space one separator that
    no added token's text holds, so that no word and no added token spans the cut."""
    entry = int(tables.char_map[0x20])
    if entry & (SENSITIVE | DELETED | MULTI) or (entry >> CLASS_SHIFT) & 3 != SPACE:
        return False
    return not np.any(tables.patterns == (entry & CP_MASK))


def prepare_wordpiece():
    """Compile (or load from the cache) wordpiece.cu's module ahead of the first call."""
    prepare(("wordpiece.cu",), ())


def wordpiece_tokenize(tables, text, starts, stops, cut, ids, lengths, flags):
    """As backends/reference/wordpiece.py: texts text[starts[i]:stops[i]] (uint8; int64 bounds;
    cut uint8) -> ids (N, max_length) int32, lengths (N,) int32, flags (N,) uint8."""
    n = len(starts)
    if n == 0:
        return
    d = _on_device(tables)
    texts, seg = warp_layout(n, d["splits"])
    launch_held("wordpiece.cu", "wordpiece_tokenize", (-(-n // (texts * TEXT_WARPS)),), (32 * TEXT_WARPS,),
                (text, starts, stops, cut, np.int32(n), d["char_map"], d["expansions"], d["trie_slots"],
                 np.uint64(len(tables.trie_keys) - 1), d["patterns"],
                 d["pattern_offsets"], np.int32(len(tables.pattern_offsets) - 1), d["last_chars"],
                 d["prefix"], np.int32(len(tables.prefix)),
                 d["suffix"], np.int32(len(tables.suffix)), np.int32(tables.unk), np.int32(tables.max_word),
                 np.int32(tables.max_length), np.int32(tables.tail), np.int32(texts), np.int32(seg), ids, lengths, flags))


def pack_rows(ids, lengths, offsets, out):
    """out[offsets[i] : offsets[i] + lengths[i]] = ids[i, :lengths[i]] (offsets int64)."""
    n = len(lengths)
    if n == 0:
        return
    launch_held("wordpiece.cu", "pack_rows", (n,), (PACK_THREADS,),
                (ids, np.int32(ids.shape[1]), lengths, offsets, np.int32(n), out))
