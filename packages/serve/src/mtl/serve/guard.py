"""ASGI middleware in front of every route: the bearer-token check on ``/v1`` and the request
counter by route and status.

The counter's ``path`` label is the route a request matched, or ``unmatched``: a label per
URL a client (or a scanner) happens to send would grow the metrics without bound."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

UNMATCHED = "unmatched"  # the one label of every path no route serves


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    """OpenAI's error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


class Guard:
    def __init__(self, app, api_key: str | None, metrics, routes: list):
        """``routes``: the app's route list (read at the first request, once every route exists)."""
        self.app, self.api_key, self.metrics = app, api_key, metrics
        self._routes = routes
        self._paths: frozenset[str] | None = None

    def path_label(self, path: str) -> str:
        if self._paths is None:
            self._paths = frozenset(route.path for route in self._routes)
        return path if path in self._paths else UNMATCHED

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = {}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        if self.api_key is not None and path.startswith("/v1") and not self._authorized(scope):
            await error_response(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                 kind="authentication_error")(scope, receive, counting_send)
        else:
            await self.app(scope, receive, counting_send)
        self.metrics.requests.labels(self.path_label(path), str(status.get("code", 0))).inc()

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())
