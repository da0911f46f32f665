"""A bare ASGI app for bench_serve.py --bare: it reads a request's body, parses its JSON and sends
a canned reply of the task's shape (BARE_TASK: rerank or classify, 32 inputs), under the same
uvicorn (uvloop, httptools) as `ftengine serve`: the HTTP stack's own ceiling, no model."""

from __future__ import annotations

import os

import orjson

INPUTS = 32
REPLIES = {"classify": orjson.dumps([[{"label": f"LABEL_{j}", "score": 1 / 3} for j in range(3)]
                                     for _ in range(INPUTS)]),
           "rerank": orjson.dumps([{"index": i, "score": 0.5} for i in range(INPUTS)])}
REPLY = REPLIES[os.environ.get("BARE_TASK", "classify")]


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            done = "startup" if message["type"] == "lifespan.startup" else "shutdown"
            await send({"type": f"lifespan.{done}.complete"})
            if done == "shutdown":
                return
    if scope["type"] != "http":
        return
    body = bytearray()
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    orjson.loads(body)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": REPLY})
