"""Launchers of kernels_cu/wordpiece.cu: the GPU tokenizer (its tables: ftengine/wordpiece.py)."""

from __future__ import annotations

import threading
import weakref

import numpy as np

from .kernels import prepare
from .runtime import _launch, context, to_device

TEXT_THREADS = 32    # texts (threads) a block: small, so that a group of texts spreads over every SM
PACK_THREADS = 128
_uploads = weakref.WeakKeyDictionary()  # tables -> {device id: their arrays on that device}
_uploads_lock = threading.Lock()
_ARRAYS = ("char_map", "expansions", "trie_keys", "trie_children", "node_token", "patterns", "pattern_offsets",
           "prefix", "suffix")


def _on_device(tables) -> dict:
    """The tables' arrays on the current device, uploaded once."""
    device = context().cupy.cuda.Device().id
    with _uploads_lock:
        per_device = _uploads.setdefault(tables, {})
        if device not in per_device:
            per_device[device] = {name: to_device(getattr(tables, name)) for name in _ARRAYS}
            context().stream.synchronize()
        return per_device[device]


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
    _launch("wordpiece.cu", "wordpiece_tokenize", (-(-n // TEXT_THREADS),), (TEXT_THREADS,),
            (text, starts, stops, cut, np.int32(n), d["char_map"], d["expansions"], d["trie_keys"],
             d["trie_children"], np.uint64(len(tables.trie_keys) - 1), d["node_token"], d["patterns"],
             d["pattern_offsets"], np.int32(len(tables.pattern_offsets) - 1), d["prefix"], np.int32(len(tables.prefix)),
             d["suffix"], np.int32(len(tables.suffix)), np.int32(tables.unk), np.int32(tables.max_word),
             np.int32(tables.max_length), np.int32(tables.tail), ids, lengths, flags))


def pack_rows(ids, lengths, offsets, out):
    """out[offsets[i] : offsets[i] + lengths[i]] = ids[i, :lengths[i]] (offsets int64)."""
    n = len(lengths)
    if n == 0:
        return
    _launch("wordpiece.cu", "pack_rows", (n,), (PACK_THREADS,),
            (ids, np.int32(ids.shape[1]), lengths, offsets, np.int32(n), out))
