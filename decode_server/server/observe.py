"""One request's trace and access-log line on the decode server.

:class:`RequestObservation` is created when a generation request arrives: it tags the
request's log lines with its id (and trace id), opens the root span (parented on the
router's ``traceparent``, when tracing is on) and, at the end, writes the access line
(status, stage reached, latency) and ends the span. The stage spans (``kv_wait``,
``engine_start``, ``generation``) are children of the root span; the engine's run on the
slot's worker thread with explicit start and end times.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pd_http.logs import bind_request
from pd_http.tracing import Span, SpanKind, Tracing, fail, span_ids

if TYPE_CHECKING:
    from opentelemetry.context import Context

access_log = logging.getLogger("decode_server.access")


class RequestObservation:
    def __init__(self, tracing: Tracing | None, path: str, request_id: str,
                 headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.tracing = tracing
        self.path = path
        self.request_id = request_id
        self.arrived = time.perf_counter()
        self.stage = "validating"
        self.status = 0
        self.error_type: str | None = None
        self.span: Span | None = None
        self.trace: Context | None = None  # the stage spans' parent
        if tracing is None:
            bind_request(request_id)
            return
        self.span = tracing.start(f"POST {path}", tracing.extract(headers), SpanKind.SERVER,
                                  {"http.request.method": "POST", "url.path": path, "pd.request_id": request_id})
        self.trace = tracing.context(self.span)
        bind_request(request_id, span_ids(self.span)[0])

    def answered(self, status: int, error_type: str | None = None) -> None:
        """The status sent (the first one counts: a stream that fails later keeps its 200)."""
        if not self.status:
            self.status = status
        if error_type is not None and self.error_type is None:
            self.error_type = error_type

    def stage_span(self, name: str, start_ns: int | None = None) -> Span | None:
        """A stage's span (None with tracing off); end it with ``span.end()``."""
        if self.tracing is None or self.trace is None:
            return None
        return self.tracing.start(name, self.trace, start_time=start_ns)

    def finish(self, abort_reason: str | None = None) -> None:
        """The request is over: the access line, and the root span ends."""
        latency = time.perf_counter() - self.arrived
        if abort_reason == "client_disconnected" and self.status == 0:
            self.status, self.error_type = 499, "client_disconnected"
        span = self.span
        if span is not None:
            span.set_attributes({"http.response.status_code": self.status, "pd.stage": self.stage})
            if abort_reason is not None:
                span.set_attribute("pd.abort_reason", abort_reason)
            if self.error_type is not None:
                span.set_attribute("error.type", self.error_type)
            if self.status >= 500 or self.status == 0:
                fail(span, RuntimeError(self.error_type or abort_reason or "no answer"), self.error_type)
            span.end()
        access_log.info(
            "request_id=%s %s status=%d%s stage=%s %.1fms", self.request_id, self.path, self.status,
            f" error={self.error_type}" if self.error_type else "", self.stage, latency * 1e3,
            extra={"fields": {"event": "access", "endpoint": self.path, "status": self.status,
                              "error_type": self.error_type, "stage": self.stage,
                              "latency_ms": round(latency * 1e3, 3)}},
        )
