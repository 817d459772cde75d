"""``TileRTConnector``: the facade vLLM loads (``kv_connector_module_path: "connector"``).

A thin adapter from vLLM's ``KVConnectorBase_V1`` hooks to :class:`connector.scheduler.ConnectorScheduler`
(role SCHEDULER, engine-core process) and :class:`connector.worker.ConnectorWorker` (role WORKER,
each worker process). Settings come from ``kv_connector_extra_config``
(:mod:`connector.config`), validated here so that a bad option stops vLLM at start-up.
Reading order: config -> profiles -> metadata -> scheduler -> worker.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from connector.admission import AdmissionClient
from connector.config import load_settings
from connector.control import ControlClient
from connector.endpoints import DecodeEndpoints
from connector.layout import layout_fingerprint
from connector.metadata import ReportOutbox, StepPlan, report_address
from connector.profiles import resolve_profile
from connector.scheduler import ConnectorScheduler
from connector.vllm_stats import TileRTKVStats, TileRTPromMetrics
from connector.worker import ConnectorWorker, default_agent_name, nixl_sender_factory, sender_group

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class TileRTConnectorMetadata(KVConnectorMetadata):
    """What vLLM carries from the scheduler side to the workers each step."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class TileRTConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _route_logs_to_vllm()
        settings = load_settings(self._kv_transfer_config.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "TileRTConnector: pipeline parallelism is not supported "
                f"(pipeline_parallel_size={parallel.pipeline_parallel_size})"
            )
        model = vllm_config.model_config
        max_tokens = settings.max_tokens or model.max_model_len
        engine_id = str(self._kv_transfer_config.engine_id)
        address = report_address(engine_id, parallel.data_parallel_rank)
        world = parallel.tensor_parallel_size
        group = sender_group(engine_id, parallel.data_parallel_rank)
        profile = resolve_profile(settings.profile, model.hf_config, model.dtype)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            endpoints = DecodeEndpoints(settings)
            endpoints.start(settings.handshake_interval_s)
            admissions = AdmissionClient(
                agent_name=default_agent_name(engine_id, None), group=group,
                fingerprint=layout_fingerprint(profile.layout, world), transport="nixl",
                timeout_s=settings.admission_timeout_s,
                connect=functools.partial(ControlClient, secret=settings.kv_secret()),
            )
            self._scheduler = ConnectorScheduler.with_inbox(
                address,
                block_size=_block_size(vllm_config, kv_cache_config),
                max_tokens=max_tokens,
                world_size=world,
                admissions=admissions,
                endpoint_allowed=endpoints.allowed,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank() if world > 1 else 0
            self._worker = ConnectorWorker(
                settings=settings,
                profile=profile,
                rank=rank,
                world_size=world,
                agent_name=default_agent_name(engine_id, rank),
                max_tokens=max_tokens,
                sender_factory=functools.partial(nixl_sender_factory, lanes=settings.send_lanes,
                                                 pin_lanes=settings.pin_send_lanes, group=group,
                                                 control_timeout_s=settings.handshake_timeout_s,
                                                 secret=settings.kv_secret()),
                reports=ReportOutbox(address),
            )

    # -- scheduler side -------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return TileRTConnectorMetadata(self._scheduler.build_step(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output.finished_sending)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, TileRTConnectorMetadata):
            self._worker.bind(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None  # producer only

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.get_finished(finished_req_ids)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self._worker.take_stats() if self._worker is not None else None
        return TileRTKVStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TileRTKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return TileRTPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()


def _route_logs_to_vllm() -> None:
    """Our modules log under "connector"; vLLM only configures "vllm". Share its handlers."""
    ours, theirs = logging.getLogger("connector"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.getEffectiveLevel())
        ours.propagate = False


def _block_size(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if groups:
        return int(groups[0].kv_cache_spec.block_size)
    return int(vllm_config.cache_config.block_size)
