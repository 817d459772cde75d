"""The subset of a Hugging Face ``config.json`` the reference model reads.

Both architectures vLLM runs on CPU with MLA and MTP are accepted:
``Glm4MoeLiteForCausalLM`` (GLM family, what the tiny-model generator writes) and
``DeepseekV3ForCausalLM``. Anything the reference math does not implement is refused
at load time with the option, its value and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

SUPPORTED_ARCHITECTURES = ("Glm4MoeLiteForCausalLM", "DeepseekV3ForCausalLM")
KV_LORA_RANK = 512  # vLLM's CPU MLA kernel: 512 latent + 64 rope per token
ROPE_DIM = 64


class ConfigError(ValueError):
    """config.json describes a model the reference engine cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    num_nextn_predict_layers: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    dtype: str

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_width(self) -> int:
        """Values per token per layer in the MLA cache (latent + rope)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        _require(arch in SUPPORTED_ARCHITECTURES, "architectures", archs,
                 f"must be one of {SUPPORTED_ARCHITECTURES}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        _require(rope_type == "default", "rope_parameters.rope_type", rope_type,
                 "only unscaled rope is implemented")
        _require(raw.get("scoring_func", "sigmoid") == "sigmoid", "scoring_func", raw.get("scoring_func"),
                 "only sigmoid routing is implemented")
        _require(raw.get("topk_method", "noaux_tc") == "noaux_tc", "topk_method", raw.get("topk_method"),
                 "only noaux_tc routing is implemented")
        _require(raw.get("hidden_act", "silu") == "silu", "hidden_act", raw.get("hidden_act"), "only silu")
        _require("index_topk" not in raw, "index_topk", raw.get("index_topk"),
                 "sparse (DSA) attention is not implemented")
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        values: dict[str, Any] = {
            "architecture": arch,
            "q_lora_rank": raw.get("q_lora_rank"),
            "n_shared_experts": raw.get("n_shared_experts") or 0,
            "n_routed_experts": raw.get("n_routed_experts") or 0,
            "first_k_dense_replace": raw.get("first_k_dense_replace", 0),
            "num_nextn_predict_layers": raw.get("num_nextn_predict_layers", 0),
            "routed_scaling_factor": float(raw.get("routed_scaling_factor", 1.0)),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
            "n_group": raw.get("n_group") or 1,
            "topk_group": raw.get("topk_group") or 1,
            "rope_theta": float(theta),
            "dtype": str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        }
        for f in fields(cls):
            if f.name not in values:
                _require(f.name in raw, f.name, None, "missing from config.json")
                values[f.name] = raw[f.name]
        cfg = cls(**values)
        _require(cfg.kv_lora_rank == KV_LORA_RANK, "kv_lora_rank", cfg.kv_lora_rank,
                 f"vLLM's CPU MLA needs {KV_LORA_RANK}")
        _require(cfg.qk_rope_head_dim == ROPE_DIM, "qk_rope_head_dim", cfg.qk_rope_head_dim,
                 f"vLLM's CPU MLA needs {ROPE_DIM}")
        _require(cfg.n_routed_experts % cfg.n_group == 0, "n_group", cfg.n_group,
                 "must divide n_routed_experts")
        return cfg


def _require(ok: bool, option: str, value: object, reason: str) -> None:
    if not ok:
        raise ConfigError(f"config.json {option}={value!r}: {reason}")
