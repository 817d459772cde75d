"""The router's ASGI application.

Two layers: the completion routes (``POST /v1/completions``, ``POST
/v1/chat/completions``) go straight to the raw :class:`~pd_router.request.accept.CompletionHandler`
(the hot path, no framework), and so do ``POST /v1/responses`` and Anthropic's ``POST
/v1/messages`` (as chat completions: :mod:`~pd_router.apis.responses`,
:mod:`~pd_router.apis.messages`); everything else (``/health``, ``/ready``, ``/metrics``,
``/v1/models``, ``/tokenize``, ``/detokenize``, ``/v1/messages/count_tokens``, lifespan,
unknown paths) goes to a small FastAPI app.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import MappingProxyType
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pd_router.answers import ModelCard, ModelList, VersionReport
from pd_router.apis import messages, messages_out
from pd_router.asgi import Receive, Scope, Send, authorization, read_body
from pd_router.errors import InvalidRequest, MethodNotAllowed, NotFound, RouterError
from pd_router.request.accept import CompletionHandler
from pd_router.server import tokens
from pd_router.server.admin import add_admin_routes
from pd_router.server.versions import version_report
from pd_router.settings import RouterSettings
from pd_router.state import RouterState
from pd_wire.requests import Endpoint

if TYPE_CHECKING:
    from pd_http.tracing import Tracing
    from pd_settings.servers import Resolver

_ROUTES = MappingProxyType({e.path: e for e in Endpoint})
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"


def _error_response(err: RouterError) -> Response:
    return Response(
        err.body(),
        status_code=err.status,
        media_type="application/json",
        headers={k.decode(): v.decode() for k, v in err.headers()},
    )


def _control_app(state: RouterState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="pd_router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def authorized(request: Request) -> None:  # a key of --api-key or --api-keys-file, when one is set
        state.tenants.tenant(authorization(request.scope))

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, err: RouterError) -> Response:
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            return _error_response(MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}"))
        return _error_response(NotFound(f"no route {request.method} {request.url.path}"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return _error_response(InvalidRequest(str(exc.errors()[0].get("msg"))))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        report = state.backends.readiness()
        if state.draining:
            report = report.model_copy(update={"ready": False, "problems": ["router: draining (shutting down)",
                                                                             *report.problems]})
        return Response(
            report.model_dump_json(),
            status_code=200 if report.ready else 503,
            media_type="application/json",
            headers=None if report.ready else {"Retry-After": str(max(1, round(state.settings.probe_interval)))},
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/version")
    async def version() -> VersionReport:
        return await version_report(state)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        authorized(request)
        builds = [b for backend in (await version_report(state)).backends for b in backend.build]
        return ModelList(data=[ModelCard(id=m, build=[b for b in builds if b.model == m])
                               for m in sorted(state.backends.prefill_models())])

    add_admin_routes(app, state.settings, state.discovery)

    async def body(request: Request) -> bytes:  # bounded as the completion routes' bodies
        settings = state.settings
        return await read_body(request.scope, request.receive, settings.max_body_bytes, settings.body_timeout)

    async def tokens_route(request: Request) -> Response:
        authorized(request)
        answer = await tokens.forward(state, request.url.path, await body(request))
        return Response(json.dumps(answer), media_type="application/json")

    for path in tokens.PATHS:  # vLLM's /tokenize and /detokenize, answered by a prefill server
        app.add_api_route(path, tokens_route, methods=["POST"])

    @app.post(COUNT_TOKENS_PATH)
    async def count_tokens(request: Request) -> Response:
        """Anthropic's token count: the prompt vLLM renders for the request, counted by a prefill
        server's ``/tokenize``; errors in Anthropic's shape."""
        try:
            authorized(request)
            asked = messages.parse_count_tokens(await body(request))
            answer = await tokens.forward(state, tokens.TOKENIZE, json.dumps(asked.tokenize_body()).encode())
        except RouterError as err:
            return Response(messages_out.error_body(err.status, err.body()), status_code=err.status,
                            media_type="application/json",
                            headers={k.decode(): v.decode() for k, v in err.headers()})
        count = int(answer.get("count") or 0)
        return Response(json.dumps({"input_tokens": count, "context_management": {"original_input_tokens": count}}),
                        media_type="application/json")

    for path in _ROUTES:  # so that GET on a completion route answers 405, not 404
        app.add_api_route(path, _method_not_allowed, methods=["GET", "PUT", "DELETE", "PATCH"])
    return app


async def _method_not_allowed(request: Request) -> Response:
    return _error_response(MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}"))


class RouterApp:
    """The ASGI callable uvicorn serves; ``.state`` is this app's :class:`RouterState`."""

    def __init__(self, settings: RouterSettings, tracing: Tracing | None = None,
                 resolver: Resolver | None = None) -> None:
        self.state = RouterState(settings, tracing, resolver)
        self.control = _control_app(self.state)
        self.completions = CompletionHandler(self.state)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"].rstrip("/") or "/"
            endpoint = _ROUTES.get(path)
            if endpoint is not None:
                return await self.completions(scope, receive, send, endpoint)
            if path == RESPONSES_PATH:  # mapped onto chat completions (apis.responses)
                return await self.completions(scope, receive, send, Endpoint.CHAT, api="responses")
            if path == MESSAGES_PATH:  # Anthropic's, mapped onto chat completions (apis.messages)
                return await self.completions(scope, receive, send, Endpoint.CHAT, api="messages")
        await self.control(scope, receive, send)


def create_app(settings: RouterSettings, tracing: Tracing | None = None,
               resolver: Resolver | None = None) -> RouterApp:
    """``tracing``: the app's tracer; default: one exporting to ``--otlp-traces-endpoint``, if set.
    ``resolver``: DNS lookups of ``--prefill-dns`` / ``--decode-dns`` (default: the system's)."""
    return RouterApp(settings, tracing, resolver)
