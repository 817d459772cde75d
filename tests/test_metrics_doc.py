"""docs/metrics.md names every metric the router and the decode server expose, and names none
of theirs that they do not (the connector's ``vllm:tilert_*``, which only vLLM can expose,
are checked on the real vLLM by tests/observability/test_stack_observability.py)."""

from __future__ import annotations

import re
from pathlib import Path

from connector.receiver_state import ReceiverStats
from decode_server.server.metrics import DecodeMetrics
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
    return set(re.findall(rf"`({re.escape(prefix)}[a-z0-9_:]+)", DOC.read_text()))


def _build() -> BuildInfo:
    return collect("router")


def test_every_router_metric_is_documented_and_nothing_else():
    names = exposed(RouterMetrics(_build()).render().decode())
    assert names and all(n.startswith("pd_router_") for n in names)
    assert names - documented("pd_router_") == set(), "exposed, not in docs/metrics.md"
    assert documented("pd_router_") - names == set(), "in docs/metrics.md, not exposed"


def test_every_decode_server_metric_is_documented_and_nothing_else():
    metrics = DecodeMetrics(lambda: 0, 2, _build(), "m", lambda: ReceiverStats())
    names = exposed(metrics.render().decode())
    assert {"decode_server_kv_refusals_total", "decode_server_kv_received_bytes_total"} <= names
    assert names - documented("decode_server_") == set(), "exposed, not in docs/metrics.md"
    assert documented("decode_server_") - names == set(), "in docs/metrics.md, not exposed"


def test_exposed_reads_type_lines():
    text = "# HELP a_total x\n# TYPE a_total counter\na_total 1.0\n# TYPE a_created gauge\n# TYPE b histogram\n"
    assert exposed(text) == {"a_total", "b"} and exposed(text, "b") == {"b"}
