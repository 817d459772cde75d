"""Prometheus metrics of one router app, on its own registry (no global registry)."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pd_build import prometheus as build_prometheus
from pd_build.info import BuildInfo
from pd_router.fleet.kept import AFFINITY_OUTCOMES

PREFIX = "pd_router_"
# latencies of a request or a stage: steps of <= 25% around 50 ms (a TTFT SLO), wider beyond 1 s
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1,
                   0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60, 120, 300)
# time between tokens: steps of <= 0.5 ms around 3 ms (a TPOT target)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02,
                 0.03, 0.05, 0.1, 0.25, 1, 5)


M = TypeVar("M", bound=MetricWrapperBase)
# pd_router_migrations_total's labels (docs/reliability.md, "A decode server lost mid-answer")
MIGRATION_REASONS = ("connection_lost", "stalled", "error_event")
MIGRATION_OUTCOMES = ("resumed", "failed", "limit", "not_resumable")
PRIORITY_LABELS = 16  # priorities beyond +-16 share a label (lt-16, gt16)


class TokenHistogram(Collector):
    """An unlabelled histogram whose ``observe`` is one bisect and one add: it runs once
    per relayed chunk, where prometheus_client's Histogram (a lock and a Python loop over
    the buckets) costs about 1.5 us more. Only touched from the event loop's thread."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.name, self.doc = name, doc
        self._bounds = [*buckets, math.inf]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.doc)]

    def collect(self) -> list[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.doc)
        cumulative = list(accumulate(self._counts))
        family.add_metric(
            [],
            [(floatToGoString(b), c) for b, c in zip(self._bounds, cumulative, strict=True)],
            sum_value=self._sum,
        )
        return [family]


def priority_label(priority: int) -> str:
    """A priority as a metrics label: bounded in number."""
    if priority < -PRIORITY_LABELS:
        return f"lt-{PRIORITY_LABELS}"
    if priority > PRIORITY_LABELS:
        return f"gt{PRIORITY_LABELS}"
    return str(priority)


@dataclass(frozen=True)
class ServerView:
    """What the router's server gauges report: its state when ``/metrics`` is read."""

    queue_depth: int = 0
    decode_free: dict[str, float] = field(default_factory=dict)  # decode server -> free slots (+Inf: unlimited)
    healthy: dict[tuple[str, str], bool] = field(default_factory=dict)  # (role, server) -> usable
    servers: dict[tuple[str, str], int] = field(default_factory=dict)  # (role, state) -> how many
    tenant_depth: dict[tuple[str, str], int] = field(default_factory=dict)  # (tenant, priority) -> waiting


class ServerGauges(Collector):
    """The gauges of the router's queue and servers, computed from its state when scraped:
    a slot taken or given back (every request, several times) then costs nothing here, where
    setting each server's gauges on every change cost O(servers) per change (135 us with
    72 decode servers). A server no longer listed is simply not reported."""

    def __init__(self, read: Callable[[], ServerView], registry: CollectorRegistry) -> None:
        self._read = read
        registry.register(self)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily(PREFIX + "queue_depth", "Requests waiting for a decode slot"),
            GaugeMetricFamily(PREFIX + "decode_free_slots", "Free decode slots (+Inf: unlimited)",
                              labels=("backend",)),
            GaugeMetricFamily(PREFIX + "backend_healthy", "1 if the backend is healthy (and compatible)",
                              labels=("role", "backend")),
            GaugeMetricFamily(PREFIX + "backends",
                              "Servers in the router's lists by role and state (ready, unhealthy, draining)",
                              labels=("role", "state")),
            GaugeMetricFamily(PREFIX + "tenant_queue_depth",
                              "Requests waiting for a decode slot by tenant (the keys file's names, default, "
                              "other) and priority (-16..16, else lt-16 / gt16); each tenant's priority 0 always",
                              labels=("tenant", "priority")),
        )

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self._families())

    def collect(self) -> list[GaugeMetricFamily]:
        view = self._read()
        depth, free, healthy, servers, tenant_depth = self._families()
        depth.add_metric([], float(view.queue_depth))
        for url, n in view.decode_free.items():
            free.add_metric([url], float(n))
        for (role, url), ok in view.healthy.items():
            healthy.add_metric([role, url], 1.0 if ok else 0.0)
        for (role, state), n in view.servers.items():
            servers.add_metric([role, state], float(n))
        for (tenant, priority), n in view.tenant_depth.items():
            tenant_depth.add_metric([tenant, priority], float(n))
        return [depth, free, healthy, servers, tenant_depth]


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, build: BuildInfo, servers: Callable[[], ServerView] = ServerView) -> None:
        """``servers``: reads the router's queue and servers for their gauges, at each scrape."""
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        build_prometheus.register(self.registry, PREFIX + "build_info", build)
        em = ("endpoint", "model_name")  # model_name: a served model's name, "" before the model was known
        self.requests = self._counter("requests", "Completed requests", (*em, "status", "error_type"))
        self.ttft = self._histogram("time_to_first_token_seconds", "Arrival to first decode byte", em)
        self.itl = TokenHistogram(
            PREFIX + "inter_token_latency_seconds", "Between two relayed decode chunks", TOKEN_BUCKETS, self.registry
        )
        self.tpot = self._histogram(
            "time_per_output_chunk_seconds",
            "Per streamed request: (last decode chunk - first) / (chunks - 1); the TPOT when each chunk "
            "carries one token (one engine step without MTP)", em, TOKEN_BUCKETS,
        )
        self.e2e = self._histogram("e2e_latency_seconds", "Request arrival to last byte", em)
        self.prompt_tokens = self._counter(
            "prompt_tokens", "Prompt tokens of the requests prefilled (as prefill counted them), once per request",
            em,
        )
        self.queue_wait = self._histogram("queue_wait_seconds", "Time waiting for a decode slot")
        self.tenant_queue_wait = self._histogram(
            "tenant_queue_wait_seconds", "A request's wait for its first decode slot by tenant (the keys file's "
            "names, default, other) and priority (-16..16, else lt-16 / gt16)", ("tenant", "priority"))
        self.prefill_latency = self._histogram("prefill_latency_seconds", "Prefill request round trip")
        self.in_flight = self._gauge("in_flight_requests", "Requests being served")
        ServerGauges(servers, self.registry)
        self.client_aborts = self._counter("client_aborts", "Clients that left before the end", ("stage",))
        self.upstream_errors = self._counter(
            "upstream_errors", "Failed upstream calls", ("role", "backend", "error_type")
        )
        self.busy_requeues = self._counter(
            "busy_requeues",
            "Requests that waited for a decode slot again because the server of their slot was busy "
            "(reason kv_receive_slot: prefill's KV refused at admission; engine_slot: decode 429 from a server "
            "the router counts)",
            ("backend", "reason"),
        )
        self.retries = self._counter(
            "retries", "Retries of a request before its first byte, by reason (each bounded, docs/router.md): "
            "failover (decode failed: once, on another server), kv_receive_slot / engine_slot (busy: back to "
            "the queues, at most 16 times), stale_handoff_id (the id still known there: once, under a new id), "
            "prefill_unreachable (once, on another prefill server)", ("reason",),
        )
        self.failovers = self._counter(
            "decode_failovers",
            "Requests run again on another decode server because theirs failed before the first byte",
            ("backend", "error_type"),
        )
        self.migrations = self._counter(
            "migrations", "Answers whose decode server was lost after the answer began (reason connection_lost, "
            "stalled: no token for --stall-timeout, error_event: the server's own failure), by outcome (resumed: "
            "on another decode server; failed: no server resumed it, the answer ended with an error event; "
            "limit: --max-migrations reached; not_resumable: the request cannot move, docs/reliability.md)",
            ("reason", "outcome"),
        )
        for reason in MIGRATION_REASONS:  # every series from the start: a dashboard's rate() has them at 0
            for outcome in MIGRATION_OUTCOMES:
                self.child(self.migrations, reason, outcome)
        self.migration_seconds = self._histogram(
            "migration_seconds", "Time a migration added: from the decode server found lost to the first output "
            "of the one that resumed the answer",
        )
        self.decode_affinity = self._counter(
            "decode_affinity", "Requests with conversation keys by how the KV kept for their conversation chose "
            "the decode server their first decode request asked at once (kept_server_free: a server keeping a "
            "prefix of it, with a free slot; kept_server_busy: a server keeps one, none of them had a free slot; "
            "none: no server keeps one)", ("outcome",),
        )
        self.prefill_affinity = self._counter(
            "prefill_affinity", "Prefills of requests with conversation keys by how the prefill server of their "
            "conversation's last turn chose theirs (kept_server_free: that server; kept_server_busy: that one "
            "was loaded past --prefill-affinity-slack or not eligible; none: no turn of it recorded)", ("outcome",),
        )
        for outcome in AFFINITY_OUTCOMES:
            self.child(self.decode_affinity, outcome)
            self.child(self.prefill_affinity, outcome)
        self.slot_rtt = self._histogram(
            "slot_rtt_seconds", "Round trip of a decode request given a free slot at once (its 200, without a "
            "wait in the server's queue)", buckets=TOKEN_BUCKETS,
        )
        self.slot_requests = self._counter(
            "slot_requests", "Decode requests asking a decode server for a slot (at once, or waiting in its "
            "queue) by answer (granted; refused: no slot within the wait; conflict; unavailable; rejected: the "
            "request itself refused; error: no answer)", ("backend", "result"),
        )
        self.draining = self._gauge("draining", "1 while the router drains (SIGTERM): new requests get 503")

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(PREFIX + name, doc, labels, registry=self.registry)

    def _histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS
    ) -> Histogram:
        return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)``, cached: prometheus_client's lookup costs microseconds
        (a lock and validation) and sits on every request's path."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
