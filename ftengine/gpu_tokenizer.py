"""The GPU tokenizer: Tokenizer.encode for WordPiece models, its ids computed on the device.

The texts' UTF-8 bytes go to the device in one copy; kernels_cu/wordpiece.cu gives every text's ids
(the tables: wordpiece.py) and packs them; the ids, lengths and truncation flags come back as the
TokenizedTexts the engine batches. A text the kernel hands back (a character whose normal form
depends on its neighbours, an added token's text, ...) is tokenised by the CPU tokenizer, so the
result is always `tokenizers`' own. Runs on the backend's ops: the CUDA kernels, or their NumPy twin.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from .errors import DeviceError, InputError, say_once
from .textio import RawTexts
from .tokenizer import PREFIX_CHARS_PER_TOKEN, TokenizedTexts, Tokenizer, check_pairs, check_texts
from .wordpiece import ON_CPU, TRUNCATED, PairLayout, build_tables, pair_layout, unsupported

TOKENIZER_CHOICES = ("auto", "gpu", "cpu")
# tokenizer="auto" tokenises calls of fewer texts (or pairs) on the CPU: the device's fixed cost a call
# outweighs its speed there, above all with several threads calling (bench/results/tokenizer_calls.md)
AUTO_MIN_TEXTS = 128
# a text of more bytes than max_length x this goes to the device cut (at a character): no kept piece
# lies past the cut unless the text is mostly white space, and then the CPU tokenises it
CUT_BYTES_PER_TOKEN = 4 * PREFIX_CHARS_PER_TOKEN
def choose_tokenizer(cpu: Tokenizer, choice: str, *, ops, device: str):
    """The tokenizer an encoder runs: the GPU one (`choice` gpu, or auto where it covers the
    model's tokenizer on the CUDA backend, handing calls of fewer than AUTO_MIN_TEXTS texts to the
    CPU one) or the CPU one; gpu where it cannot be: a clear error."""
    if choice not in TOKENIZER_CHOICES:
        raise InputError(f"tokenizer must be one of {', '.join(TOKENIZER_CHOICES)}, found {choice!r}")
    if choice == "cpu":
        return cpu
    if device != "cuda":
        if choice == "gpu":
            raise DeviceError("tokenizer='gpu' needs the CUDA backend")
        return cpu
    definition = cpu.definition
    reason = unsupported(definition)
    if reason is not None:
        if choice == "gpu":
            raise InputError(f"the GPU tokenizer cannot run this model's tokenizer: {reason}")
        say_once(f"ftengine: tokenising on the CPU: the GPU tokenizer does not cover this model's tokenizer ({reason})")
        return cpu
    return GpuTokenizer(cpu, ops=ops, definition=definition, min_texts=AUTO_MIN_TEXTS if choice == "auto" else 0)


class GpuTokenizer:
    """`Tokenizer.encode` on the device; every other Tokenizer method is the CPU tokenizer's.
    Safe to call from several threads (each launches on its own stream). The tables are built and
    the kernels compiled in a background thread from construction on; calls made before they are
    ready go to the CPU tokenizer (the same result), so a cold start never waits for them."""

    def __init__(self, cpu: Tokenizer, *, ops, definition: dict | None = None, min_texts: int = 0):
        """definition: the tokenizer as tokenizer.json holds it, where the caller has it parsed;
        min_texts: calls of fewer texts (or pairs) go to the CPU tokenizer."""
        self._cpu = cpu
        self._ops = ops
        self._min_texts = min_texts
        self._tables = None
        self._pairs = None   # (PairLayout, the tables of a pair's texts), or why pairs stay on the CPU
        self._error = None
        self._ready = threading.Event()
        data = cpu.definition if definition is None else definition
        threading.Thread(target=self._build, args=(data,), name="ftengine-wordpiece-tables", daemon=True).start()

    def _build(self, data: dict):
        try:
            self._tables = build_tables(data, max_length=self._cpu.max_length)
            self._pairs = _pair_tables(data, self._tables)
            self._ops.prepare_wordpiece()
        except Exception as e:  # the CPU tokenizer does the work instead
            self._error = e
            say_once(f"ftengine: tokenising on the CPU: the GPU tokenizer cannot start ({type(e).__name__}: {e})")
        finally:
            self._ready.set()

    @property
    def tables(self):
        self._ready.wait()
        if self._error is not None:
            raise DeviceError(f"the GPU tokenizer's tables cannot be built: {self._error}")
        return self._tables

    def __getattr__(self, name):
        return getattr(self._cpu, name)

    def _built(self) -> bool:
        """Whether the tables are built and the kernels ready (until then, or if that failed, every
        call goes to the CPU tokenizer)."""
        return self._ready.is_set() and self._error is None

    def _on_device(self, n: int) -> bool:
        """Whether a call of n texts (or pairs) runs on the device: min_texts or more, once built."""
        return n >= max(self._min_texts, 1) and self._built()

    def encode(self, texts, *, first: int = 1) -> TokenizedTexts:
        """As Tokenizer.encode: ids, type ids (0), lengths and truncation flags of each text.
        texts: a list of str, or RawTexts (a text file's undecoded lines; the folder's
        do_lower_case must be off for them), whose invalid UTF-8 is refused or replaced as their
        --errors rule says."""
        raw = isinstance(texts, RawTexts)
        if not raw:
            check_texts(texts, first=first)
        if not self._on_device(len(texts)):
            return self._cpu.encode(texts.decoded() if raw else texts, first=first)
        if raw:
            data, starts, stops = texts.span()
        else:
            found = self._text_bytes(texts)
            if found is None:  # a lone surrogate: the CPU tokenizer names the text
                return self._cpu.encode(texts, first=first)
            data, starts, stops = found
        ids, lengths, flags, kept = self._kernel_ids(self.tables, data, starts, stops)
        tokens = TokenizedTexts(ids, np.zeros(len(ids), np.int32), lengths, (flags & TRUNCATED) != 0)
        redo = np.flatnonzero((flags & ON_CPU) != 0)
        if raw:
            redo = np.union1d(redo, np.array(self._unchecked(texts, data, kept), dtype=np.int64))
        if redo.size:
            again = texts.decoded(redo) if raw else [texts[i] for i in redo.tolist()]
            tokens = _splice(tokens, redo, self._cpu.encode(again, first=first))
        return tokens

    def encode_pairs(self, pairs: list, *, first: int = 1) -> TokenizedTexts:
        """As Tokenizer.encode_pairs: the two texts of every pair tokenised on the device with no
        special tokens, then cut longest-first and joined as the post-processor joins them. A pair
        with a text the kernel hands back goes to the CPU tokenizer, as does every pair of a model
        whose pairs the GPU tokenizer does not cover (said once)."""
        check_pairs(pairs, first=first)
        if self._built() and isinstance(self._pairs, str):
            say_once(f"ftengine: tokenising pairs on the CPU: the GPU tokenizer does not cover this model's pairs "
                     f"({self._pairs})")
        if not self._on_device(len(pairs)) or isinstance(self._pairs, str):
            return self._cpu.encode_pairs(pairs, first=first)
        layout, tables = self._pairs
        found = self._text_bytes([a for a, _ in pairs] + [b for _, b in pairs])
        if found is None:  # a lone surrogate: the CPU tokenizer names the pair
            return self._cpu.encode_pairs(pairs, first=first)
        ids, lengths, flags, _ = self._kernel_ids(tables, *found)
        tokens = _joined(ids, lengths, flags, layout, tables.max_length)
        n = len(pairs)
        # both texts over the room, and it odd: which is longer (the one that keeps the odd piece) is not known
        unknown = ((flags[:n] & flags[n:] & TRUNCATED) != 0) & (tables.max_length % 2 == 1)
        redo = np.flatnonzero((((flags[:n] | flags[n:]) & ON_CPU) != 0) | unknown)
        if redo.size:
            tokens = _splice(tokens, redo, self._cpu.encode_pairs([pairs[i] for i in redo.tolist()], first=first))
        return tokens

    def _text_bytes(self, texts: list):
        """(UTF-8 bytes, starts, stops) of str texts as the kernel reads them (lowercased where the
        folder's do_lower_case says), or None where one holds a lone surrogate."""
        try:
            return self._bytes([t.lower() for t in texts] if self._cpu.lowercase_text else texts)
        except UnicodeEncodeError:
            return None

    def _kernel_ids(self, tables, data: np.ndarray, starts: np.ndarray, stops: np.ndarray):
        """The kernels' packed ids, lengths and flags of the texts data[starts[i]:stops[i]] (each cut
        by _cut; only the kept bytes of a huge text go to the device), and each text's kept stop."""
        starts, kept, cut = self._cut(data, starts, stops)
        sent = _compact(data, starts, kept) if cut.any() else (data, starts, kept)
        return (*self._device_ids(tables, *sent, cut), kept)

    def _cut(self, data: np.ndarray, starts: np.ndarray, stops: np.ndarray):
        """(starts, stops, cut) with each text of over max_length x CUT_BYTES_PER_TOKEN bytes cut
        there, at a character's first byte (the kernel hands back a cut text it does not truncate)."""
        limit = self._cpu.max_length * CUT_BYTES_PER_TOKEN
        cut = (stops - starts > limit).astype(np.uint8)
        stops = stops.copy()
        for i in np.flatnonzero(cut).tolist():
            at = int(starts[i]) + limit
            while at > starts[i] and data[at] & 0xC0 == 0x80:
                at -= 1
            stops[i] = at
        return starts, stops, cut

    @staticmethod
    def _unchecked(texts: RawTexts, data: np.ndarray, kept_stops: np.ndarray) -> list:
        """The lines the kernel cannot answer for: the first line of a file (a BOM the CPU path
        drops), and a cut line whose bytes past the cut are not valid UTF-8."""
        redo = [0] if texts.first == 1 and data[:3].tobytes() == b"\xef\xbb\xbf" else []
        for i in np.flatnonzero(kept_stops < texts.stops - texts.starts[0]).tolist():
            try:
                data[kept_stops[i]:texts.stops[i] - texts.starts[0]].tobytes().decode("utf-8")
            except UnicodeDecodeError:
                redo.append(i)
        return redo

    @staticmethod
    def _bytes(texts: list):
        """(UTF-8 bytes of all texts, each text's start and stop among them)."""
        joined = "".join(texts)
        if joined.isascii():
            sizes = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
            data = joined.encode("ascii")
        else:
            parts = [t.encode("utf-8") for t in texts]
            sizes = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
            data = b"".join(parts)
        stops = np.cumsum(sizes)
        return np.frombuffer(data, np.uint8), stops - sizes, stops

    def _device_ids(self, tables, raw, starts, stops, cut):
        """The kernels' packed ids (T,), lengths (N,) and flags (N,) on the host. Two waits for the
        device and no other call that gives up the GIL (ops.upload / fetch): in a service this
        thread runs beside a busy event loop, and each hand-over of the GIL cost it up to 5 ms."""
        ops = self._ops
        n = len(starts)
        ids = ops.empty((n, tables.max_length), np.int32)
        lengths = ops.empty((n,), np.int32)
        flags = ops.empty((n,), np.uint8)
        ops.wordpiece_tokenize(tables, *ops.upload(raw if raw.size else np.zeros(1, np.uint8), starts, stops, cut),
                               ids, lengths, flags)
        host_lengths, host_flags = ops.fetch(lengths, flags)
        offsets = np.cumsum(host_lengths, dtype=np.int64) - host_lengths
        total = int(host_lengths.sum())
        packed = ops.empty((max(total, 1),), np.int32)
        ops.pack_rows(ids, lengths, *ops.upload(offsets), packed)
        return ops.fetch(packed)[0][:total], host_lengths, host_flags


def _pair_tables(data: dict, tables):
    """(the post-processor's PairLayout, the tables a pair's texts are tokenised with: no special
    tokens, as many pieces as the layout leaves room for), or why pairs stay on the CPU."""
    try:
        layout = pair_layout(data.get("post_processor"))
    except ValueError as e:
        return str(e)
    room = tables.max_length - layout.specials
    if room < 1:
        return f"max_length {tables.max_length} leaves no room for a pair's {layout.specials} special tokens"
    none = np.zeros(0, np.int32)
    return layout, dataclasses.replace(tables, prefix=none, suffix=none, max_length=room)


def _longest_first(a: np.ndarray, b: np.ndarray, room: int):
    """The pieces `tokenizers` keeps of each text of pairs of a and b pieces in `room` (its
    longest_first truncation): both whole where they fit; else the shorter whole, if the longer
    can keep as many; else half the room each, the longer text the odd piece (the second on a tie)."""
    short = np.minimum(a, b)
    keep_long = np.maximum(short, room - short)
    halves = short + keep_long > room
    keep_short = np.where(halves, room // 2, short)
    keep_long = np.where(halves, room // 2 + room % 2, keep_long)
    first_short = a <= b
    return (np.minimum(a, np.where(first_short, keep_short, keep_long)),
            np.minimum(b, np.where(first_short, keep_long, keep_short)))


def _joined(ids: np.ndarray, lengths: np.ndarray, flags: np.ndarray, layout: PairLayout, room: int) -> TokenizedTexts:
    """Pairs from the pieces of their texts (texts 0..n-1 each pair's first, n..2n-1 its second;
    ids packed text after text; a text flagged TRUNCATED has more than its `room` pieces): each
    pair cut longest-first to `room` pieces, between the layout's special tokens. Exact except
    where both texts of a pair are over an odd room (the caller hands those to the CPU)."""
    n = len(lengths) // 2
    size = np.where((flags & TRUNCATED) != 0, room + 1, lengths).astype(np.int64)
    keep_a, keep_b = _longest_first(size[:n], size[n:], room)
    starts = np.cumsum(lengths, dtype=np.int64) - lengths
    parts = [np.array(part, np.int64).reshape(-1, 2) for part in (layout.before, layout.between, layout.after)]
    specials = np.concatenate(parts)
    at = len(ids)  # the special tokens follow the pieces in the source arrays
    source_ids = np.concatenate([ids, specials[:, 0]]).astype(np.int32)
    source_types = np.concatenate([np.zeros(len(ids), np.int64), specials[:, 1]])
    counts = [len(p) for p in parts]
    ones = np.ones(n, np.int64)
    segments = np.stack([counts[0] * ones, keep_a, counts[1] * ones, keep_b, counts[2] * ones], axis=1).reshape(-1)
    bases = np.stack([at * ones, starts[:n], (at + counts[0]) * ones, starts[n:],
                      (at + counts[0] + counts[1]) * ones], axis=1).reshape(-1)
    kinds = np.tile([-1, layout.first_type, -1, layout.second_type, -1], n)  # a text's type; -1: the special's own
    index = np.repeat(bases, segments) + _within(segments)
    kind = np.repeat(kinds, segments)
    type_ids = np.where(kind >= 0, kind, source_types[index]).astype(np.int32)
    lengths_out = segments.reshape(n, 5).sum(axis=1).astype(np.int32)
    return TokenizedTexts(source_ids[index], type_ids, lengths_out, size[:n] + size[n:] > room)


def _splice(tokens: TokenizedTexts, redo: np.ndarray, cpu: TokenizedTexts) -> TokenizedTexts:
    """`tokens` with the texts `redo` replaced by `cpu`'s, in order."""
    lengths = tokens.lengths.copy()
    lengths[redo] = cpu.lengths
    truncated = tokens.truncated.copy()
    truncated[redo] = cpu.truncated
    starts = np.cumsum(lengths, dtype=np.int64) - lengths
    ids = np.empty(int(lengths.sum()), np.int32)
    type_ids = np.zeros(len(ids), np.int32)
    kept = np.ones(len(lengths), dtype=bool)
    kept[redo] = False
    rows = np.flatnonzero(kept)
    within = _within(tokens.lengths[rows])
    before = np.cumsum(tokens.lengths, dtype=np.int64) - tokens.lengths
    kept_at = np.repeat(starts[rows], tokens.lengths[rows]) + within
    kept_from = np.repeat(before[rows], tokens.lengths[rows]) + within
    ids[kept_at] = tokens.ids[kept_from]
    type_ids[kept_at] = tokens.type_ids[kept_from]
    at = np.repeat(starts[redo], cpu.lengths) + _within(cpu.lengths)
    ids[at] = cpu.ids
    type_ids[at] = cpu.type_ids
    return TokenizedTexts(ids, type_ids, lengths, truncated)


def _compact(data: np.ndarray, starts: np.ndarray, stops: np.ndarray):
    """(the texts' bytes one after the other, their new starts and stops)."""
    joined = np.concatenate([data[a:b] for a, b in zip(starts.tolist(), stops.tolist())] + [np.zeros(0, np.uint8)])
    sizes = stops - starts
    ends = np.cumsum(sizes)
    return joined, ends - sizes, ends


def _within(lengths: np.ndarray) -> np.ndarray:
    """Each token's place in its text, for texts of these lengths one after the other."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
