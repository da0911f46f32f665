"""The GPU tokenizer's twin: kernels_cu/wordpiece.cu's results, computed for all texts at once in NumPy.

The kernel walks each text alone (one thread a text); this twin takes every text's characters, then
every word, in lock-step through the same tables (ftengine/wordpiece.py), and gives the same ids,
lengths and flags.
"""

from __future__ import annotations

import numpy as np

from ...wordpiece import (CLASS_SHIFT, CP_MASK, DELETED, LEN_SHIFT, MULTI, ON_CPU, PUNCT, SENSITIVE, SPACE,
                          TRUNCATED, WORD, WordPieceTables, mix)

_SEPARATOR = 0xD800  # between texts when searching for added tokens: never a normalised character


def prepare_wordpiece():
    """Nothing to compile (the CUDA backend compiles its kernels here)."""


def wordpiece_tokenize(tables: WordPieceTables, text, starts, stops, cut, ids, lengths, flags):
    """Texts text[starts[i]:stops[i]] (UTF-8; cut[i]: the text goes on past stops[i]) ->
    ids (N, max_length) int32 (row i's first lengths[i] entries: the post-processor's tokens around
    the text's first `capacity` pieces), lengths (N,) int32, flags (N,) uint8: TRUNCATED when the
    text has more pieces than fit, ON_CPU (and length 0) when the CPU path must tokenise it: not
    valid UTF-8, a SENSITIVE character, an added token's normal form, or a cut text that ends
    before max_length is reached. The checks but UTF-8's look no further than `tables.tail`
    normalised characters past the one at which the text is truncated (the kernel stops there)."""
    n = len(starts)
    lengths[:] = 0
    flags[:] = 0
    chars, char_text, invalid = _decode(np.asarray(text, dtype=np.uint8).tobytes(), starts, stops)
    entries = tables.char_map[chars]
    values, value_text, owner, counts = _expand(tables, entries, char_text)

    word_text, word_start, word_len, word_chars, word_last, word_punct = _words(values, value_text)
    # the word a cut (or invalid) text ends in is never finished: the kernel stops before its end
    unfinished = cut.astype(bool) | invalid
    pending = np.zeros(len(word_text), dtype=bool)
    if len(word_text):
        last = np.flatnonzero(np.r_[word_text[1:] != word_text[:-1], True])
        text_end = np.zeros(n, dtype=np.int64)
        text_end[value_text] = np.arange(len(values))  # each text's last normalised character
        pending[last] = unfinished[word_text[last]] & ~word_punct[last] & (word_last[last] == text_end[word_text[last]])
    piece_word, piece_id = _wordpiece(tables, word_chars, word_start, word_len, ~pending)

    piece_text = word_text[piece_word]
    pieces = np.bincount(piece_text, minlength=n)
    truncated = pieces > tables.capacity
    first_value = np.zeros(n, dtype=np.int64)  # each text's first normalised character
    first_value[value_text[::-1]] = np.arange(len(values))[::-1]
    # where the kernel stops checking: `tail` characters after the one that truncated the text (the
    # character after its overflowing word, or that word itself when it is a punctuation mark)
    limit = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    overflow = piece_word[(np.arange(len(piece_word)) - (np.cumsum(pieces) - pieces)[piece_text]) == tables.capacity]
    rows = word_text[overflow]
    limit[rows] = word_last[overflow] - first_value[rows] + np.where(word_punct[overflow], 1, 2) + tables.tail
    seen_before = np.cumsum(counts) - counts - np.r_[0, np.cumsum(counts)][_first_char(char_text, n)][char_text]
    checked = seen_before < limit[char_text]     # the characters the kernel reaches
    flags[np.unique(char_text[((entries & SENSITIVE) != 0) & checked])] |= ON_CPU
    flags[_added_tokens(tables, values & CP_MASK, value_text, checked[owner])] |= ON_CPU
    flags[invalid] |= ON_CPU

    flags[truncated] |= TRUNCATED
    flags[(cut.astype(bool) & ~truncated)] |= ON_CPU
    flags[(flags & ON_CPU) != 0] = ON_CPU
    rank = np.arange(len(piece_text)) - (np.cumsum(pieces) - pieces)[piece_text]
    keep = (rank < tables.capacity) & ((flags[piece_text] & ON_CPU) == 0)
    body = np.minimum(pieces, tables.capacity)
    a, b = len(tables.prefix), len(tables.suffix)
    rows = np.flatnonzero(flags != ON_CPU)
    ids[np.ix_(rows, np.arange(a))] = tables.prefix
    ids[piece_text[keep], a + rank[keep]] = piece_id[keep]
    for j in range(b):
        ids[rows, a + body[rows] + j] = tables.suffix[j]
    lengths[rows] = a + body[rows] + b


def _first_char(char_text, n: int) -> np.ndarray:
    """(N,) the index of each text's first character (the next text's for a text with none)."""
    return np.searchsorted(char_text, np.arange(n))


def _decode(raw: bytes, starts, stops):
    """(code points, their text index, invalid): each text's characters, up to its first byte that
    is not valid UTF-8 (invalid[i]: there is one)."""
    parts = []
    invalid = np.zeros(len(starts), dtype=bool)
    for i, (a, b) in enumerate(zip(starts.tolist(), stops.tolist())):
        try:
            parts.append(raw[a:b].decode("utf-8"))
        except UnicodeDecodeError as e:
            invalid[i] = True
            parts.append(raw[a:a + e.start].decode("utf-8"))
    chars = np.frombuffer("".join(parts).encode("utf-32-le"), dtype=np.uint32)
    sizes = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
    return chars, np.repeat(np.arange(len(parts)), sizes), invalid


def _expand(tables: WordPieceTables, entries, char_text):
    """Each character's normal form: (class | code point of each, their text index, the character
    each comes from, each character's count)."""
    counts = np.where((entries & DELETED) != 0, 0,
                      np.where((entries & MULTI) != 0, (entries >> LEN_SHIFT) & 31, 1)).astype(np.int64)
    owner = np.repeat(np.arange(len(entries)), counts)
    k = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    mine = entries[owner]
    multi = (mine & MULTI) != 0
    values = mine & ((3 << CLASS_SHIFT) | CP_MASK)
    values[multi] = tables.expansions[(mine[multi] & CP_MASK) + k[multi]]
    return values.astype(np.uint32), char_text[owner], owner, counts


def _added_tokens(tables: WordPieceTables, cps, value_text, checked) -> np.ndarray:
    """The texts whose normalised characters hold an added token's normal form, ending at a
    character the kernel checks."""
    found = []
    if len(tables.pattern_offsets) > 1 and len(cps):
        cuts = np.flatnonzero(np.r_[True, value_text[1:] != value_text[:-1]])
        joined = np.insert(cps.astype(np.uint32), cuts, _SEPARATOR)
        # where each joined position comes from: its normalised character, -1 for a separator
        source = np.insert(np.arange(len(cps)), cuts, -1)
        haystack = joined.tobytes().decode("utf-32-le", "surrogatepass")
        for a, b in zip(tables.pattern_offsets[:-1].tolist(), tables.pattern_offsets[1:].tolist()):
            needle = "".join(map(chr, tables.patterns[a:b].tolist()))
            at = haystack.find(needle)
            while at >= 0:
                end = source[at + len(needle) - 1]
                if checked[end]:
                    found.append(value_text[end])
                at = haystack.find(needle, at + 1)
    return np.array(found, dtype=np.int64)


def _words(values, value_text):
    """The pre-tokeniser's words: runs of word characters, each punctuation mark alone, white space
    dropped. (word's text, first kept character, length, kept code points, the word's last
    character among `values`, whether it is a punctuation mark)."""
    cls = (values >> CLASS_SHIFT) & 3
    kept = cls != SPACE
    new_text = np.r_[True, value_text[1:] != value_text[:-1]]
    prev_breaks = np.r_[True, cls[:-1] != WORD]
    begins = kept & (new_text | prev_breaks | (cls == PUNCT))
    chars = (values & CP_MASK)[kept].astype(np.int64)
    word_start = np.flatnonzero(begins[kept])
    word_len = np.diff(np.r_[word_start, len(chars)])
    kept_at = np.flatnonzero(kept)
    word_last = kept_at[word_start + word_len - 1] if len(word_start) else np.zeros(0, np.int64)
    return (value_text[begins], word_start, word_len, chars, word_last, cls[begins] == PUNCT)


def _lookup(tables: WordPieceTables, nodes, chars):
    """Child of each (node, code point) in the trie, -1 where there is none."""
    keys = (nodes.astype(np.uint64) << np.uint64(21)) | chars.astype(np.uint64)
    size = len(tables.trie_keys)
    slots = (mix(keys) & np.uint64(size - 1)).astype(np.int64)
    child = np.full(len(keys), -1, dtype=np.int64)
    todo = np.arange(len(keys))
    while todo.size:
        found = tables.trie_keys[slots[todo]]
        hit = found == keys[todo]
        child[todo[hit]] = tables.trie_children[slots[todo[hit]]]
        todo = todo[~hit & (found != np.uint64(0xFFFFFFFFFFFFFFFF))]
        slots[todo] = (slots[todo] + 1) & (size - 1)
    return child


def _wordpiece(tables: WordPieceTables, chars, word_start, word_len, wanted):
    """WordPiece's longest-match-first pieces of every wanted word, in order: (word, id) arrays. A
    word longer than max_word, or with a part no piece matches, is the unknown token alone."""
    words = np.flatnonzero(wanted)
    unknown = np.zeros(len(word_start), dtype=bool)
    unknown[words[word_len[words] > tables.max_word]] = True
    active = words[~unknown[words]]
    offset = np.zeros(len(word_start), dtype=np.int64)
    piece_words, piece_ids = [], []
    while active.size:
        node = np.where(offset[active] == 0, 0, 1)
        at = offset[active].copy()
        best_end = np.full(active.size, -1, dtype=np.int64)
        best_id = np.full(active.size, -1, dtype=np.int64)
        walking = np.arange(active.size)
        while walking.size:
            w = active[walking]
            child = _lookup(tables, node[walking], chars[word_start[w] + at[walking]])
            ok = child >= 0
            walking, child = walking[ok], child[ok]
            node[walking] = child
            at[walking] += 1
            token = tables.node_token[child]
            hit = token >= 0
            best_end[walking[hit]] = at[walking[hit]]
            best_id[walking[hit]] = token[hit]
            walking = walking[at[walking] < word_len[active[walking]]]
        failed = best_end < 0
        unknown[active[failed]] = True
        matched = active[~failed]
        piece_words.append(matched)
        piece_ids.append(best_id[~failed])
        offset[matched] = best_end[~failed]
        active = matched[offset[matched] < word_len[matched]]
    piece_word = np.concatenate(piece_words + [np.zeros(0, np.int64)])
    piece_id = np.concatenate(piece_ids + [np.zeros(0, np.int64)])
    known = ~unknown[piece_word]
    unk_words = np.flatnonzero(unknown)
    piece_word = np.concatenate([piece_word[known], unk_words])
    piece_id = np.concatenate([piece_id[known], np.full(len(unk_words), tables.unk)])
    order = np.argsort(piece_word, kind="stable")
    return piece_word[order], piece_id[order].astype(np.int32)


def pack_rows(ids, lengths, offsets, out):
    """out[offsets[i] : offsets[i] + lengths[i]] = ids[i, :lengths[i]]."""
    lengths = np.asarray(lengths, dtype=np.int64)
    row = np.repeat(np.arange(len(lengths)), lengths)
    col = np.arange(row.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[np.repeat(np.asarray(offsets, dtype=np.int64), lengths) + col] = ids[row, col]
