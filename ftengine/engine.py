"""The encode engine: one worker thread owns the runner; any number of callers submit texts.

    callers (threads, asyncio, a stream) --submit--> requests queue
        -> tokenizer thread: several waiting requests tokenised in one call (HF `tokenizers`
           runs in Rust threads without the GIL; texts and text pairs each in their own call),
           checked per request
        -> worker thread: requests packed into token-budget batches (a request the batch can
           take whole as it came, else its sequences longest first; one batch holds requests
           with the same options),
           two batches in flight on the device while the host lays out the next,
           each request's rows to its own future, in its order.

Only the worker thread touches the runner, its workspace, graphs and stream (it builds
them: CuPy's current device and stream are per thread). A request with bad input fails
alone; anything else that goes wrong in the worker fails every waiting request with one
DeviceError and leaves the engine refusing new work. Memory is the requests in flight,
never the size of an input: streams submit bounded windows (Encoder.encode_stream).

One stream per GPU: two runners replaying their captured passes side by side on two streams (so
that one batch's memory-bound kernels might run beside the other's products) gained 0.6-2.3%
(H100, BERT-base fp16, 32 x 128 to 64 x 512, 2026-11-25): not worth a second workspace.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .errors import DeviceError, FtengineError, InputError, TooLongError
from .models.bert import Batch, ids_below
from .models.shapes import fit_count, fits, run_shape
from .textio import RawTexts
from .tokenizer import TokenizedTexts, check_pairs, check_texts

IN_FLIGHT_BATCHES = 2         # batches queued on the device at once (the runner's staging slots)
TOKENIZE_GROUP_TEXTS = 4096   # the tokenizer thread joins waiting requests up to this many texts
_STOP = object()


@dataclass(frozen=True)
class EncodeOptions:
    """What decides a batch's forward pass; requests with equal options share batches."""
    pooling: tuple            # pooling modes, sentence-transformers' order
    normalize: bool
    batch_tokens: int         # token budget of one batch
    skip: int = 0             # leading tokens (a prompt's) left out of pooling


@dataclass
class EncodeResult:
    embeddings: np.ndarray    # (N, dim) float32, the request's order
    tokens: int               # real tokens, special tokens included
    truncated: int            # texts cut to max_length
    device_seconds: float     # device time of the batches, shared out by rows
    lengths: np.ndarray | None = None   # (N,) tokens of each text
    cut: np.ndarray | None = None       # (N,) bool: each text cut to max_length


class _Request:
    """A caller's texts, their options and the future that carries the reply."""

    def __init__(self, texts, options: EncodeOptions, *, truncate: bool, first: int, progress, future: Future,
                 pairs: bool = False):
        self.texts = texts
        self.pairs = pairs            # texts are (text, text) pairs
        self.noun = "pair" if pairs else "text"   # one of the texts, in error messages
        self.options = options
        self.truncate = truncate
        self.first = first            # 1-based number of texts[0], for error messages
        self.progress = progress      # called from the worker with each batch's row count
        self.future = future
        self.tokens: TokenizedTexts | None = None
        self.starts = None            # (N,) int64 token offsets, once the request is cut (order)
        self.order = None             # (N,) texts, longest first, once a batch cannot take them all
        self.sorted_lengths = None    # (N,) lengths in that order
        self.lengths = self.cut = None  # (N,) each text's tokens, and whether it was cut
        self.device_seconds = 0.0
        self.cursor = 0               # texts of `order` already sent to the device
        self.remaining = len(texts)   # rows not yet delivered
        self.out = None               # (N, dim) float32
        self.given = None             # TokenizedTexts the caller tokenised itself
        self.callers = 1              # callers' requests these texts join

    def fail(self, error: BaseException):
        if not self.future.done():
            self.future.set_exception(error)


class EncodeEngine:
    """Batches requests for one loaded encoder. `make_runner(max_batch_tokens)` builds the
    runner; it and `runner.resize` are only ever called from the worker thread."""

    def __init__(self, *, tokenizer, make_runner, layout: str, max_length: int, output_dim,
                 vocab_size: int, type_vocab_size: int, name: str = "ftengine"):
        self.tokenizer = tokenizer
        self.on_batch = None          # optional observer: on_batch(texts, requests, tokens), worker thread
        self.make_runner = make_runner
        self.layout = layout
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.type_vocab_size = type_vocab_size
        self.name = name
        self._dim = output_dim        # output_dim(pooling modes): the width of a request's rows
        self._inbox = queue.SimpleQueue()     # raw requests -> tokenizer thread
        self._ready = queue.SimpleQueue()     # tokenised requests -> worker thread
        self._lock = threading.Lock()
        self._threads = []
        self._closing = False
        self._broken: FtengineError | None = None
        self._live = set()            # requests accepted and not yet answered (for failure / close)
        _ENGINES.add(self)

    # ------------------------------------------------------------ callers

    def submit(self, texts: list, options: EncodeOptions, *, truncate: bool = True, first: int = 1,
               progress=None, tokens: TokenizedTexts | None = None, pairs: bool = False,
               requests: int = 1) -> Future:
        """Queue `texts` (a list of str, or RawTexts for a tokenizer that takes them); the future's
        result is an EncodeResult. `first` is the
        1-based number of texts[0] in the caller's input, for error messages. `tokens`: texts
        already tokenised (then `texts` is only their count's worth of placeholders). pairs: texts
        are (text, text) pairs, tokenised as the model's tokenizer joins them. requests: how many
        callers' requests the texts join (a service's; on_batch counts them)."""
        if pairs:
            check_pairs(texts, first=first)
        elif tokens is None and not isinstance(texts, RawTexts):
            check_texts(texts, first=first)
        future = Future()
        request = _Request(texts, options, truncate=truncate, first=first, progress=progress, future=future,
                           pairs=pairs)
        request.given = tokens
        request.callers = requests
        future.add_done_callback(lambda _f, r=request: self._forget(r))
        with self._lock:
            if self._broken is not None:
                raise self._broken
            if self._closing:
                raise InputError("this encoder is closed")
            if texts:
                self._live.add(request)
                self._start()
        if not texts:  # answered here (outside the lock: the done callback takes it)
            future.set_running_or_notify_cancel()
            future.set_result(EncodeResult(np.zeros((0, self._dim(options.pooling)), np.float32), 0, 0, 0.0,
                                           np.zeros(0, np.int32), np.zeros(0, bool)))
            return future
        self._inbox.put(request)
        return future

    def _forget(self, request):
        with self._lock:
            self._live.discard(request)

    def close(self, *, cancel: bool = False):
        """Stop the threads: work already accepted is finished first (cancel=True: failed with
        'closed' instead, only the batches already on the device complete). Idempotent."""
        with self._lock:
            already = self._closing
            self._closing = True
            threads = list(self._threads)
        if cancel:
            self._fail_all(InputError("this encoder was closed before the request was encoded"))
        if not already and threads:
            self._inbox.put(_STOP)
        current = threading.current_thread()
        for t in threads:
            if t is not current:
                t.join()

    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def failed(self) -> FtengineError | None:
        """The error that broke the engine (every request fails with it), or None."""
        return self._broken

    def _start(self):
        """Start the threads on first use (called with the lock held)."""
        if self._threads:
            return
        for target, role in ((self._tokenize_loop, "tokenizer"), (self._work_loop, "worker")):
            t = threading.Thread(target=target, name=f"{self.name}-{role}", daemon=True)
            t.start()
            self._threads.append(t)

    def _fail_all(self, error: FtengineError):
        with self._lock:
            live = list(self._live)
        for r in live:
            r.fail(error)

    # ------------------------------------------------------------ tokenizer thread

    def _tokenize_loop(self):
        try:
            while True:
                group, stop = self._take_group()
                if group:
                    self._tokenize(group)
                if stop:
                    return
        except BaseException as e:  # a bug or a broken tokenizer: nothing can be encoded any more
            self._break(e)
        finally:
            self._ready.put(_STOP)

    def _take_group(self) -> tuple[list, bool]:
        """The next request, and more that are already waiting, up to TOKENIZE_GROUP_TEXTS texts."""
        first = self._inbox.get()
        if first is _STOP:
            return [], True
        group, count = [first], len(first.texts)
        while count < TOKENIZE_GROUP_TEXTS:
            try:
                r = self._inbox.get_nowait()
            except queue.Empty:
                break
            if r is _STOP:
                return group, True
            group.append(r)
            count += len(r.texts)
        return group, False

    def _tokenize(self, group: list):
        group = [r for r in group if r.future.set_running_or_notify_cancel()]  # drops cancelled ones
        for r in [r for r in group if r.given is not None]:
            self._accept(r, r.given)
        raw = [r for r in group if isinstance(r.texts, RawTexts)]
        group = [r for r in group if r.given is None and not isinstance(r.texts, RawTexts)]
        for r in raw:  # undecoded lines: a call each
            self._accept(r, self._tokenize_one(r))
        for pairs in (False, True):
            self._tokenize_together([r for r in group if r.pairs == pairs], pairs)

    def _tokenize_together(self, group: list, pairs: bool):
        """One tokenizer call for the group's texts (or pairs), each request's share to it."""
        if not group:
            return
        texts = group[0].texts if len(group) == 1 else [t for r in group for t in r.texts]
        try:
            tokens = self._encoded(texts, pairs)
        except Exception:  # one request's texts upset the tokenizer: find it, keep the others
            for r in group:
                self._accept(r, self._tokenize_one(r))
            return
        parts = [tokens] if len(group) == 1 else tokens.split([len(r.texts) for r in group])
        for r, part in zip(group, parts):
            self._accept(r, part)

    def _encoded(self, texts: list, pairs: bool, first: int = 1) -> TokenizedTexts:
        if not pairs:
            return self.tokenizer.encode(texts, first=first)
        tokens = self.tokenizer.encode_pairs(texts, first=first)
        if self.type_vocab_size == 1:  # RoBERTa, DistilBERT: no token types to give
            tokens.type_ids[:] = 0
        return tokens

    def _tokenize_one(self, r: _Request):
        try:
            return self._encoded(r.texts, r.pairs, r.first)
        except Exception as e:
            r.fail(e if isinstance(e, InputError) else
                   InputError(f"{r.noun}s {r.first}..{r.first + len(r.texts) - 1} cannot be tokenised: {e}"))
            return None

    def _accept(self, r: _Request, tokens: TokenizedTexts | None):
        """Check one request's tokens and queue it for the worker (or fail it alone)."""
        r.texts = None  # the strings are no longer needed
        if tokens is None:
            return
        try:
            self._check(r, tokens)
        except InputError as e:
            r.fail(e)
            return
        r.tokens = tokens
        r.lengths, r.cut = tokens.lengths, tokens.truncated
        self._ready.put(r)

    @staticmethod
    def _cut_up(r: _Request):
        """Sort a request's texts longest first, for a batch that can take only some of them."""
        r.starts = r.tokens.starts
        r.order = np.argsort(-r.lengths, kind="stable")
        r.sorted_lengths = r.lengths[r.order]

    def _check(self, r: _Request, tokens: TokenizedTexts):
        """Per-request checks on the host, before any kernel indexes memory with these ids."""
        if not r.truncate and tokens.truncated.any():
            i = int(np.flatnonzero(tokens.truncated)[0])
            raise TooLongError(f"{r.noun} {r.first + i} is longer than max_length "
                               f"{self.max_length} tokens", index=i, max_length=self.max_length)
        if (tokens.lengths > self.max_length).any():  # a tokenizer that cannot cut its special tokens
            i = int(np.flatnonzero(tokens.lengths > self.max_length)[0])
            raise InputError(f"input {r.first + i} has {int(tokens.lengths[i])} tokens after truncation, more than "
                             f"max_length {self.max_length}: the tokenizer cannot cut it shorter (its special tokens)")
        for values, limit, what in ((tokens.ids, self.vocab_size, "token id"),
                                    (tokens.type_ids, self.type_vocab_size, "token type")):
            if ids_below(values, limit):  # the search only on a bad request
                continue
            bad = np.flatnonzero((values < 0) | (values >= limit))
            if bad.size:
                text = int(np.searchsorted(np.cumsum(tokens.lengths), bad[0], side="right"))
                raise InputError(f"{r.noun} {r.first + text}: {what} {int(values[bad[0]])} is outside 0..{limit - 1} "
                                 "(the tokenizer and the model's config.json disagree)")

    # ------------------------------------------------------------ worker thread

    def _work_loop(self):
        pending = deque()    # tokenised requests with texts not yet sent to the device
        in_flight = deque()  # (PendingEmbeddings, [(request, text indices)]), oldest first
        runner = None
        stopping = False
        try:
            while not (stopping and not pending and not in_flight):
                stopping |= self._take_ready(pending, block=not pending and not in_flight)
                for r in [r for r in pending if r.future.done()]:  # failed or cancelled meanwhile
                    pending.remove(r)
                if pending and len(in_flight) < IN_FLIGHT_BATCHES:
                    batch, parts, options = self._next_batch(pending)
                    runner = self._runner_for(runner, batch, options)
                    handle = runner.submit(batch, pooling=options.pooling, normalize=options.normalize,
                                           skip=options.skip)
                    in_flight.append((handle, parts))
                elif in_flight:
                    handle, parts = in_flight.popleft()
                    rows = handle.wait()
                    self._deliver(rows, parts, handle.device_seconds)
        except BaseException as e:
            self._break(e)

    def _take_ready(self, pending: deque, *, block: bool) -> bool:
        """Move tokenised requests to `pending` (waiting for one if `block`); True once the
        tokenizer thread has said it stopped."""
        while True:
            try:
                r = self._ready.get() if block else self._ready.get_nowait()
            except queue.Empty:
                return False
            if r is _STOP:
                return True
            pending.append(r)
            block = False

    def _next_batch(self, pending: deque):
        """Texts for one batch: from the oldest request with its options, longest first, then
        from later requests with the same options, while the token budget holds. A request the
        batch takes whole goes in as it came (parts' index None): the same batch, without sorting
        and gathering its tokens (a service's requests mostly fit whole)."""
        options = pending[0].options
        parts, count, total, longest = [], 0, 0, 0
        limit = dict(max_batch_tokens=options.batch_tokens, max_seq_len=self.max_length)
        for r in list(pending):
            if r.options != options:
                continue
            if r.order is None:
                n, tokens, widest = len(r.lengths), r.tokens.tokens, int(r.lengths.max())
                if fits(self.layout, count + n, total + tokens, max(longest, widest), **limit):
                    count, total, longest = count + n, total + tokens, max(longest, widest)
                    parts.append((r, None))
                    pending.remove(r)
                    continue
                self._cut_up(r)
            start = r.cursor
            lengths = r.sorted_lengths[start:]
            k = fit_count(self.layout, count, total, longest, lengths, **limit)
            if k:
                count, total, longest = count + k, total + int(lengths[:k].sum()), max(longest, int(lengths[0]))
                parts.append((r, r.order[start:start + k]))
                r.cursor = start + k
            if r.cursor == len(r.order):
                pending.remove(r)
            else:
                break
        ids, types, lengths = [], [], []
        for r, index in parts:
            if index is None:
                part = Batch(r.tokens.ids, r.tokens.type_ids, r.lengths)
            else:
                part = Batch.gather(r.tokens.ids, r.tokens.type_ids, r.starts[index], r.lengths[index])
            ids.append(part.ids)
            types.append(part.token_types)
            lengths.append(part.lengths)
        batch = (Batch(ids[0], types[0], lengths[0]) if len(parts) == 1 else
                 Batch(np.concatenate(ids), np.concatenate(types), np.concatenate(lengths)))
        if self.on_batch is not None:
            self.on_batch(len(batch.lengths), sum(r.callers for r, _ in parts), len(batch.ids))
        return batch, parts, options

    def _runner_for(self, runner, batch: Batch, options: EncodeOptions):
        """The runner, its workspace sized to the work actually queued: this batch's bucketed
        token count, grown (at least doubling) when a later batch needs more, never past the
        options' budget."""
        need, _, _ = run_shape(self.layout, batch.lengths, max_batch_tokens=options.batch_tokens,
                               max_seq_len=self.max_length)
        need = max(need, self.max_length)
        if runner is None:
            return self.make_runner(max_batch_tokens=need)
        if runner.max_batch_tokens < need:
            runner.resize(min(options.batch_tokens, max(need, 2 * runner.max_batch_tokens)))
        return runner

    def _deliver(self, rows: np.ndarray, parts: list, device_seconds: float):
        at = 0
        for r, index in parts:
            count = len(r.lengths) if index is None else len(index)
            mine = rows[at:at + count]
            at += count
            if r.future.done():
                continue
            if not np.isfinite(mine).all():
                row = int(np.flatnonzero(~np.isfinite(mine).all(axis=1))[0])
                text = r.first + (row if index is None else int(index[row]))
                r.fail(InputError(f"the embedding of text {text} is not finite (NaN or inf); the model or its "
                                  "weights produce invalid values"))
                continue
            if index is None:  # the whole request, in its order
                r.out = mine
            else:
                if r.out is None:
                    r.out = np.empty((len(r.lengths), mine.shape[1]), dtype=np.float32)
                r.out[index] = mine
            r.remaining -= count
            r.device_seconds += device_seconds * count / len(rows)
            if r.progress is not None:
                try:
                    r.progress(count)
                except Exception as e:  # the caller's callback: its error is the caller's answer
                    r.fail(e)
                    continue
            if r.remaining == 0:
                r.tokens = None
                r.future.set_result(EncodeResult(r.out, int(r.lengths.sum()), int(np.count_nonzero(r.cut)),
                                                 r.device_seconds, r.lengths, r.cut))

    def _break(self, error: BaseException):
        """The worker or tokenizer failed outside any one request: fail everything, refuse more."""
        if isinstance(error, FtengineError) and not isinstance(error, InputError):
            broken = error
        else:
            broken = DeviceError(f"the encoder failed and cannot be used any more: {type(error).__name__}: {error}")
        with self._lock:
            if self._broken is None:
                self._broken = broken
            self._closing = True
        self._fail_all(self._broken)
        self._inbox.put(_STOP)  # the tokenizer thread, if it still runs, ends too


_ENGINES = weakref.WeakSet()


@atexit.register
def _close_all():
    """No engine thread outlives the interpreter: requests nobody can wait for any more are
    failed, the batches already on the device complete, the threads end."""
    for engine in list(_ENGINES):
        engine.close(cancel=True)


class SerialWorker:
    """One thread that runs calls one at a time, for an object whose device state only one
    thread may drive (a Generator's runner: its buffers, graphs and stream). `hold()` keeps
    other callers out across several calls (a stream of steps)."""

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.RLock()
        self._executor = None

    def hold(self):
        return self._lock

    def call(self, fn, *args):
        """fn(*args) on the worker thread; its result, or its exception re-raised here."""
        with self._lock:
            return self.submit(fn, *args).result()

    def submit(self, fn, *args) -> Future:
        """fn(*args) queued on the worker thread, after the calls before it; its future."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
            return self._executor.submit(fn, *args)

    def close(self):
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


class OwnsWorker:
    """A model whose calls run on its own SerialWorker (self._worker): a context manager, and
    close() stops the worker."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Stop the worker thread (it starts again on the next call)."""
        self._worker.close()
