"""The connector's figures on vLLM's own channel: each worker's counters travel with the step's
output as KV-connector stats (``get_kv_connector_stats``), vLLM sums them over ranks and
steps and hands them to :class:`TileRTPromMetrics`, which counts them on the prefill
server's ``/metrics`` next to ``vllm:*``:

* ``vllm:tilert_kv_handoffs_total{outcome}``: handoffs whose last step ran, by outcome
  at the end of that step ("posted": every layer gathered and posted or about to be,
  "failed");
* ``vllm:tilert_kv_layers_total{path}``: layers gathered on the early path
  (``save_kv_layer``, as vLLM computed each) and on the late path (``wait_for_save`` or a
  later step; vLLM 0.32's CUDA path for GLM-5.1 is all late);
* ``vllm:tilert_kv_posted_bytes_total``: KV bytes of the handoffs posted;
* ``vllm:tilert_kv_failures_total{reason}``: handoffs the workers failed, by reason
  (``FailureReason``: mostly ``transfer`` and ``internal``; an Admit refused never reaches
  a worker and is counted by the decode server that refused it);
* ``vllm:tilert_kv_post_seconds``: histogram, per handoff and rank, from the start of the
  step computing the prompt's last token to its last layer posted (the tail the handoff
  adds to prefill; the transfer itself lands on the decode server's
  ``decode_server_kv_wait_seconds``);
* ``vllm:tilert_kv_transport_bytes_total{transport}``: KV bytes of the handoffs that landed,
  by what carried their WRITEs (the UCX transport UCX chose, e.g. ``rc_mlx5/mlx5_0:1``,
  ``tcp/eth0``, ``cma/memory``; ``unknown`` when UCX did not say: ``connector.transport.ucx_proto``),
  counted at the first step vLLM runs after they landed (a handoff's WRITEs usually land after
  the step that computed its prompt: an idle server counts them at its next request);
* ``vllm:tilert_kv_write_seconds{transport}``: histogram, per handoff and rank, from its first
  WRITE posted to its last landed; a handoff's bandwidth is its bytes over this, the mean
  ``rate(..._transport_bytes_total) / rate(..._write_seconds_sum)`` (on the early path the
  WRITEs wait for vLLM's layers, so this is a lower bound of the link's);
* ``vllm:tilert_build_info{<BuildInfo fields>}``: 1, labelled with what the prefill server
  runs (:class:`pd_build.info.BuildInfo`: tilert-pd and its git revision, vLLM, NIXL, UCX,
  torch, CUDA, the KV layout fingerprint, the served model and its config.json checksum),
  set once when vLLM builds these metrics in its API server.

Imports vLLM: loaded by :mod:`connector.tilert_connector` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, get_args

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from connector.config import load_settings
from connector.profiles import resolve_profile
from connector.worker import POST_SECONDS, STAT_COUNTERS, WRITES
from pd_build.info import BuildInfo, collect
from pd_wire.handoff import FailureReason

BUILD_INFO = "vllm:tilert_build_info"
FAILURE_REASONS: tuple[str, ...] = get_args(FailureReason)
# a step's start to its last layer posted: the prefill tail the handoff adds (ms on a GPU)
POST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
                2.5, 5.0, 10.0)
# a handoff's WRITEs, first posted to last landed: 1k-8k tokens of GLM-5.1 (61-486 MiB) over
# 10-50 GB/s RDMA is milliseconds, over TCP up to seconds
WRITE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, 10.0, 30.0)


def prefill_build_info(vllm_config: Any) -> BuildInfo:
    """The prefill server's build info: its served model name, the config.json of the model
    directory vLLM loads (when local) and the KV layout of the connector's profile."""
    model = vllm_config.model_config
    settings = load_settings(vllm_config.kv_transfer_config.kv_connector_extra_config)
    layout = resolve_profile(settings.profile, model.hf_config, model.dtype).layout
    served = model.served_model_name
    name = served[0] if isinstance(served, list | tuple) else served
    return collect("prefill", model=str(name or model.model), model_dir=model.model, kv_layout=layout.fingerprint())


@dataclass
class TileRTKVStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in STAT_COUNTERS:
            self.data[key] = int(self.data.get(key, 0)) + int(other.data.get(key, 0))
        for key in (POST_SECONDS, WRITES):
            self.data[key] = [*self.data.get(key, ()), *other.data.get(key, ())]
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {key: int(self.data.get(key, 0)) for key in STAT_COUNTERS}
        posts = self.data.get(POST_SECONDS) or []
        reduced["post_seconds_max"] = max(posts, default=0.0)
        for carrier, nbytes, _ in self.data.get(WRITES) or ():
            key = f"bytes_over_{carrier}"
            reduced[key] = int(reduced.get(key, 0)) + int(nbytes)
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in (*STAT_COUNTERS, POST_SECONDS, WRITES))


class TileRTPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        def counter(name: str, doc: str, *extra: str) -> Any:
            return self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, *extra])

        handoffs = counter("vllm:tilert_kv_handoffs", "KV handoffs to decode servers whose prompt was computed, by "
                           "outcome at the end of that step (posted: every layer on its way; failed)", "outcome")
        layers = counter("vllm:tilert_kv_layers", "KV layers handed off, by gathering path: early (save_kv_layer, "
                         "as vLLM computed each layer) or late (wait_for_save or a later step)", "path")
        posted = counter("vllm:tilert_kv_posted_bytes", "KV bytes posted to decode servers (the layers of the "
                         "handoffs posted)")
        failures = counter("vllm:tilert_kv_failures", "KV handoffs that failed after admission, by reason "
                           "(transfer, internal, ...; a refusal at admission is counted by the decode server that "
                           "refused: decode_server_kv_refusals_total)", "reason")
        post = self._histogram_cls(  # type: ignore[call-arg]  # a Histogram: vLLM's _histogram_cls
            name="vllm:tilert_kv_post_seconds",
            documentation="Per handoff and rank: from the start of the step computing the prompt's last token "
            "to its last KV layer posted",
            labelnames=labelnames,
            buckets=POST_BUCKETS,
        )
        self._transport_bytes = counter(
            "vllm:tilert_kv_transport_bytes", "KV bytes of the handoffs that landed, by what carried their WRITEs "
            "(the UCX transport, e.g. rc_mlx5/mlx5_0:1, tcp/eth0, cma/memory; unknown: UCX did not say)", "transport")
        self._write_seconds: Any = self._histogram_cls(  # type: ignore[call-arg]  # a Histogram: vLLM's _histogram_cls
            name="vllm:tilert_kv_write_seconds",
            documentation="Per handoff and rank: from its first KV WRITE posted to its last landed, by what "
            "carried them (bandwidth: bytes over this)",
            labelnames=[*labelnames, "transport"],
            buckets=WRITE_BUCKETS,
        )
        self._labelvalues = per_engine_labelvalues  # engine -> its label values (the transports' children come later)
        info = prefill_build_info(vllm_config).labels()
        build = self._gauge_cls(  # type: ignore[call-arg]  # a Gauge: vLLM's _gauge_cls
            name=BUILD_INFO,
            documentation="Versions of what this prefill server runs (tilert-pd, git revision, vLLM, NIXL, UCX, "
            "torch, CUDA), its KV layout fingerprint, model and config.json checksum; always 1",
            labelnames=[*labelnames, *info],
            multiprocess_mode="mostrecent",
        )
        for values in per_engine_labelvalues.values():
            build.labels(*values, *info.values()).set(1)  # type: ignore[union-attr]  # vLLM's _gauge_cls
        self._children = {
            idx: {
                "handoffs_posted": handoffs.labels(*values, "posted"),
                "handoffs_failed": handoffs.labels(*values, "failed"),
                "layers_early": layers.labels(*values, "early"),
                "layers_late": layers.labels(*values, "late"),
                "bytes_posted": posted.labels(*values),
                **{f"failed_{reason}": failures.labels(*values, reason) for reason in FAILURE_REASONS},
            }
            for idx, values in per_engine_labelvalues.items()
        }
        self._post: dict[int, Any] = {idx: post.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        children = self._children.get(engine_idx)
        if children is None:
            return
        for key, child in children.items():
            value = int(transfer_stats_data.get(key, 0))
            if value:
                child.inc(value)
        for seconds in transfer_stats_data.get(POST_SECONDS) or ():
            self._post[engine_idx].observe(seconds)
        values = self._labelvalues[engine_idx]
        for carrier, nbytes, seconds in transfer_stats_data.get(WRITES) or ():
            self._transport_bytes.labels(*values, carrier).inc(int(nbytes))
            self._write_seconds.labels(*values, carrier).observe(float(seconds))
