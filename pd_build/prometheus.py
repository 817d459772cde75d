"""The ``<namespace>_build_info`` gauge (value 1, the :class:`~pd_build.info.BuildInfo`
fields as labels: the Prometheus convention) and reading it back from a ``/metrics`` text."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from pd_build.info import LABELS, BuildInfo

DOC = "Versions of what this process runs (tilert-pd, git revision, vLLM, NIXL, UCX, torch, CUDA, TileRT), " \
      "its KV layout fingerprint, model and config.json checksum; always 1"


def register(registry: CollectorRegistry, name: str, info: BuildInfo) -> Gauge:
    """``name`` (e.g. ``pd_router_build_info``) on ``registry``, set to 1 for ``info``."""
    labels = info.labels()
    gauge = Gauge(name, DOC, list(labels), registry=registry)
    gauge.labels(**labels).set(1)
    return gauge


def parse(text: str) -> dict[str, list[BuildInfo]]:
    """Every ``*_build_info`` sample of a Prometheus text whose labels make a
    :class:`BuildInfo`, by metric name (other labels, e.g. vLLM's ``engine``, are dropped)."""
    found: dict[str, list[BuildInfo]] = {}
    fields = set(LABELS)
    for family in text_string_to_metric_families(text):
        if not family.name.endswith("_build_info"):
            continue
        for sample in family.samples:
            if sample.value != 1 or not fields <= set(sample.labels):
                continue
            info = BuildInfo.model_validate({k: v for k, v in sample.labels.items() if k in fields})
            if info not in found.setdefault(sample.name, []):
                found[sample.name].append(info)
    return found
