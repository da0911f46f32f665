"""Several models in one service: each model keeps its own engine, batches, limits and routes
(serve.py's Service, under `/models/NAME/...`), and the usual routes go to a model of their task:
the one the body's `model` field names on OpenAI's and Cohere's routes, else the first model of
that task. GET /v1/models lists them as OpenAI does; /health is 200 once every model is ready;
/metrics labels every series with its model; one model's failure leaves the others serving."""

from __future__ import annotations

import asyncio
import time

from .serve import Service
from .serve_request import HTTPFailure

TASK_OF = {"/embed": "embed", "/embeddings": "embed", "/v1/embeddings": "embed", "/rerank": "rerank",
           "/v1/rerank": "rerank", "/rerank/v1": "rerank", "/predict": "classify", "/ner": "ner"}
BY_BODY = ("/v1/embeddings", "/embeddings", "/v1/rerank", "/rerank/v1")  # routes whose body names the model


def task(service: Service) -> str:
    if service.tokens is not None:
        return "ner"
    return "classify" if service.classifier is not None else "rerank" if service.reranker is not None else "embed"


class Gateway:
    def __init__(self, services: list):
        names = [s.model_name for s in services]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must differ: {names}")
        self.services = services
        self.by_name = {s.model_name: s for s in services}
        self.endpoints = {s.model_name: {r.path: r.endpoint for r in s.task_routes()} for s in services}

    def _route_for(self, path: str):
        """The endpoint of a top-level task route: to the model the body names (BY_BODY routes),
        else to the first model of the route's task."""
        from starlette.routing import Route
        kind = TASK_OF[path]
        candidates = [s for s in self.services if task(s) == kind]
        default = candidates[0] if candidates else self.services[0]

        async def choose(request):
            """Inside default.handle (limits, auth, errors as JSON): the body's model, checked."""
            name = (await default._body(request)).get("model")
            target = self.by_name.get(name) if isinstance(name, str) else None
            if target is not None and task(target) != kind:
                raise HTTPFailure(404, f"model {name!r} does not serve {path}; models that do: "
                                       f"{', '.join(s.model_name for s in candidates)}", "NotFound")
            raise _Chosen(target or default)

        async def endpoint(request):
            target = default
            if path in BY_BODY and len(candidates) > 1:
                try:
                    return await default.handle(request, "choose", choose)
                except _Chosen as chosen:
                    target = chosen.service
            return await self.endpoints[target.model_name][path](request)
        return Route(path, endpoint, methods=["POST"])

    def app(self):
        import json
        from contextlib import asynccontextmanager
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route
        first = self.services[0]

        async def models(request):
            listing = [{"id": s.model_name, "object": "model", "owned_by": "ftengine", "task": task(s),
                        "created": int(time.time())} for s in self.services]
            return JSONResponse({"object": "list", "data": listing}), 0, 0

        async def health(request):
            waiting = [s.model_name for s in self.services if not s.ready]
            if waiting:
                raise HTTPFailure(503, f"loading: {', '.join(waiting)}", "Unhealthy")
            return JSONResponse({"status": "ok", "models": [s.model_name for s in self.services]}), 0, 0

        async def info(request):
            return JSONResponse({"models": [json.loads((await s.info(request))[0].body) for s in self.services]}), 0, 0

        @asynccontextmanager
        async def lifespan(app):
            loop = asyncio.get_running_loop()
            warm = [loop.run_in_executor(None, s.warm_up) for s in self.services]
            try:
                yield
            finally:
                await asyncio.gather(*warm, return_exceptions=True)
                await asyncio.gather(*(loop.run_in_executor(None, s.model.close) for s in self.services))

        routes = [Route("/", self.endpoints[first.model_name]["/"], methods=["POST"])]  # TEI's root: the first model
        routes += [self._route_for(path) for path in TASK_OF]
        for s in self.services:
            routes += s.task_routes(prefix=f"/models/{s.model_name}")
        routes += [first.route("/tokenize", "tokenize", first.tokenize), first.route("/decode", "decode", first.decode),
                   first.route("/v1/models", "info", models), first.route("/health", "health", health),
                   first.route("/info", "info", info), first.route("/metrics", "metrics", first.metrics_text)]
        app = Starlette(routes=routes, lifespan=lifespan)
        app.router.redirect_slashes = False
        return app


class _Chosen(BaseException):
    """The body was read and its model found (a BaseException: Service.handle lets it through)."""

    def __init__(self, service: Service):
        super().__init__()
        self.service = service
