"""Tiny GLM-family model generator: MLA (kv_lora_rank 512, rope 64) + MoE with a shared
expert, N main layers + 1 MTP layer, trained briefly and deterministically on local text.

``python -m decode_server.tiny_model --out DIR [--seed S] [--layers N]`` or
:func:`ensure_tiny_model` (cached, atomic). The public names are imported on first use
(PEP 562): :data:`VLLM_CPU_EXACT_ARGS` comes without torch. (``generate`` is not one of
them: a name a submodule also has would be that submodule once it is imported; use
:func:`decode_server.tiny_model.generate.generate`.)"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from decode_server.tiny_model.config import VLLM_CPU_EXACT_ARGS
    from decode_server.tiny_model.generate import GENERATOR_VERSION, ensure_tiny_model, model_key
    from decode_server.tiny_model.train import TrainSettings

_EXPORTS = {
    "GENERATOR_VERSION": "decode_server.tiny_model.generate",
    "TrainSettings": "decode_server.tiny_model.train",
    "VLLM_CPU_EXACT_ARGS": "decode_server.tiny_model.config",
    "ensure_tiny_model": "decode_server.tiny_model.generate",
    "model_key": "decode_server.tiny_model.generate",
}
__all__ = [
    "GENERATOR_VERSION",
    "TrainSettings",
    "VLLM_CPU_EXACT_ARGS",
    "ensure_tiny_model",
    "model_key",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'decode_server.tiny_model' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
