"""docs/metrics.md names every metric the router and the decode server expose, and names none
of theirs that they do not (the connector's ``vllm:tilert_*``, which only vLLM can expose,
are checked on the real vLLM by tests/observability/test_stack_observability.py); and the
latency histograms have buckets fine enough around a 50 ms TTFT and a 3 ms TPOT."""

from __future__ import annotations

import re
from pathlib import Path

from connector.receiver_state import ReceiverStats
from decode_server.server.metrics import DecodeMetrics
from decode_server.server.slots import SlotTable
from pd_build.info import BuildInfo, collect
from pd_router.metrics import RouterMetrics

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def exposed(text: str, prefix: str = "") -> set[str]:
    """The metric names of a /metrics page (its TYPE lines), as a query names them: counters
    with ``_total``, histograms without their suffixes; prometheus-client's ``*_created``
    series (its creation timestamps) left out."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            if name.startswith(prefix) and not name.endswith("_created"):
                names.add(name)
    return names


def documented(prefix: str) -> set[str]:
    """The metric names with ``prefix`` that docs/metrics.md names in backticks."""
    found = re.findall(rf"`({re.escape(prefix)}[a-z0-9_:]+)", DOC.read_text())
    return {name for name in found if not name.endswith("_")}  # not a family (`vllm:tilert_kv_*`)


def _build() -> BuildInfo:
    return collect("router")


def test_every_router_metric_is_documented_and_nothing_else():
    names = exposed(RouterMetrics(_build()).render().decode())
    assert names and all(n.startswith("pd_router_") for n in names)
    assert names - documented("pd_router_") == set(), "exposed, not in docs/metrics.md"
    assert documented("pd_router_") - names == set(), "in docs/metrics.md, not exposed"


def test_every_decode_server_metric_is_documented_and_nothing_else():
    metrics = DecodeMetrics(lambda: 0, 2, _build(), "m", lambda: ReceiverStats())
    metrics.watch_slots(SlotTable(2, 16))
    names = exposed(metrics.render().decode())
    assert {"decode_server_kv_refusals_total", "decode_server_kv_received_bytes_total"} <= names
    assert names - documented("decode_server_") == set(), "exposed, not in docs/metrics.md"
    assert documented("decode_server_") - names == set(), "in docs/metrics.md, not exposed"


def test_exposed_reads_type_lines():
    text = "# HELP a_total x\n# TYPE a_total counter\na_total 1.0\n# TYPE a_created gauge\n# TYPE b histogram\n"
    assert exposed(text) == {"a_total", "b"} and exposed(text, "b") == {"b"}


def _bounds(text: str, histogram: str) -> list[float]:
    return sorted(float(le) for le in re.findall(rf'^{histogram}_bucket{{.*le="([^"]+)"', text, re.M)
                  if le != "+Inf")


def _resolves(bounds: list[float], value: float, step: float) -> bool:
    """A bound at ``value`` or just below, and the next one at most ``step`` (relative) above."""
    below = [b for b in bounds if b <= value * (1 + 1e-9)]
    above = [b for b in bounds if b > value * (1 + 1e-9)]
    return bool(below and above) and below[-1] >= value / (1 + step) and above[0] <= value * (1 + step)


def test_buckets_resolve_a_3_ms_tpot_and_a_50_ms_ttft():
    router = RouterMetrics(_build())
    router.child(router.ttft, "completions", "m").observe(0.05)
    router.child(router.e2e, "completions", "m").observe(0.05)
    router.child(router.tpot, "completions", "m").observe(0.003)
    router.itl.observe(0.003)
    text = router.render().decode()
    decode = DecodeMetrics(lambda: 0, 2, _build(), "m")
    decode.step(1, 0.003)
    decode.kv_wait.observe(0.05)
    text += decode.render().decode()
    for histogram, value in (("pd_router_time_to_first_token_seconds", 0.05), ("pd_router_e2e_latency_seconds", 0.05),
                             ("pd_router_queue_wait_seconds", 0.05), ("decode_server_kv_wait_seconds", 0.05)):
        assert _resolves(_bounds(text, histogram), value, 0.25), histogram
    for histogram in ("pd_router_time_per_output_chunk_seconds", "pd_router_inter_token_latency_seconds",
                      "decode_server_time_per_output_token_seconds"):
        assert _resolves(_bounds(text, histogram), 0.003, 0.2), histogram
    assert not _resolves([0.025, 0.05, 0.1], 0.05, 0.25)  # the router's old latency buckets did not
