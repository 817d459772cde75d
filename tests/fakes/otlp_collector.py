"""An in-process OpenTelemetry collector for tests: receives OTLP trace exports over
HTTP/protobuf (``POST /v1/traces``, a real HTTP server on 127.0.0.1) or gRPC (the
``TraceService/Export`` call), decodes them with opentelemetry-proto and keeps the spans.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from pydantic import BaseModel


class CollectedSpan(BaseModel):
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex, as in traceparent
    span_id: str
    parent_span_id: str | None
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 1 internal, 2 server, 3 client
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    start_ns: int
    end_ns: int


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


class OtlpCollector:
    """``start()``, point an exporter at :attr:`http_endpoint` (HTTP/protobuf) or
    :attr:`grpc_endpoint`, read :meth:`spans`; ``stop()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[CollectedSpan] = []
        self.exports = 0
        self._http: ThreadingHTTPServer | None = None
        self._grpc: grpc.Server | None = None
        self._grpc_port = 0

    def ingest(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(CollectedSpan(
                        service=str(resource.get("service.name")), name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex() or None, kind=s.kind,
                        attributes={a.key: _value(a.value) for a in s.attributes}, status_code=s.status.code,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano))
        with self._lock:
            self._spans.extend(spans)
            self.exports += 1

    def spans(self) -> list[CollectedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[list[CollectedSpan]], bool], flush: Callable[[], object],
                 timeout: float = 10.0) -> list[CollectedSpan]:
        """Flush the exporters (``flush``) until the spans received satisfy ``predicate``."""
        deadline = time.monotonic() + timeout
        while True:
            flush()
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans after {timeout}s: {[(s.service, s.name) for s in spans]}")
            time.sleep(0.02)

    # ---- transports ----------------------------------------------------------------------
    @property
    def http_endpoint(self) -> str:
        assert self._http is not None
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self._grpc_port}"

    def start(self) -> OtlpCollector:
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(400, f"unexpected {self.path} {self.headers.get('Content-Type')}")
                    return
                collector.ingest(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method's name
                collector.ingest(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
        self._grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(grace=None)
