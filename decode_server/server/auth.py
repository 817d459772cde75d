"""The decode server's optional API key (``--api-key-file`` / ``--api-key-env``): an ASGI
middleware that answers 401 to any request without ``Authorization: Bearer <key>``, except
``/health``, ``/ready`` and ``/metrics`` (probes and scrapers; they disclose no credentials).
The comparison is constant-time (:func:`hmac.compare_digest`); the answer never echoes what
was sent."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from decode_server.server.api_errors import Unauthorized

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class RequireApiKey:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self._app = app
        self._expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS or self._authorized(scope):
            await self._app(scope, receive, send)
            return
        body = Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'").body()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="decode_server"')]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        given = [v for k, v in scope.get("headers", ()) if k == b"authorization"]
        # one header exactly; compare_digest takes the same time whatever the first differing byte
        return len(given) == 1 and hmac.compare_digest(given[0], self._expected)
