"""What vLLM 0.32's own classes say about GLM-5.1's KV caches, computed by the installed
vllm on this CPU machine and printed as one JSON object (run as a subprocess by
``test_vllm_cache_layouts.py``: it initialises vLLM's distributed state, which must not
leak into the test process).

Nothing here restates a size: every number comes from vLLM code.

* MLA rows per ``--kv-cache-dtype``: ``MLAAttention.get_kv_cache_spec``, called with a
  stand-in ``self`` carrying the attributes that method reads (``kv_cache_dtype``,
  ``head_size`` = kv_lora_rank + qk_rope_head_dim, ...). A real ``MLAAttention`` cannot be
  built here: its constructor builds the attention backend's CUDA implementation.
* Which backend serves which dtype: ``FlashMLASparseBackend`` / ``FlashInferMLASparseBackend``
  class methods (``supported_kv_cache_dtypes``, ``supports_combination`` for SM100,
  ``get_supported_kernel_block_sizes``) and vLLM's dtype canonicalisation for FlashMLA.
  vLLM's SM100 backend priority list (``vllm.platforms.cuda``) cannot be imported without
  vLLM's CUDA extension, so it is not checked here.
* The DSA indexer cache: a real ``DeepseekV32Indexer`` built with GLM-5.1's indexer
  dimensions (vLLM computes the per-token 132 bytes itself), then its cache's
  ``get_kv_cache_spec``; ``DeepseekV32IndexerBackend.get_supported_kernel_block_sizes``.
* The tensors a connector receives: vLLM's ``create_kv_cache_views`` over one backing
  buffer (layer-outermost ``LBNHC``, vLLM's default preference), then our
  ``connector.layout`` gather functions run on those very views.
"""

from __future__ import annotations

import json
import sys
import tempfile
import types
from pathlib import Path

import torch

# GLM-5.1's attention dimensions (its config.json): what the layer constructors take.
GLM51 = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "index_head_dim": 128,
         "index_n_heads": 32, "index_topk": 2048, "q_lora_rank": 2048, "hidden_size": 6144}
BLOCK_SIZE = 64


def _vllm_config():
    from vllm.config import CacheConfig, VllmConfig

    config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK_SIZE))
    # no HF checkpoint here: the few model_config fields the layers read
    config.model_config = types.SimpleNamespace(max_model_len=4096, dtype=torch.bfloat16, is_moe=True)
    config.attention_config.sparse_mla_prefill_workspace_factor = 5
    return config


def mla_rows(config) -> dict:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    out = {}
    for dtype in ("fp8_ds_mla", "fp8", "auto"):
        layer = types.SimpleNamespace(kv_cache_dtype=dtype, head_size=GLM51["kv_lora_rank"] + GLM51["qk_rope_head_dim"],
                                      sliding_window=None, indexer=object(), non_causal_multi_token_decode=False)
        spec = MLAAttention.get_kv_cache_spec(layer, config)
        out[dtype] = {"row_bytes": spec.state_content_size_bytes, "dtype": str(spec.dtype).removeprefix("torch."),
                      "block_size": spec.block_size, "page_bytes": spec.page_size_bytes}
    return out


def backends(config) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import _canonicalize_sparse_mla_kv_cache_dtype
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import (
        FlashInferMLASparseTRTLLMBackend as FlashInferMLASparseBackend,
    )
    from vllm.v1.attention.backends.mla.flashmla_sparse import FP8_DS_MLA_ROPE_DIM, FlashMLASparseBackend

    sm100 = DeviceCapability(10, 0)
    head = GLM51["kv_lora_rank"] + GLM51["qk_rope_head_dim"]
    # FlashInfer's check reads the model's head dims from the current config
    config.model_config.hf_text_config = types.SimpleNamespace(**{k: GLM51[k] for k in (
        "qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank", "index_topk")})
    with set_current_vllm_config(config):
        flashinfer = {dtype: FlashInferMLASparseBackend.supports_combination(
            head, torch.bfloat16, dtype, BLOCK_SIZE, True, False, True, False, sm100)
            for dtype in ("fp8_ds_mla", "fp8")}
        flashmla = FlashMLASparseBackend.supports_combination(
            head, torch.bfloat16, "fp8_ds_mla", BLOCK_SIZE, True, False, True, False, sm100)
    sizes = FlashMLASparseBackend.get_supported_kernel_block_sizes()
    return {
        "flashmla_sparse": {
            "name": FlashMLASparseBackend.get_name(),
            "kv_cache_dtypes": list(FlashMLASparseBackend.supported_kv_cache_dtypes),
            "sm100_fp8_ds_mla_rejected": flashmla,
            "block_64_supported": any(s == BLOCK_SIZE or (isinstance(s, MultipleOf) and BLOCK_SIZE % s.base == 0)
                                      for s in sizes),
            "serves_fp8_as": _canonicalize_sparse_mla_kv_cache_dtype(FlashMLASparseBackend, "fp8"),
            "rope_bytes": FP8_DS_MLA_ROPE_DIM * 2,  # the bf16 tail of its rows
        },
        "flashinfer_sparse": {"kv_cache_dtypes": list(FlashInferMLASparseBackend.supported_kv_cache_dtypes),
                              "sm100_rejects": flashinfer},
    }


def indexer(config) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.models.deepseek_v32.attention import DeepseekV32Indexer
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend

    hf = types.SimpleNamespace(**{k: GLM51[k] for k in ("index_topk", "index_n_heads", "index_head_dim",
                                                         "qk_rope_head_dim")})
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{Path(tmp) / 'init'}")
        ensure_model_parallel_initialized(1, 1)
        layer = DeepseekV32Indexer(config, hf, hidden_size=GLM51["hidden_size"] // 48,
                                   q_lora_rank=GLM51["q_lora_rank"] // 32, quant_config=None,
                                   cache_config=config.cache_config, topk_indices_buffer=None,
                                   prefix="model.layers.0.self_attn.indexer")
        spec = layer.k_cache.get_kv_cache_spec(config)
    return {"page_bytes": spec.page_size_bytes, "token_bytes": spec.state_content_size_bytes,
            "dtype": str(spec.dtype).removeprefix("torch."), "block_size": spec.block_size,
            "kernel_block_sizes": DeepseekV32IndexerBackend.get_supported_kernel_block_sizes(),
            "quant_block": layer.quant_block_size, "head_dim": layer.head_dim}, spec


def views_and_gather(mla_spec, indexer_spec) -> dict:
    """vLLM's per-layer views of one backing buffer, and our gathers over them."""
    from vllm.v1.kv_cache_interface import KVCacheLayout, KVCacheTensor, create_kv_cache_views

    from connector.layout import gather_fp8_ds_mla, gather_pages

    num_blocks, num_tokens = 9, 333  # 5 full blocks + a 13-token tail
    block_ids = [7, 2, 8, 0, 5, 3]
    out = {}
    caches = {}
    for name, spec in (("mla", mla_spec), ("indexer", indexer_spec)):
        page = spec.page_size_bytes
        raw = torch.zeros(2 * page * num_blocks, dtype=torch.int8)
        tensor = KVCacheTensor(size=raw.numel(), layers=[f"{name}.0", f"{name}.1"], layer_stride=page * num_blocks,
                               block_stride=page)
        view = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout.LBNHC, tensor)[1]
        gen = torch.Generator().manual_seed(1)
        view.view(torch.uint8).copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=gen))
        caches[name] = view
        out[f"{name}_shape"] = list(view.shape)
        out[f"{name}_dtype"] = str(view.dtype).removeprefix("torch.")
        out[f"{name}_contiguous"] = view.is_contiguous()
    mla = caches["mla"].squeeze(1)  # [B, H=1, N, C] -> [B, N, C], as the connector worker does
    rows = torch.cat([mla[b] for b in block_ids])[:num_tokens]
    kv = torch.empty(num_tokens, 528, dtype=torch.uint8)
    rope = torch.empty(num_tokens, 64, dtype=torch.bfloat16)
    gather_fp8_ds_mla(mla, block_ids, num_tokens, kv, rope)
    out["mla_gather_ok"] = torch.equal(kv, rows[:, :528]) and torch.equal(rope.view(torch.uint8), rows[:, 528:])
    pages = -(-num_tokens // BLOCK_SIZE)
    got = torch.empty(pages, caches["indexer"][0].numel(), dtype=torch.uint8)
    gather_pages(caches["indexer"], block_ids, pages, got)
    want = torch.stack([caches["indexer"][b].reshape(-1) for b in block_ids[:pages]])
    out["indexer_gather_ok"] = torch.equal(got, want)
    return out


def main() -> None:
    import vllm

    config = _vllm_config()
    result: dict = {"vllm": vllm.__version__, "mla": mla_rows(config), **backends(config)}
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layer = types.SimpleNamespace(kv_cache_dtype="fp8_ds_mla", head_size=576, sliding_window=None, indexer=object(),
                                  non_causal_multi_token_decode=False)
    mla_spec = MLAAttention.get_kv_cache_spec(layer, config)
    result["indexer"], indexer_spec = indexer(config)
    result["views"] = views_and_gather(mla_spec, indexer_spec)
    json.dump(result, sys.stdout, default=str)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
