"""config.json validation: what the reference math runs, and refusals naming option, value, reason."""

from __future__ import annotations

import pytest

from decode_server.reference import ConfigError, ModelConfig
from decode_server.tiny_model.config import hf_config

pytestmark = pytest.mark.timeout(60)


def test_tiny_config_parses() -> None:
    cfg = ModelConfig.from_hf(hf_config(3, 4096, 2, [0, 7], 0))
    assert (cfg.num_hidden_layers, cfg.kv_width, cfg.qk_head_dim) == (3, 576, 128)
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1) and cfg.is_moe_layer(3)
    assert cfg.dtype == "bfloat16" and cfg.rope_theta == 10000.0


def test_deepseek_v3_style_config_parses() -> None:
    raw = hf_config(2, 4096, 2, [0], 0)
    raw.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", rope_theta=50000.0,
               rope_scaling=None, q_lora_rank=None, n_group=2, topk_group=1)
    del raw["rope_parameters"], raw["dtype"]
    cfg = ModelConfig.from_hf(raw)
    assert cfg.q_lora_rank is None and cfg.rope_theta == 50000.0 and cfg.dtype == "float32"


@pytest.mark.parametrize(("change", "needle"), [
    ({"architectures": ["GlmMoeDsaForCausalLM"]}, "architectures=['GlmMoeDsaForCausalLM']"),
    ({"kv_lora_rank": 256}, "kv_lora_rank=256"),
    ({"qk_rope_head_dim": 32}, "qk_rope_head_dim=32"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"index_topk": 2048}, "index_topk=2048"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ({"n_group": 3}, "n_group=3"),
])
def test_unsupported_configs_are_refused_by_name(change: dict, needle: str) -> None:
    raw = {**hf_config(2, 4096, 2, [0], 0), **change}
    with pytest.raises(ConfigError, match="config.json") as err:
        ModelConfig.from_hf(raw)
    assert needle in str(err.value)


def test_missing_field_is_named() -> None:
    raw = hf_config(2, 4096, 2, [0], 0)
    del raw["v_head_dim"]
    with pytest.raises(ConfigError, match="v_head_dim=None: missing"):
        ModelConfig.from_hf(raw)
