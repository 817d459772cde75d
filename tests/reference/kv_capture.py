"""A vLLM KV connector for tests only: after the step that prefills a request, it writes
that request's prompt KV rows of every attention layer (MTP layer included) to
``<dump_dir>/<n>.pt`` as ``{"layers": {name: [T, 576] tensor}, "prompt_token_ids": [...]}``.

It observes vLLM's real cache (what a KV connector ships), so the reference prefill can be
checked against exactly what vLLM stores. Loaded with
``--kv-transfer-config '{"kv_connector": "KVCaptureConnector",
"kv_connector_module_path": "tests.reference.kv_capture", "kv_role": "kv_both",
"kv_connector_extra_config": {"dump_dir": DIR}}'``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

BLOCK_SIZE = 16  # vLLM's CPU MLA block size


@dataclass
class CaptureMetadata(KVConnectorMetadata):
    new_requests: list[tuple[str, list[int], list[int]]] = field(default_factory=list)  # id, blocks, prompt


def _layer_index(name: str) -> int:
    match = re.search(r"layers\.(\d+)\.", name)
    return int(match.group(1)) if match else -1


class KVCaptureConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._dump_dir = Path(extra["dump_dir"])
        self._layers: dict[str, torch.Tensor] = {}
        self._count = 0

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> CaptureMetadata:
        meta = CaptureMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            meta.new_requests.append((req.req_id, list(req.block_ids[0]), list(req.prompt_token_ids or [])))
        return meta

    # worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._layers[layer_name] = kv_layer

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CaptureMetadata)
        for _req_id, blocks, prompt in meta.new_requests:
            n = len(prompt)
            slots = torch.tensor([blocks[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(n)])
            layers = {name: cache.reshape(-1, cache.shape[-1])[slots].clone()
                      for name, cache in sorted(self._layers.items(), key=lambda kv: _layer_index(kv[0]))}
            self._count += 1
            tmp = self._dump_dir / f".{os.getpid()}-{self._count}.tmp"
            torch.save({"layers": layers, "prompt_token_ids": prompt}, tmp)
            tmp.rename(self._dump_dir / f"{os.getpid()}-{self._count}.pt")
