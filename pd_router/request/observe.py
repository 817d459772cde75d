"""Observation of one request, apart from serving it: its trace (the root span and one
span per stage), and at its end the access log line and the request metrics."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from time import perf_counter
from typing import TYPE_CHECKING

from pd_http.logs import bind_request
from pd_http.tracing import Span, SpanKind, Tracing, fail, span_ids
from pd_router.asgi import Scope
from pd_router.request.context import RequestContext

if TYPE_CHECKING:
    from pd_router.state import RouterState

log = logging.getLogger("pd_router.requests")
_NO_SPAN: AbstractContextManager[None] = nullcontext()  # tracing off: no span object at all


def begin(state: RouterState, ctx: RequestContext, scope: Scope) -> None:
    """The request arrived: its log context (and root span, tracing on); in flight."""
    if state.tracing is None:
        bind_request(ctx.request_id)
    else:
        _start_trace(state.tracing, ctx, scope)
    state.metrics.in_flight.inc()


def finish(state: RouterState, ctx: RequestContext) -> None:
    """The request ended, whichever way: its metrics, its span, its access log line."""
    metrics, endpoint, rid = state.metrics, ctx.endpoint, ctx.request_id
    metrics.in_flight.dec()
    if ctx.disconnected:
        ctx.status, ctx.error_type = 499, "client_disconnected"
        metrics.child(metrics.client_aborts, ctx.stage).inc()
    metrics.child(metrics.requests, endpoint.label, ctx.model, str(ctx.status), ctx.error_type).inc()
    latency = perf_counter() - ctx.start
    metrics.child(metrics.e2e, endpoint.label, ctx.model).observe(latency)
    if ctx.prompt_tokens:
        metrics.child(metrics.prompt_tokens, endpoint.label, ctx.model).inc(ctx.prompt_tokens)
    if ctx.span is not None:
        _end_trace(ctx)
    ttft_ms = None if ctx.ttft is None else round(ctx.ttft * 1e3, 3)
    slot_ms = None if ctx.slot_wait is None else round(ctx.slot_wait * 1e3, 3)
    log.info(
        "request_id=%s %s status=%d%s tenant=%s priority=%d stage=%s %.1fms%s%s",
        rid,
        endpoint.path,
        ctx.status,
        f" error={ctx.error_type}" if ctx.error_type else "",
        ctx.tenant.name,
        ctx.priority,
        ctx.stage,
        latency * 1e3,
        "" if slot_ms is None else f" slot={slot_ms:.1f}ms",
        "" if ttft_ms is None else f" ttft={ttft_ms:.1f}ms",
        extra={"fields": {"event": "access", "endpoint": endpoint.path, "status": ctx.status,
                          "error_type": ctx.error_type or None, "tenant": ctx.tenant.name,
                          "priority": ctx.priority, "stage": ctx.stage,
                          "latency_ms": round(latency * 1e3, 3), "slot_ms": slot_ms,
                          "ttft_ms": ttft_ms}},
    )


def _start_trace(tracing: Tracing, ctx: RequestContext, scope: Scope) -> None:
    """The request's root span, continuing the client's trace when it sent a ``traceparent``."""
    span = tracing.start(f"POST {ctx.endpoint.path}", tracing.extract(scope["headers"]), SpanKind.SERVER,
                         {"http.request.method": "POST", "url.path": ctx.endpoint.path,
                          "pd.request_id": ctx.request_id})
    ctx.span, ctx.trace = span, tracing.context(span)
    bind_request(ctx.request_id, span_ids(span)[0])


def _end_trace(ctx: RequestContext) -> None:
    span = ctx.span
    assert span is not None
    span.set_attributes({"http.response.status_code": ctx.status, "pd.stage": ctx.stage})
    if ctx.error_type:
        span.set_attribute("error.type", ctx.error_type)
    if ctx.status >= 500 or ctx.status == 0:
        fail(span, RuntimeError(ctx.error_type or "no answer"), ctx.error_type or None)
    span.end()


def span(state: RouterState, ctx: RequestContext, name: str,
         kind: SpanKind = SpanKind.INTERNAL) -> AbstractContextManager[Span | None]:
    """A stage's span under the request's root span; with tracing off a shared no-op."""
    tracing = state.tracing
    if tracing is None or ctx.trace is None:
        return _NO_SPAN
    return tracing.span(name, ctx.trace, kind)
