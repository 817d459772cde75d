"""OpenTelemetry tracing for the router and the decode server: one tracer provider per
app (never the process-global one), exporting over OTLP, built only when an endpoint is
configured (``--otlp-traces-endpoint``). With no endpoint nothing here is imported by the
serving code's hot path: the apps hold ``None`` and create no span objects.

The span context travels between processes in the W3C ``traceparent`` header: the
router sends it on the prefill request (vLLM with ``--otlp-traces-endpoint`` parents its
own request span on it) and on the decode request (the decode server parents its spans on
it), so one request is one trace across the three processes (docs/observability.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider

OtlpProtocol = Literal["grpc", "http/protobuf"]
OTLP_PROTOCOLS: tuple[OtlpProtocol, ...] = ("grpc", "http/protobuf")
TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()  # stateless

__all__ = ["OTLP_PROTOCOLS", "TRACEPARENT", "OtlpProtocol", "Span", "SpanKind", "Tracing", "check_endpoint",
           "fail", "otlp_tracing", "span_ids"]


def check_endpoint(url: str) -> str:
    """An OTLP endpoint URL as the settings accept it: http(s)://host:port[/path]."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host (e.g. http://127.0.0.1:4317)")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r} has an invalid port") from exc
    return url


class Tracing:
    """One app's tracer: spans with explicit parents (no implicit current context), the
    ``traceparent`` header in and out, and flushing at shutdown."""

    def __init__(self, provider: TracerProvider, scope: str) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(scope)

    def start(self, name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
              attributes: Mapping[str, AttributeValue] | None = None, start_time: int | None = None) -> Span:
        """A span (end it with :func:`finish` or ``span.end()``); ``start_time`` in ns since the epoch."""
        return self.tracer.start_span(name, context=parent, kind=kind, attributes=attributes,
                                      start_time=start_time)

    @contextlib.contextmanager
    def span(self, name: str, parent: Context | None, kind: SpanKind = SpanKind.INTERNAL,
             attributes: Mapping[str, AttributeValue] | None = None) -> Iterator[Span]:
        """A child span around a block; an exception marks it failed (``error.type``)."""
        span = self.start(name, parent, kind, attributes)
        try:
            yield span
        except BaseException as exc:
            fail(span, exc)
            raise
        finally:
            span.end()

    @staticmethod
    def extract(headers: Iterable[tuple[bytes, bytes]]) -> Context | None:
        """The parent context a request's ``traceparent`` header names (ASGI raw headers);
        None when it has none or it is invalid (the request then starts a trace)."""
        for key, value in headers:
            if key == b"traceparent":
                ctx = _PROPAGATOR.extract({TRACEPARENT: value.decode("latin-1")})
                return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None
        return None

    @staticmethod
    def context(span: Span) -> Context:
        """The context whose parent is ``span`` (for its children)."""
        return trace.set_span_in_context(span)

    @staticmethod
    def headers(span: Span) -> dict[str, str]:
        """``{"traceparent": ...}`` naming ``span`` as the parent of the callee's spans."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def force_flush(self, timeout_ms: int = 10_000) -> bool:
        return self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        self.provider.shutdown()


def fail(span: Span, exc: BaseException, error_type: str | None = None) -> None:
    """Mark ``span`` failed by ``exc`` (``error.type``: ``error_type``, else the exception's
    ``type`` attribute (the OpenAI error type of our errors), else its class name)."""
    kind = error_type or getattr(exc, "type", None)
    span.set_attribute("error.type", kind if isinstance(kind, str) else type(exc).__name__)
    span.set_status(Status(StatusCode.ERROR, str(exc)[:200] or type(exc).__name__))


def span_ids(span: Span) -> tuple[str, str]:
    """(trace id, span id) in hex, as OTLP and the logs write them."""
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def otlp_tracing(endpoint: str, protocol: OtlpProtocol, service_name: str,
                 resource: Mapping[str, str] | None = None) -> Tracing:
    """A :class:`Tracing` exporting in batches to ``endpoint`` (gRPC: ``http://host:4317``,
    plaintext for ``http://``; HTTP/protobuf: ``http://host:4318``, path ``/v1/traces`` unless
    the URL has one). The exporters also read the standard ``OTEL_EXPORTER_OTLP_*``
    variables (headers, certificates, compression)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    exporter: SpanExporter
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter(endpoint=endpoint, insecure=urlsplit(endpoint).scheme == "http")
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        url = endpoint if urlsplit(endpoint).path.strip("/") else endpoint.rstrip("/") + "/v1/traces"
        exporter = HttpExporter(endpoint=url)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name, **(resource or {})}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider, service_name)

