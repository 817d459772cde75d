"""The connector's figures on vLLM's own channel: each worker's counters travel with the step's
output as KV-connector stats (``get_kv_connector_stats``), vLLM sums them over ranks and
steps and hands them to :class:`TileRTPromMetrics`, which counts them on the prefill
server's ``/metrics`` next to ``vllm:*``:

* ``vllm:tilert_kv_handoffs_total{outcome}``: handoffs whose last step ran, by outcome
  at the end of that step ("posted": every layer gathered and posted or about to be,
  "failed");
* ``vllm:tilert_kv_layers_total{path}``: layers gathered on the early path
  (``save_kv_layer``, as vLLM computed each) and on the late path (``wait_for_save`` or a
  later step; vLLM 0.32's CUDA path for GLM-5.1 is all late).

Imports vLLM: loaded by :mod:`connector.tilert_connector` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS = ("handoffs_posted", "handoffs_failed", "layers_early", "layers_late")


@dataclass
class TileRTKVStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in COUNTERS:
            self.data[key] = int(self.data.get(key, 0)) + int(other.data.get(key, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: int(self.data.get(key, 0)) for key in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in COUNTERS)


class TileRTPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        handoffs = self._counter_cls(
            name="vllm:tilert_kv_handoffs",
            documentation="KV handoffs to decode servers whose prompt was computed, by outcome at the end of "
            "that step (posted: every layer on its way; failed)",
            labelnames=[*labelnames, "outcome"],
        )
        layers = self._counter_cls(
            name="vllm:tilert_kv_layers",
            documentation="KV layers handed off, by gathering path: early (save_kv_layer, as vLLM computed "
            "each layer) or late (wait_for_save or a later step)",
            labelnames=[*labelnames, "path"],
        )
        self._children = {
            idx: {
                "handoffs_posted": handoffs.labels(*values, "posted"),
                "handoffs_failed": handoffs.labels(*values, "failed"),
                "layers_early": layers.labels(*values, "early"),
                "layers_late": layers.labels(*values, "late"),
            }
            for idx, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        children = self._children.get(engine_idx)
        if children is None:
            return
        for key, child in children.items():
            value = int(transfer_stats_data.get(key, 0))
            if value:
                child.inc(value)  # type: ignore[union-attr]  # counters, made by vLLM's _counter_cls
