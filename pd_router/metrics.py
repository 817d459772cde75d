"""Prometheus metrics of one router app, on its own registry (no global registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 1, 5)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        p = "pd_router_"
        self.requests = Counter(p + "requests", "Completed requests", ["endpoint", "status", "error_type"],
                                registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Request arrival to first decode byte",
                              ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between two relayed decode chunks",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_latency_seconds", "Request arrival to last byte", ["endpoint"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram(p + "queue_wait_seconds", "Time waiting for a decode slot",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_latency = Histogram(p + "prefill_latency_seconds", "Prefill request round trip",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for a decode slot", registry=r)
        self.in_flight = Gauge(p + "in_flight_requests", "Requests being served", registry=r)
        self.free_slots = Gauge(p + "decode_free_slots", "Free decode slots (+Inf: unlimited)", ["backend"],
                                registry=r)
        self.backend_healthy = Gauge(p + "backend_healthy", "1 if the backend is healthy (and compatible)",
                                     ["role", "backend"], registry=r)
        self.client_aborts = Counter(p + "client_aborts", "Clients that disconnected before the end",
                                     ["stage"], registry=r)
        self.upstream_errors = Counter(p + "upstream_errors", "Failed upstream calls",
                                       ["role", "backend", "error_type"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
