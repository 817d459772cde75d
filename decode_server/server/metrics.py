"""Prometheus metrics of one decode server app (its own registry; prefix
``decode_server_``). Counters are updated from worker threads too
(prometheus-client is thread-safe). ``decode_server_build_info`` (value 1, the
:class:`pd_build.info.BuildInfo` fields as labels) says what the server runs; its
``kv_layout`` label is filled in once the engine is loaded."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from connector.protocol import REFUSAL_REASONS
from connector.receiver_state import HANDOFF_BUCKETS, ReceiverStats
from decode_server.server.slots import SlotTable
from pd_build.info import LABELS, BuildInfo
from pd_build.prometheus import DOC as BUILD_INFO_DOC

# steps of <= 0.5 ms around 3 ms (a TPOT target) and <= 25% around 50 ms (a TTFT budget)
_TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
                 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.25, 0.5, 1.0,
                 2.5, 5.0, 10.0, 30.0, 60.0)


class _RecentRate:
    """Output tokens per second over the last ``window`` seconds, all slots together."""

    def __init__(self, window: float = 10.0) -> None:
        self._window = window
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._events.append((now, n))
            self._trim(now)

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._events) / self._window

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self._window:
            self._events.popleft()


class _ReceiverCollector(Collector):
    """The KV receiver's counters (:class:`connector.receiver_state.ReceiverStats`), read at scrape."""

    def __init__(self, stats: Callable[[], ReceiverStats | None], model: str) -> None:
        self._stats, self._model = stats, model

    def describe(self) -> list[Metric]:
        return []  # nothing at registration (the receiver starts later)

    def collect(self) -> list[Metric]:
        stats = self._stats()
        if stats is None:
            return []
        labels = ["model_name"]
        handoffs = CounterMetricFamily("decode_server_kv_handoffs", "KV handoffs received, by outcome (complete: "
                                       "every layer arrived; failed: timed out, aborted, sender gone)",
                                       labels=[*labels, "outcome"])
        handoffs.add_metric([self._model, "complete"], stats.completed)
        handoffs.add_metric([self._model, "failed"], stats.failed)
        received = CounterMetricFamily("decode_server_kv_received_bytes", "KV bytes the completed handoffs wrote",
                                       labels=labels)
        received.add_metric([self._model], stats.bytes_received)
        refusals = CounterMetricFamily("decode_server_kv_refusals", "KV handoffs refused at admission, by reason "
                                       "(busy, too_long, duplicate, cancelled, unknown_peer)",
                                       labels=[*labels, "reason"])
        for reason in REFUSAL_REASONS:
            refusals.add_metric([self._model, reason], stats.refusals.get(reason, 0))
        prefilled = CounterMetricFamily("decode_server_kv_prefilled", "Handoff results (the first token) that "
                                        "came with the KV from the prefill (Prefilled), for decode requests "
                                        "naming only their handoff", labels=labels)
        prefilled.add_metric([self._model], stats.prefilled)
        took = HistogramMetricFamily("decode_server_kv_handoff_seconds", "Admission of a KV handoff until its "
                                     "every layer arrived (completed handoffs)", labels=labels)
        cumulative = list(itertools.accumulate(stats.handoff_counts))
        bounds = [*(f"{b:g}" for b in HANDOFF_BUCKETS), "+Inf"]
        took.add_metric([self._model], list(zip(bounds, cumulative)), stats.handoff_seconds)
        tokens = CounterMetricFamily("decode_server_kv_handoff_tokens", "Prompt tokens of the completed handoffs, "
                                     "by how their KV came: pushed (written by the prefill) or reused (kept in the "
                                     "slot from the conversation's last turn, not moved)", labels=[*labels, "kv"])
        tokens.add_metric([self._model, "pushed"], stats.pushed_tokens)
        tokens.add_metric([self._model, "reused"], stats.reused_tokens)
        reusing = CounterMetricFamily("decode_server_kv_reused_handoffs", "Completed handoffs that reused KV kept "
                                      "in their slot (a share of decode_server_kv_handoffs{outcome=\"complete\"})",
                                      labels=labels)
        reusing.add_metric([self._model], stats.reused_handoffs)
        saved = CounterMetricFamily("decode_server_kv_reused_bytes", "KV bytes the completed handoffs did not move: "
                                    "their reused tokens' KV, every layer", labels=labels)
        saved.add_metric([self._model], stats.bytes_reused)
        return [handoffs, received, refusals, prefilled, took, tokens, reusing, saved]


class _SlotCollector(Collector):
    def __init__(self, table: SlotTable) -> None:
        self._table = table

    def collect(self) -> Iterable[Metric]:
        t = self._table
        yield CounterMetricFamily("decode_server_slot_grants", "Decode requests given their slot (at once or "
                                  "after a wait in the queue)", value=t.grants)
        refusals = CounterMetricFamily("decode_server_slot_refusals", "Decode requests refused a slot, by reason "
                                       "(timeout, queue_full, duplicate, closed, cancelled)", labels=["reason"])
        for reason, n in sorted(t.refusals.items()):
            refusals.add_metric([reason], n)
        yield refusals
        yield GaugeMetricFamily("decode_server_slot_queue", "Decode requests waiting for a slot", value=t.queued)
        yield GaugeMetricFamily("decode_server_free_slots", "Slots nobody holds (no decode request, KV or "
                                "generation)", value=t.free)


class DecodeMetrics:
    """``model``: the served model name (the ``model_name`` label, as on vLLM's ``vllm:*``)."""

    def __init__(self, busy_slots: Callable[[], int], slots: int, build: BuildInfo, model: str = "",
                 receiver_stats: Callable[[], ReceiverStats | None] = lambda: None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        m = ["model_name"]
        self._build = Gauge("decode_server_build_info", BUILD_INFO_DOC, list(LABELS), registry=r)
        self.set_build(build)
        self.requests = Counter("decode_server_requests", "Requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("decode_server_errors", "Errors by type (the OpenAI error.type)", ["error_type"],
                              registry=r)
        self.tokens = Counter("decode_server_generation_tokens", "Output tokens sent (the first token included)",
                              m, registry=r).labels(model)
        self.prompt_tokens = Counter("decode_server_prompt_tokens", "Prompt tokens of the requests decoded here "
                                     "(counted at their first token)", m, registry=r).labels(model)
        self.tpot = Histogram("decode_server_time_per_output_token_seconds",
                              "Engine step time divided by the tokens it produced", m, buckets=_TPOT_BUCKETS,
                              registry=r).labels(model)
        self.kv_wait = Histogram("decode_server_kv_wait_seconds", "Time from request arrival until its KV was complete",
                                 m, buckets=_WAIT_BUCKETS, registry=r).labels(model)
        self.drafted = Counter("decode_server_mtp_drafted_tokens", "MTP draft tokens proposed", m,
                               registry=r).labels(model)
        self.accepted = Counter("decode_server_mtp_accepted_tokens", "MTP draft tokens accepted", m,
                                registry=r).labels(model)
        self.cancelled = Counter("decode_server_cancelled", "Generations stopped early, by reason", ["reason"],
                                 registry=r)
        self._rate = _RecentRate()
        self._spec_lock = threading.Lock()
        self._spec_totals = (0, 0)
        Gauge("decode_server_tokens_per_second", "Output tokens per second over the last 10 s, all slots",
              registry=r).set_function(self._rate.rate)
        Gauge("decode_server_mtp_acceptance_rate", "Accepted / drafted MTP tokens since start",
              registry=r).set_function(self._acceptance)
        Gauge("decode_server_busy_slots", "Slots holding a sequence", registry=r).set_function(busy_slots)
        Gauge("decode_server_slots", "Configured slots", registry=r).set(slots)
        r.register(_ReceiverCollector(receiver_stats, model))
        self.slot_wait = Histogram("decode_server_slot_wait_seconds", "Time from a decode request's arrival to "
                                   "its slot", buckets=_WAIT_BUCKETS, registry=r)

    def watch_slots(self, table: SlotTable) -> None:
        """Report the slot table's counts (it keeps them: it is the authority on its slots)."""
        self.registry.register(_SlotCollector(table))

    def set_build(self, build: BuildInfo) -> None:
        """Report ``build`` (replacing what was reported before)."""
        self._build.clear()
        self._build.labels(**build.labels()).set(1)

    def _acceptance(self) -> float:
        with self._spec_lock:
            drafted, accepted = self._spec_totals
        return accepted / drafted if drafted else 0.0

    def step(self, n_tokens: int, seconds: float) -> None:
        if n_tokens:
            self.tokens.inc(n_tokens)
            self._rate.add(n_tokens)
            self.tpot.observe(seconds / n_tokens)

    def first_token(self, prompt_tokens: int) -> None:
        self.tokens.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self._rate.add(1)

    def spec(self, drafted: int, accepted: int) -> None:
        if drafted:
            with self._spec_lock:
                self._spec_totals = (self._spec_totals[0] + drafted, self._spec_totals[1] + accepted)
            self.drafted.inc(drafted)
            self.accepted.inc(accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
