"""Reference model math (PyTorch, CPU) for GLM-4.x-Lite / DeepSeek-V3 style MLA + MoE + MTP
checkpoints: the same safetensors vLLM loads, the same per-token MLA cache rows.

Public names: :class:`ModelConfig`, :class:`MlaMoeModel`, :func:`load_model`,
:func:`prefill` (see its module for how the MTP layer's prompt KV is defined), imported on
first use (PEP 562): importing :mod:`decode_server.reference.config` does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from decode_server.reference.config import ConfigError, ModelConfig
    from decode_server.reference.model import MlaMoeModel, load_model
    from decode_server.reference.prefill import PrefillOutput, prefill

_EXPORTS = {
    "ConfigError": "decode_server.reference.config",
    "MlaMoeModel": "decode_server.reference.model",
    "ModelConfig": "decode_server.reference.config",
    "PrefillOutput": "decode_server.reference.prefill",
    "load_model": "decode_server.reference.model",
    "prefill": "decode_server.reference.prefill",
}
__all__ = [
    "ConfigError",
    "MlaMoeModel",
    "ModelConfig",
    "PrefillOutput",
    "load_model",
    "prefill",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'decode_server.reference' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
