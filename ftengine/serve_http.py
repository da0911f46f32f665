"""The HTTP connection protocol of `ftengine serve`: uvicorn's httptools protocol with limits on a
request's head and body, which uvicorn lacks (a slowloris client could hold a connection open
forever and have the parser buffer any amount of unfinished headers; a stalled body would hold its
concurrency slot):

- a head must be complete within HEAD_SECONDS of its first byte, else 408 and the connection closes;
- a head may take at most HEAD_BYTES, else 431 and the connection closes;
- a body must be complete within BODY_SECONDS of its request's start, else 408 (the application
  reads BODY_LATE in its scope) and the connection closes;
- a new connection that sends nothing is closed after KEEP_ALIVE_SECONDS, as an idle kept-alive
  one is.

A connection keeps one timer for these deadlines, moved forward lazily: a request only writes its
deadline, and the timer, when it fires early, sleeps again until the current one (a timer made and
cancelled per request cost the event loop more than parsing the request did: docs/service.md).
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEAD_SECONDS = 10.0
HEAD_BYTES = 64 * 1024
BODY_SECONDS = 30.0
# seconds an idle keep-alive connection stays open. uvicorn's default of 5 races with pooled clients:
# a request sent on a pooled connection just as the server closes it fails with a read error (seen
# with 64 httpx clients on a busy 2-core machine). Clients' pools keep connections longer than 5 s.
KEEP_ALIVE_SECONDS = 75
BODY_LATE = "ftengine.body_late"  # set in a request's scope when its body missed its deadline


def _reply(status: str, message: str) -> bytes:
    body = json.dumps({"error": message, "error_type": "Validation"}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above (Config(http="ftengine.serve_http:
    GuardedHttpToolsProtocol"): a string, so that worker processes import it)."""

    def connection_made(self, transport):
        super().connection_made(transport)
        self._head_bytes = 0
        self._awaiting_head = True
        self._timer = None
        self._timer_at = 0.0
        self._deadline = None  # (loop time, "idle" | "head" | "body"), or None
        self._expect("idle", KEEP_ALIVE_SECONDS)

    def connection_lost(self, exc):
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes):
        started = self._awaiting_head and self._head_bytes == 0
        super().data_received(data)
        if not self._awaiting_head or self.transport.is_closing():
            return
        self._head_bytes += len(data)
        if self._head_bytes > HEAD_BYTES:
            self._close_with(_reply("431 Request Header Fields Too Large",
                                    f"the request's head is longer than {HEAD_BYTES} bytes"))
        elif started:  # the first bytes of a head: it has HEAD_SECONDS from now
            self._expect("head", HEAD_SECONDS)

    def on_headers_complete(self):
        self._awaiting_head = False
        self._deadline = None
        super().on_headers_complete()
        if not self.pipeline:  # its application has started (a pipelined one waits for those before it)
            self._expect("body", BODY_SECONDS)

    def on_message_complete(self):
        if self._deadline is not None and self._deadline[1] == "body":
            self._deadline = None
        super().on_message_complete()

    def on_response_complete(self):
        super().on_response_complete()  # a kept-alive connection: uvicorn's idle timer runs now
        self._awaiting_head, self._head_bytes = True, 0
        cycle = self.cycle
        if not self.pipeline and cycle is not None and not cycle.response_complete and cycle.more_body:
            # the last pipelined request has started, its body still coming (the parser reads requests
            # in order: an unfinished body is the newest request's)
            self._expect("body", BODY_SECONDS)

    def _expect(self, kind: str, seconds: float):
        at = self.loop.time() + seconds
        self._deadline = (at, kind)
        if self._timer is None or at < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = self.loop.call_at(at, self._expire), at

    def _expire(self):
        self._timer = None
        if self._deadline is None or self.transport.is_closing():
            return
        at, kind = self._deadline
        if self.loop.time() < at:
            self._timer, self._timer_at = self.loop.call_at(at, self._expire), at
            return
        self._deadline = None
        if kind == "head":
            self._close_with(_reply("408 Request Timeout",
                                    f"the request's head did not arrive within {HEAD_SECONDS:g} s"))
        elif kind == "body" and self.cycle is not None and not self.cycle.response_started:
            self.cycle.scope[BODY_LATE] = True
            self._close_with(_reply("408 Request Timeout",
                                    f"the request body did not arrive within {BODY_SECONDS:g} s"))
        else:  # a connection that sent nothing, or a body still coming after its answer
            self.transport.close()

    def _close_with(self, reply: bytes):
        self._deadline = None
        self.transport.write(reply)
        self.transport.close()
