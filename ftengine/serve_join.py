"""Requests a service receives in one turn of its event loop go to the engine as one submission.

Under load a worker's clients send their requests together, and the engine would tokenise and
batch them together anyway; joining them on the event loop first costs the engine one request,
one tokenizer call and one future for the lot instead of one each, and the threads that
hand them over take the worker's one GIL that much less (docs/service.md). While the engine
works on a key's submission, that key's later requests wait and go as one when it is answered:
under load the submissions grow with it, and are no bigger than one turn's when it is light.
Only requests with the same options (the key) are joined. A joined submission that fails on its
input (one member's text too long, say) is sent again member by member, so that each error names
that member's own input; any other failure (a closed or broken engine) is every member's answer.
A member whose client has gone is dropped (cancel); the engine's work is cancelled once every
member of its submission has gone."""

from __future__ import annotations

import asyncio

import numpy as np

from .engine import EncodeResult
from .errors import InputError

IN_FLIGHT = 1  # submissions of one key on the engine at once (fewer, larger ones served faster: docs/service.md)


class _Submission:
    """Members (inputs, submit, asyncio future) sent to the engine as one list, and the engine's
    future."""
    __slots__ = ("members", "engine")

    def __init__(self, members: list, engine):
        self.members, self.engine = members, engine


class Joiner:
    """Joins submissions per event loop; called on that loop's thread only."""

    def __init__(self, depth: int = IN_FLIGHT):
        self._depth = depth
        self._waiting = {}  # loop -> {key: [(inputs, submit, asyncio future)]}
        self._busy = {}     # (loop, key) -> submissions of that key the engine has not answered
        self._flushing = set()  # loops with a flush scheduled
        self._sent = {}     # asyncio future -> its _Submission, until answered

    def submit(self, inputs: list, key, submit) -> asyncio.Future:
        """An asyncio future of the EncodeResult of `inputs` (its rows, tokens and share of the
        device time): submit(list of inputs, requests) queues a list that joins `requests`
        requests on the engine and returns the engine's future; requests with equal keys in this
        turn of the loop share one call of it."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.setdefault(loop, {}).setdefault(key, []).append((inputs, submit, future))
        if loop not in self._flushing and self._busy.get((loop, key), 0) < self._depth:
            self._flushing.add(loop)
            loop.call_soon(self._flush, loop)
        return future

    def cancel(self, future: asyncio.Future):
        """Drop a member whose client has gone; its submission's engine work is cancelled once
        none of its members is waiting."""
        future.cancel()
        sent = self._sent.pop(future, None)
        if sent is not None and all(m[2].done() for m in sent.members):
            sent.engine.cancel()

    def _flush(self, loop):
        self._flushing.discard(loop)
        waiting = self._waiting.get(loop, {})
        for key in list(waiting):
            if self._busy.get((loop, key), 0) < self._depth:
                self._send(loop, key, [m for m in waiting.pop(key) if not m[2].done()])
        if not waiting:
            self._waiting.pop(loop, None)

    def _send(self, loop, key, members: list):
        if not members:
            return
        inputs = members[0][0] if len(members) == 1 else [x for m in members for x in m[0]]
        try:
            engine = members[0][1](inputs, len(members))
        except Exception as e:  # noqa: BLE001 - each member's handler raises it as its answer
            if isinstance(e, InputError) and len(members) > 1:
                for m in members:
                    self._send(loop, key, [m])
            else:
                self._fail(members, e)
            return
        sent = _Submission(members, engine)
        for m in members:
            self._sent[m[2]] = sent
        self._busy[(loop, key)] = self._busy.get((loop, key), 0) + 1
        engine.add_done_callback(lambda f: loop.call_soon_threadsafe(self._split, loop, key, sent))

    def _split(self, loop, key, sent: _Submission):
        busy = self._busy.pop((loop, key)) - 1
        if busy:
            self._busy[(loop, key)] = busy
        if key in self._waiting.get(loop, {}):
            self._flush(loop)  # send the requests held while this key's submissions filled the depth
        members, engine = sent.members, sent.engine
        for m in members:
            self._sent.pop(m[2], None)
        if engine.cancelled():
            return
        error = engine.exception()
        if isinstance(error, InputError) and len(members) > 1:
            for m in members:
                if not m[2].done():
                    self._send(loop, key, [m])
            return
        if error is not None:
            self._fail(members, error)
            return
        result = engine.result()
        total = max(len(result.embeddings), 1)
        at = 0
        for inputs, _, future in members:
            n = len(inputs)
            if not future.done():
                lengths, cut = result.lengths[at:at + n], result.cut[at:at + n]
                future.set_result(EncodeResult(result.embeddings[at:at + n], int(lengths.sum()),
                                               int(np.count_nonzero(cut)), result.device_seconds * n / total,
                                               lengths, cut))
            at += n

    def _fail(self, members: list, error: BaseException):
        for m in members:
            self._sent.pop(m[2], None)
            if not m[2].done():
                m[2].set_exception(error)
