"""Reference model math (PyTorch, CPU) for GLM-4.x-Lite / DeepSeek-V3 style MLA + MoE + MTP
checkpoints: the same safetensors vLLM loads, the same per-token MLA cache rows.

Public names: :class:`ModelConfig`, :class:`MlaMoeModel`, :func:`load_model`,
:func:`prefill` (see its module for how the MTP layer's prompt KV is defined).
"""

from decode_server.reference.config import ConfigError, ModelConfig
from decode_server.reference.model import MlaMoeModel, load_model
from decode_server.reference.prefill import PrefillOutput, prefill

__all__ = ["ConfigError", "MlaMoeModel", "ModelConfig", "PrefillOutput", "load_model", "prefill"]
