"""The HTTP connection protocol of `ftengine serve`: uvicorn's httptools protocol with limits on a
request's head, which uvicorn lacks (a slowloris client could hold a connection open forever and
have the parser buffer any amount of unfinished headers):

- a head must be complete within HEAD_SECONDS of its first byte, else 408 and the connection closes;
- a head may take at most HEAD_BYTES, else 431 and the connection closes;
- a new connection that sends nothing is closed after KEEP_ALIVE_SECONDS, as an idle kept-alive
  one is.
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEAD_SECONDS = 10.0
HEAD_BYTES = 64 * 1024
# seconds an idle keep-alive connection stays open. uvicorn's default of 5 races with pooled clients:
# a request sent on a pooled connection just as the server closes it fails with a read error (seen
# with 64 httpx clients on a busy 2-core machine). Clients' pools keep connections longer than 5 s.
KEEP_ALIVE_SECONDS = 75


def _reply(status: str, message: str) -> bytes:
    body = json.dumps({"error": message, "error_type": "Validation"}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head limits above (Config(http="ftengine.serve_http:
    GuardedHttpToolsProtocol"): a string, so that worker processes import it)."""

    def connection_made(self, transport):
        super().connection_made(transport)
        self._head_bytes = 0
        self._awaiting_head = True
        self._head_timer = self.loop.call_later(KEEP_ALIVE_SECONDS, self._head_late, False)

    def connection_lost(self, exc):
        self._cancel_head_timer()
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
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(HEAD_SECONDS, self._head_late, True)

    def on_headers_complete(self):
        self._awaiting_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_response_complete(self):
        super().on_response_complete()  # a kept-alive connection: uvicorn's idle timer runs now
        self._awaiting_head, self._head_bytes = True, 0

    def _head_late(self, started: bool):
        self._head_timer = None
        if not self._awaiting_head or self.transport.is_closing():
            return
        if started:
            self._close_with(_reply("408 Request Timeout",
                                    f"the request's head did not arrive within {HEAD_SECONDS:g} s"))
        else:
            self.transport.close()

    def _close_with(self, reply: bytes):
        self._cancel_head_timer()
        self.transport.write(reply)
        self.transport.close()

    def _cancel_head_timer(self):
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None
