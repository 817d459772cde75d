"""``TileRTConnector`` as it runs under vLLM 0.32's CUDA model code for GLM-5.1: that attention
(``deepseek_v32``) never calls ``save_kv_layer``, so every layer must leave from
``wait_for_save``. Loaded by vLLM through ``kv_connector_module_path`` in the tests only."""

from __future__ import annotations

from typing import Any

from connector.tilert_connector import TileRTConnector


class NoSaveKVLayerConnector(TileRTConnector):
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None
