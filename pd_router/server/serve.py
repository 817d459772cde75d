"""The router's uvicorn server: HTTP limits on every connection (:mod:`pd_http.limits`)
and a drain on SIGTERM (:mod:`pd_http.drain`, :meth:`RouterState.drain`)."""

from __future__ import annotations

import uvicorn

from pd_http.drain import DrainingServer
from pd_http.heap import freeze_startup_heap
from pd_http.limits import HttpLimits, limited_protocol
from pd_net.tcp import DeadPeer
from pd_router.server.app import RouterApp
from pd_router.settings import RouterSettings
from pd_wire.errors import ErrorBody, ErrorDetail

GRACEFUL_SHUTDOWN_S = 5  # after the drain: what uvicorn still waits for (the drain has ended every request)


def error_body(status: int, error_type: str, message: str) -> bytes:
    return ErrorBody(error=ErrorDetail(message=message, type=error_type, code=status)).model_dump_json().encode()


def http_limits(settings: RouterSettings) -> HttpLimits:
    return HttpLimits(
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        header_timeout=settings.header_timeout,
        max_connections=settings.max_connections,
        dead_peer=DeadPeer.within(settings.dead_peer_timeout),
    )


def uvicorn_config(app: RouterApp, settings: RouterSettings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=limited_protocol(http_limits(settings), error_body),
        log_level=settings.log_level,
        log_config=None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,  # json: to the root's
        access_log=False,
        lifespan="on",
        timeout_keep_alive=max(1, round(settings.keep_alive_timeout)),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def router_server(app: RouterApp, settings: RouterSettings) -> DrainingServer:
    """The server ``python -m pd_router`` runs: drains on the first SIGTERM/SIGINT; its
    start-up heap (imports, structured output's warm-up) is frozen once it serves."""
    return DrainingServer(uvicorn_config(app, settings), app.state.drain, lambda: freeze_startup_heap("router"))
