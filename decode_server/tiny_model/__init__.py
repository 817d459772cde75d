"""Tiny GLM-family model generator: MLA (kv_lora_rank 512, rope 64) + MoE with a shared
expert, N main layers + 1 MTP layer, trained briefly and deterministically on local text.

``python -m decode_server.tiny_model --out DIR [--seed S] [--layers N]`` or
:func:`ensure_tiny_model` (cached, atomic)."""

from decode_server.tiny_model.config import VLLM_CPU_EXACT_ARGS
from decode_server.tiny_model.generate import GENERATOR_VERSION, ensure_tiny_model, generate, model_key
from decode_server.tiny_model.train import TrainSettings

__all__ = ["GENERATOR_VERSION", "VLLM_CPU_EXACT_ARGS", "TrainSettings", "ensure_tiny_model", "generate", "model_key"]
