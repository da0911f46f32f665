"""`ftengine serve`: an HTTP service on the encode engine (Starlette + uvicorn).

An embedding model speaks two APIs that existing clients speak:
  POST /embed           text-embeddings-inference: {"inputs", "normalize", "truncate"} -> [[float]]
                        (also at POST /, TEI's root route, which huggingface_hub's InferenceClient uses)
  POST /v1/embeddings   OpenAI: {"input", "model", "encoding_format", "dimensions"} -> {"data", "usage", ...}
a classifier TEI's
  POST /predict         {"inputs": str | [str] | [[str, str]], "raw_scores", "truncate"} -> [{"label", "score"}]
a reranker (a cross-encoder) two others:
  POST /rerank          TEI: {"query", "texts", "raw_scores", "return_text", "truncate"} -> [{"index", "score"}]
  POST /v1/rerank       Cohere / Jina / Infinity: {"query", "documents", "top_n", "return_documents"}
                        -> {"results": [{"index", "relevance_score"}], ...}
every model TEI's POST /tokenize and POST /decode, and GET /health (200 once the model is loaded and
warmed, 503 before), GET /info, GET /metrics
(Prometheus). Concurrent requests go to the one engine, which packs them into shared batches
(the requests of one turn of the event loop as one submission: serve_join.py).
Every expected problem is a JSON error {"error", "error_type"} with its status; nothing
accepted is dropped on SIGTERM/SIGINT (uvicorn stops accepting and lets requests finish).

serve_process.py runs it: uvicorn, and with `workers` > 1 that many processes on one socket.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from dataclasses import dataclass
from functools import partial

import numpy as np

from . import __version__
from .errors import FtengineError, InputError, TooLongError
from .serve_metrics import Metrics
from .serve_join import Joiner
from .serve_request import HTTPFailure, bool_field, dumps, texts_field, token_ids_field, validation
from .tokenizer import PREFIX_CHARS_PER_TOKEN

log = logging.getLogger("ftengine.serve")
MAX_BODY_BYTES = 16 << 20
DISCONNECT_POLL_SECONDS = 0.2  # how often a request waiting on the engine checks that its client is still there
LOG_FORMAT = "%(asctime)s %(name)s %(message)s"


def warm_up_model(model, batch_tokens):
    """One real batch of a model a service runs (an Encoder, Reranker, Classifier or
    TokenClassifier): its kernels compiled and runner built."""
    from .classifier import Classifier
    from .reranker import Reranker
    from .token_classifier import TokenClassifier
    if isinstance(model, TokenClassifier):
        model.predict(["warm up"])
    elif isinstance(model, Reranker):
        model.predict([("warm", "up")], batch_tokens=batch_tokens)
    elif isinstance(model, Classifier):
        model.predict(["warm up"], batch_tokens=batch_tokens)
    else:
        model.encode(["warm up"], batch_tokens=batch_tokens)


@dataclass(frozen=True)
class ServeLimits:
    max_client_batch_size: int = 32        # inputs per request
    max_concurrent_requests: int = 512     # requests accepted and not yet answered
    max_batch_tokens: int | None = None    # the engine's token budget (None: its default)
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES


class Service:
    """The routes, limits and metrics around one model: an Encoder (embeddings), a Reranker or a
    Classifier. metrics: shared by the services of several models (serve_gateway.py)."""

    def __init__(self, model, *, model_name: str, limits: ServeLimits, metrics: Metrics | None = None):
        from .classifier import Classifier
        from .reranker import Reranker
        from .token_classifier import TokenClassifier
        self.reranker = model if isinstance(model, Reranker) else None
        self.classifier = model if isinstance(model, Classifier) else None
        self.tokens = model if isinstance(model, TokenClassifier) else None
        # what /tokenize, /decode and /info read (its tokenizer, config, limits), and the engine
        self.encoder = model if self.reranker is None and self.classifier is None else model._encoder
        self.model, self.model_name, self.limits = model, model_name, limits
        self.ready = False
        self.in_flight = 0
        self._join = Joiner()  # requests of one turn of the event loop: one engine submission
        self._waiting = {}     # asyncio future a request awaits -> (request, joined, the future it came from)
        self._gone = set()     # those futures cancelled because their client went away
        self._watcher = None   # the task of _watch_clients
        self.metrics = metrics or Metrics()
        self.registry = self.metrics.registry
        if self.tokens is None:  # a TokenClassifier runs its own batches
            self.encoder._engine.on_batch = partial(self.metrics.observe_batch, model_name)

    def _metric(self, family: str, *labels):
        """A metric of this service: its family, labelled with the model where several share it."""
        return self.metrics.of(family, self.model_name, *labels)

    def warm_up(self):
        """One real batch before /health says 200: kernels compiled, runner built."""
        warm_up_model(self.model, self.limits.max_batch_tokens)
        self.ready = True
        log.info("ready: %s on %s (%s), process %d", self.model_name, self.encoder.device, self.encoder.dtype,
                 os.getpid())

    # ------------------------------------------------------------ request plumbing

    def _authorize(self, request):
        """With an API key, refuse a request without it (compared in constant time)."""
        import hmac
        key = self.limits.api_key
        if key is not None and not hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                                       f"Bearer {key}".encode()):
            raise HTTPFailure(401, "missing or wrong API key (Authorization: Bearer KEY)", "Unauthorized")

    async def _body(self, request) -> dict:
        """The request's JSON object, read within the limits (once: a gateway that chose this
        service by the body's model field read it already). The body's deadline is the
        connection's (serve_http.py): a timer per chunk here cost more than the rest of the read."""
        import orjson
        read = getattr(request.state, "json_body", None)
        if read is not None:
            return read
        self._authorize(request)
        if request.headers.get("content-encoding", "identity").lower() != "identity":
            raise HTTPFailure(415, f"Content-Encoding {request.headers['content-encoding']!r} is not accepted: send "
                                   "the JSON body uncompressed", "Validation")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            raise HTTPFailure(413, f"request body of {length} bytes is over the limit of "
                                   f"{self.limits.max_body_bytes} bytes", "Validation")
        raw = bytearray()
        receive = request.receive
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                from .serve_http import BODY_LATE, BODY_SECONDS
                if request.scope.get(BODY_LATE):
                    raise HTTPFailure(408, f"the request body did not arrive within {BODY_SECONDS:g} s", "Timeout")
                raise HTTPFailure(499, "the client went away before sending the whole body", "Disconnected")
            raw += message.get("body", b"")
            if len(raw) > self.limits.max_body_bytes:
                raise HTTPFailure(413, f"request body is over the limit of {self.limits.max_body_bytes} bytes",
                                  "Validation")
            if not message.get("more_body", False):
                break
        try:
            body = orjson.loads(raw)
        except ValueError as e:
            raise validation(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise validation("the body must be a JSON object")
        request.state.json_body = body
        return body

    def _check_count(self, n: int, field: str):
        if n > self.limits.max_client_batch_size:
            raise HTTPFailure(413, f"{field} holds {n} inputs, more than --max-client-batch-size "
                                   f"{self.limits.max_client_batch_size}", "Validation")

    async def _answer(self, request, future):
        """The result of an engine future (or of the Joiner's asyncio future); the work is
        cancelled if the client goes away first (the engine drops a cancelled request from its
        queue; _watch_clients looks)."""
        joined = asyncio.isfuture(future)
        waiting = future if joined else asyncio.wrap_future(future)
        self._waiting[waiting] = (request, joined, future)
        loop = asyncio.get_running_loop()
        if self._watcher is None or self._watcher.done() or self._watcher.get_loop() is not loop:
            self._watcher = loop.create_task(self._watch_clients())
        try:
            return await waiting
        except asyncio.CancelledError:
            if waiting not in self._gone:
                raise
            raise HTTPFailure(499, "the client went away", "Disconnected") from None
        finally:
            self._waiting.pop(waiting, None)
            self._gone.discard(waiting)

    async def _watch_clients(self):
        """While requests wait for the engine, every DISCONNECT_POLL_SECONDS: cancel the work of
        those whose client has gone (one timer for them all, not one per request)."""
        while self._waiting:
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)
            for waiting, (request, joined, future) in list(self._waiting.items()):
                if not waiting.done() and await request.is_disconnected():
                    self._gone.add(waiting)
                    if joined:
                        self._join.cancel(future)
                    else:
                        waiting.cancel()  # and with it the engine's future

    async def _encode(self, request, texts=None, *, token_ids=None, normalize=None, truncate=True,
                      prompt_name=None, route: str = "embed"):
        """EncodeResult of one request through the engine, errors as HTTP failures."""
        def submit(inputs, requests=1):
            return self.encoder.submit_request(inputs, batch_tokens=self.limits.max_batch_tokens, normalize=normalize,
                                               truncate=truncate, token_ids=token_ids, prompt_name=prompt_name,
                                               requests=requests)
        try:
            if token_ids is None:
                future = self._join.submit(texts, ("embed", normalize, truncate, prompt_name), submit)
            else:
                future = submit(texts)
            return await self._answer(request, future)
        except TooLongError as e:
            if token_ids is not None:
                count = f"{len(token_ids[e.index])} tokens"
            elif len(texts[e.index]) > e.max_length * PREFIX_CHARS_PER_TOKEN:  # counted whole, it would stall the loop
                count = f"{len(texts[e.index])} characters"
            else:
                text = self.encoder.prompt_text(prompt_name) + texts[e.index]
                count = f"{self.encoder.tokenizer.untruncated_length(text)} tokens"
            advice = "; send truncate: true to cut it" if route == "embed" else ""
            raise HTTPFailure(413, f"input {e.index} has {count}, more than the maximum input length "
                                   f"{e.max_length} tokens{advice}", "Validation") from None
        except InputError as e:
            raise validation(str(e)) from None

    async def handle(self, request, route: str, handler):
        from starlette.responses import JSONResponse
        start = time.perf_counter()
        inputs = tokens = 0
        admitted = False
        try:
            if route in ("info", "metrics"):
                self._authorize(request)
            if route not in ("health", "info", "metrics"):
                if self.in_flight >= self.limits.max_concurrent_requests:
                    raise HTTPFailure(429, f"{self.in_flight} requests are in progress, the limit "
                                           f"(--max-concurrent-requests); retry shortly", "Overloaded",
                                      {"Retry-After": "1"})
                self.in_flight += 1
                self._metric("queue_depth").inc()
                admitted = True
            response, inputs, tokens = await handler(request)
        except HTTPFailure as e:
            response = JSONResponse({"error": e.message, "error_type": e.kind}, status_code=e.status,
                                    headers=e.headers)
        except FtengineError as e:  # the engine is broken or closed
            response = JSONResponse({"error": str(e), "error_type": "Backend"}, status_code=503)
        except Exception as e:  # a bug: one line in the log and the reply, no traceback to the client
            log.exception("internal error on %s", request.url.path)
            response = JSONResponse({"error": f"internal error: {type(e).__name__}", "error_type": "Backend"},
                                    status_code=500)
        finally:
            if admitted:
                self.in_flight -= 1
                self._metric("queue_depth").dec()
        ms = 1000 * (time.perf_counter() - start)
        self._metric("requests", route, str(response.status_code)).inc()
        self._metric("latency", route).observe(ms / 1000)
        self._metric("inputs").inc(inputs)
        self._metric("tokens").inc(tokens)
        log.info("%s %s %d inputs=%d tokens=%d %.1fms", request.method, request.scope["path"], response.status_code,
                 inputs, tokens, ms)
        return response

    # ------------------------------------------------------------ routes

    async def embed(self, request):
        """TEI: {"inputs": str | [str], "normalize": true, "truncate": false} -> [[float]]."""
        from starlette.responses import Response
        body = await self._body(request)
        if "inputs" not in body:
            raise validation("inputs is required")
        texts = texts_field(body["inputs"], "inputs")
        self._check_count(len(texts), "inputs")
        normalize, truncate = bool_field(body, "normalize", True), bool_field(body, "truncate", False)
        prompt_name = body.get("prompt_name")
        if prompt_name is not None and not isinstance(prompt_name, str):
            raise validation(f"prompt_name must be a string, found {prompt_name!r}")
        result = await self._encode(request, texts, normalize=normalize, truncate=truncate, prompt_name=prompt_name)
        return Response(dumps(result.embeddings), media_type="application/json"), len(texts), result.tokens

    async def openai_embeddings(self, request):
        """OpenAI: {"input": str | [str] | [int] | [[int]], "model", "encoding_format", "dimensions"}."""
        from starlette.responses import Response
        body = await self._body(request)
        if "input" not in body:
            raise validation("input is required")
        model = body.get("model", self.model_name)
        if not isinstance(model, str):
            raise validation("model must be a string")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise validation(f"encoding_format must be 'float' or 'base64', found {fmt!r}")
        value = body["input"]
        token_ids = token_ids_field(value, "input") if isinstance(value, list) else None
        texts = None if token_ids is not None else texts_field(value, "input")
        count = len(token_ids if token_ids is not None else texts)
        self._check_count(count, "input")
        vocab = self.encoder.config.vocab_size
        for i, seq in enumerate(token_ids or ()):
            bad = next((t for t in seq if t >= vocab), None)
            if bad is not None:
                raise validation(f"input[{i}] holds token id {bad}, outside this model's vocabulary 0..{vocab - 1}")
        dim = self.encoder.dim
        dimensions = body.get("dimensions")
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or not 1 <= dimensions <= dim):
            raise validation(f"dimensions must be an integer within 1..{dim}, found {dimensions!r}")
        result = await self._encode(request, texts, token_ids=token_ids, truncate=True, route="openai")
        rows = result.embeddings
        if dimensions is not None and dimensions < dim:  # Matryoshka-style: cut, then renormalise as the model does
            rows = rows[:, :dimensions]
            if self.encoder.normalize:
                rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
        if fmt == "base64":
            data = [base64.b64encode(np.ascontiguousarray(r, dtype="<f4").tobytes()).decode() for r in rows]
        else:
            data = list(rows)
        payload = {"object": "list", "model": model,
                   "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
                   "usage": {"prompt_tokens": result.tokens, "total_tokens": result.tokens}}
        return Response(dumps(payload), media_type="application/json"), count, result.tokens

    async def _head(self, request, inputs: list, key, submit, too_long: str) -> tuple:
        """(the finished future, tokens) of a classifier head's work on `inputs` (non-empty):
        submit(inputs, requests) queues a list on the engine and returns its future; requests of this
        turn of the event loop with the same key go as one list (serve_join.py). Awaited as
        /embed's is, cancelled if the client goes away. too_long: the 413 message's subject."""
        try:
            future = self._join.submit(inputs, key, submit)
            return future, (await self._answer(request, future)).tokens
        except TooLongError as e:
            raise HTTPFailure(413, f"{too_long.format(index=e.index)} longer than the maximum input length "
                                   f"{e.max_length} tokens; send truncate: true to cut it", "Validation") from None
        except InputError as e:
            raise validation(str(e)) from None

    async def _scores(self, request, query: str, documents: list, *, raw: bool, truncate: bool) -> tuple:
        """(scores, tokens) of (query, document) pairs through the engine; errors as HTTP failures."""
        pairs = [(query, d) for d in documents]
        future, tokens = await self._head(request, pairs, ("rerank", truncate), lambda joined, requests: (
            self.reranker.submit_scores(joined, batch_tokens=self.limits.max_batch_tokens, truncate=truncate,
                                        requests=requests)),
            "text {index} with the query is")
        return self.reranker.finish_scores(future, activation=not raw), tokens

    def _query(self, body: dict) -> str:
        query = body.get("query")
        if not isinstance(query, str):
            raise validation("query is required, a string" if query is None else
                              f"query must be a string, found {type(query).__name__}")
        if not query.strip():
            raise validation("query must not be empty")
        return query

    async def rerank(self, request):
        """TEI: {"query", "texts", "raw_scores": false, "return_text": false, "truncate": false} ->
        [{"index", "score", "text"?}], best first."""
        from starlette.responses import Response
        body = await self._body(request)
        query = self._query(body)
        if "texts" not in body:
            raise validation("texts is required")
        texts = texts_field(body["texts"], "texts")
        self._check_count(len(texts), "texts")
        raw, return_text = bool_field(body, "raw_scores", False), bool_field(body, "return_text", False)
        scores, tokens = await self._scores(request, query, texts, raw=raw, truncate=bool_field(body, "truncate", False))
        order = np.argsort(-scores, kind="stable")
        reply = [{"index": int(i), "score": float(scores[i]), **({"text": texts[i]} if return_text else {})}
                 for i in order]
        return Response(dumps(reply), media_type="application/json"), len(texts), tokens

    async def cohere_rerank(self, request):
        """Cohere / Jina / Infinity: {"model", "query", "documents": [str | {"text"}], "top_n",
        "return_documents"} -> {"results": [{"index", "relevance_score", "document"?}], "usage", ...}."""
        import uuid
        from starlette.responses import Response
        body = await self._body(request)
        query = self._query(body)
        model = body.get("model", self.model_name)
        if not isinstance(model, str):
            raise validation("model must be a string")
        documents = body.get("documents")
        if not isinstance(documents, list) or not documents:
            raise validation("documents is required, a non-empty list of strings or {\"text\"} objects")
        texts = []
        for i, d in enumerate(documents):
            text = d.get("text") if isinstance(d, dict) else d
            if not isinstance(text, str):
                raise validation(f"documents[{i}] must be a string or an object with a string \"text\"")
            texts.append(text)
        self._check_count(len(texts), "documents")
        top_n = body.get("top_n", len(texts))
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
            raise validation(f"top_n must be an integer >= 1, found {top_n!r}")
        return_documents = bool_field(body, "return_documents", False)
        scores, tokens = await self._scores(request, query, texts, raw=False, truncate=True)
        order = np.argsort(-scores, kind="stable")[:top_n]
        results = [{"index": int(i), "relevance_score": float(scores[i]),
                    **({"document": {"text": texts[i]}} if return_documents else {})} for i in order]
        reply = {"id": str(uuid.uuid4()), "object": "rerank", "model": model, "results": results,
                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                 "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}}
        return Response(dumps(reply), media_type="application/json"), len(texts), tokens

    async def predict(self, request):
        """TEI: {"inputs": str | [str, str] (one pair) | [str | [str, str], ...], "raw_scores": false,
        "truncate": false} -> per input every label, best first: [{"label", "score"}] for one input,
        a list of those for a list."""
        from starlette.responses import Response
        body = await self._body(request)
        if "inputs" not in body:
            raise validation("inputs is required")
        value = body["inputs"]
        # as TEI reads it: a string, or a list of exactly two strings, is one input (a text, a pair)
        single = isinstance(value, str) or (isinstance(value, list) and len(value) == 2 and
                                            all(isinstance(x, str) for x in value))
        items = [value] if single else value
        if not isinstance(items, list) or not items:
            raise validation("inputs must be a string, a non-empty list of strings, or of [text, text] pairs")
        inputs = []
        for i, item in enumerate(items):
            if isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item):
                inputs.append(tuple(item))
            elif isinstance(item, str):
                inputs.append(item)
            else:
                raise validation(f"inputs[{i}] must be a string or a [text, text] pair")
        if len({isinstance(x, tuple) for x in inputs}) > 1:
            raise validation("inputs must be all texts or all pairs")
        self._check_count(len(inputs), "inputs")
        raw, truncate = bool_field(body, "raw_scores", False), bool_field(body, "truncate", False)
        pairs = isinstance(inputs[0], tuple)
        future, tokens = await self._head(request, inputs, ("classify", pairs, truncate), lambda joined, requests: (
            self.classifier.submit_logits(joined, batch_tokens=self.limits.max_batch_tokens, truncate=truncate,
                                          requests=requests)),
            "input {index} is")
        logits = self.classifier.head_logits(future.result())
        rows = logits if raw else self.classifier.scores(logits)
        reply = self.classifier.ranked(rows, None)
        return Response(dumps(reply[0] if single else reply), media_type="application/json"), len(inputs), tokens

    async def ner(self, request):
        """{"inputs": str | [str], "aggregation_strategy": "simple", "stride"?} -> HF's token-classification
        pipeline's entities ([{"entity_group", "score", "word", "start", "end"}], with "none"
        [{"entity", "score", "index", "word", "start", "end"}]): a list for one text, a list of
        them for a list."""
        from starlette.responses import Response
        from .token_classifier import STRATEGIES
        body = await self._body(request)
        if "inputs" not in body:
            raise validation("inputs is required")
        single = isinstance(body["inputs"], str)
        texts = texts_field(body["inputs"], "inputs")
        self._check_count(len(texts), "inputs")
        strategy = body.get("aggregation_strategy", "simple")
        if strategy not in STRATEGIES:
            raise validation(f"aggregation_strategy must be one of {', '.join(STRATEGIES)}, found {strategy!r}")
        stride = body.get("stride")
        loop = asyncio.get_running_loop()
        try:  # tokenised off the event loop; requests waiting together share the model's passes
            future = await loop.run_in_executor(
                None, lambda: self.tokens.submit(texts, aggregation_strategy=strategy, stride=stride))
        except InputError as e:
            raise validation(str(e)) from None
        found, tokens = await self._answer(request, future)
        return Response(dumps(found[0] if single else found), media_type="application/json"), len(texts), tokens

    async def tokenize(self, request):
        """TEI: {"inputs": str | [str], "add_special_tokens": true} -> per input its tokens
        [{"id", "text", "special", "start", "stop"}] (character offsets into the input)."""
        from starlette.responses import Response
        body = await self._body(request)
        if "inputs" not in body:
            raise validation("inputs is required")
        texts = texts_field(body["inputs"], "inputs")
        self._check_count(len(texts), "inputs")
        special = bool_field(body, "add_special_tokens", True)
        tok = self.encoder.tokenizer
        loop = asyncio.get_running_loop()
        try:
            found = await loop.run_in_executor(None, lambda: tok.with_offsets(texts, add_special_tokens=special))
        except InputError as e:
            raise validation(str(e)) from None
        reply = [[{"id": i, "text": text[a:b] if not s else piece, "special": bool(s), "start": a if not s else None,
                   "stop": b if not s else None} for i, piece, s, (a, b) in rows] for text, rows in zip(texts, found)]
        return Response(dumps(reply), media_type="application/json"), len(texts), sum(map(len, found))

    async def decode(self, request):
        """TEI: {"ids": [int] | [[int]], "skip_special_tokens": true} -> [str]."""
        from starlette.responses import Response
        body = await self._body(request)
        value = body.get("ids")
        if not isinstance(value, list) or not value:
            raise validation("ids is required, a list of token ids or of lists of them")
        sequences = token_ids_field(value, "ids")
        if sequences is None:
            raise validation("ids must hold token ids (integers)")
        self._check_count(len(sequences), "ids")
        vocab = self.encoder.config.vocab_size
        for i, seq in enumerate(sequences):
            bad = next((t for t in seq if t >= vocab), None)
            if bad is not None:
                raise validation(f"ids[{i}] holds token id {bad}, outside this model's vocabulary 0..{vocab - 1}")
        skip = bool_field(body, "skip_special_tokens", True)
        texts = self.encoder.tokenizer.decode(sequences, skip_special_tokens=skip)
        return Response(dumps(texts), media_type="application/json"), len(sequences), sum(map(len, sequences))

    async def other_task(self, request):
        """A route of a task this model does not serve: a 404 naming the routes it does serve."""
        mine = ("POST /ner" if self.tokens is not None else "POST /predict" if self.classifier is not None
                else "POST /rerank, POST /v1/rerank" if self.reranker is not None
                else "POST /embed, POST /v1/embeddings")
        kind = "a token classifier" if self.tokens is not None else "a classifier" if self.classifier is not None \
            else "a reranker" if self.reranker is not None else "an embedding model"
        raise HTTPFailure(404, f"{request.url.path} is not served here: this service runs {kind} ({mine}, "
                               "POST /tokenize, POST /decode)", "NotFound")

    async def health(self, request):
        from starlette.responses import JSONResponse
        problem = self.problem()
        if problem is not None:
            raise HTTPFailure(503, problem, "Unhealthy")
        return JSONResponse({"status": "ok"}), 0, 0

    def problem(self) -> str | None:
        """Why /health is not 200: the model's engine has failed, or it is loading; None if well."""
        failed = None if self.tokens is not None else self.encoder._engine.failed
        if failed is not None:
            return f"the model cannot answer: {failed}"
        return None if self.ready else "the model is loading"

    async def info(self, request):
        from starlette.responses import JSONResponse
        e = self.encoder
        if self.reranker is not None or self.classifier is not None or self.tokens is not None:
            labelled = self.tokens or self.classifier
            kind = {"reranker": {}} if self.reranker is not None else \
                {"token_classifier" if self.tokens is not None else "classifier":
                 {"id2label": {str(i): name for i, name in enumerate(labelled.labels)}}}
            return JSONResponse({
                "model_id": self.model_name, "model_path": str(e.path), "model_type": kind,
                "max_input_length": e.max_length, "dtype": e.dtype, "device": e.device,
                "max_client_batch_size": self.limits.max_client_batch_size,
                "max_concurrent_requests": self.limits.max_concurrent_requests, "version": __version__}), 0, 0
        return JSONResponse({
            "model_id": self.model_name, "model_path": str(e.path), "dim": e.dim, "max_input_length": e.max_length,
            "dtype": e.dtype, "device": e.device, "pooling": list(e.pooling), "normalize": e.normalize,
            "prompts": sorted(e.prompts), "default_prompt_name": e.default_prompt_name,
            "max_client_batch_size": self.limits.max_client_batch_size,
            "max_concurrent_requests": self.limits.max_concurrent_requests, "version": __version__}), 0, 0

    async def metrics_text(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
        from starlette.responses import Response
        registry = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # every worker's values, summed
            from prometheus_client.multiprocess import MultiProcessCollector
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST), 0, 0

    TASK_PATHS = ("/embed", "/v1/embeddings", "/embeddings", "/rerank", "/v1/rerank", "/predict", "/ner")

    def route(self, path: str, name: str, handler):
        from starlette.routing import Route

        async def endpoint(request):
            return await self.handle(request, name, handler)
        return Route(path, endpoint, methods=["GET"] if name in ("health", "info", "metrics") else ["POST"])

    def task_routes(self, prefix: str = "") -> list:
        """This model's routes (its task's, /tokenize, /decode, and the other tasks' paths answering
        which it serves), under `prefix`."""
        def route(path, name, handler):
            return self.route(prefix + path, name, handler)
        if self.tokens is not None:
            task = [route("/ner", "ner", self.ner)]
        elif self.classifier is not None:
            task = [route("/predict", "predict", self.predict),
                    route("/", "predict", self.predict)]  # TEI's root route
        elif self.reranker is not None:
            task = [route("/rerank", "rerank", self.rerank),
                    route("/", "rerank", self.rerank),  # TEI's root route
                    route("/v1/rerank", "cohere", self.cohere_rerank),
                    route("/rerank/v1", "cohere", self.cohere_rerank)]
        else:
            task = [route("/embed", "embed", self.embed),
                    route("/", "embed", self.embed),  # TEI's root route, where huggingface_hub posts
                    route("/v1/embeddings", "openai", self.openai_embeddings),
                    route("/embeddings", "openai", self.openai_embeddings)]
        served = {r.path for r in task}
        task += [route(path, "other", self.other_task) for path in self.TASK_PATHS if prefix + path not in served]
        return task + [route("/tokenize", "tokenize", self.tokenize), route("/decode", "decode", self.decode)]

    def app(self):
        """The Starlette application: routes, and the warm-up at startup (in a thread, so /health
        answers 503 meanwhile)."""
        from contextlib import asynccontextmanager
        from starlette.applications import Starlette

        @asynccontextmanager
        async def lifespan(app):
            warm = asyncio.get_running_loop().run_in_executor(None, self.warm_up)
            try:
                yield
            finally:
                await warm
                await asyncio.get_running_loop().run_in_executor(None, self.model.close)

        app = Starlette(routes=[*self.task_routes(), self.route("/health", "health", self.health),
                                self.route("/info", "info", self.info),
                                self.route("/metrics", "metrics", self.metrics_text)], lifespan=lifespan)
        app.router.redirect_slashes = False  # a redirect would echo the request's Host header: 404 instead
        return app
