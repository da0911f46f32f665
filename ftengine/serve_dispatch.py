"""The service's outermost ASGI layer: a POST to one of the application's fixed paths goes straight
to that route's endpoint, ahead of Starlette's middleware and router, which otherwise cost each
request more host time under the worker's GIL than parsing its HTTP did (docs/service.md).
Everything else (other methods, unknown paths, the lifespan) goes to the Starlette application
unchanged. The endpoints already answer every error themselves (Service.handle)."""

from __future__ import annotations


class PostDispatch:
    def __init__(self, app):
        from starlette.requests import Request
        from starlette.routing import Route
        self.app, self._request = app, Request
        # the first route of a path wins, as in Starlette's router; paths with parameters stay there
        self.posts = {}
        for route in app.routes:
            if isinstance(route, Route) and "POST" in (route.methods or ()) and not route.param_convertors:
                self.posts.setdefault(route.path, route.endpoint)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self.posts.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self.app
                response = await endpoint(self._request(scope, receive, send))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
