"""An independent recomputation of the prompt KV that vLLM's CPU MLA cache should hold,
from the same checkpoint, with transformers' own modeling code (not our reference
engine, not vLLM).

Main layers: transformers' forward with a ``DynamicCache``; its MLA cache keeps, per
layer, the normalized latent (keys, ``[T, 512]``) and the rotated rope key (values,
``[T, 64]``, in transformers' de-interleaved order). MTP layer (index N): the same
attention module class built for layer N and fed as vLLM's MTP does (docs/facts.md §4):
``eh_proj(cat[enorm(embed(next token)), hnorm(final-normed hidden)])``, the embedding
zeroed at position 0, the next token of the last position being the sampled first token.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import safe_open


def deinterleave_rope(kv: torch.Tensor, latent: int = 512) -> torch.Tensor:
    """vLLM stores the rope key with pairs interleaved (x0, x1, x2, ...); transformers' MLA cache
    holds evens then odds. Return ``kv`` with its rope part in transformers' order."""
    rope = kv[:, latent:]
    return torch.cat([kv[:, :latent], rope[:, 0::2], rope[:, 1::2]], dim=1)


def _mtp_tensors(model_dir: Path, layer: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}."
    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    out = {}
    for name in files:
        with safe_open(str(model_dir / name), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if key.startswith(prefix):
                    out[key[len(prefix) :]] = f.get_tensor(key).float()
    return out


@torch.no_grad()
def reference_kv(model_dir: Path, prompt: list[int], first_token_id: int) -> list[torch.Tensor]:
    """``[T, 576]`` float32 per layer (main layers, then MTP): latent then rope (transformers' order)."""
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as hf

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    cfg = model.config
    n = cfg.num_hidden_layers
    ids = torch.tensor([prompt])
    cache = DynamicCache(config=cfg)
    base = model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    layers = [torch.cat([cache.layers[i].keys[0, 0], cache.layers[i].values[0, 0]], dim=1) for i in range(n)]

    mtp_cfg = copy.deepcopy(cfg)
    mtp_cfg.num_hidden_layers = n + 1
    if getattr(mtp_cfg, "mlp_layer_types", None):
        mtp_cfg.mlp_layer_types = list(mtp_cfg.mlp_layer_types) + ["sparse"]
    weights = _mtp_tensors(model_dir, n)
    hidden = cfg.hidden_size
    enorm = hf.Glm4MoeLiteRMSNorm(hidden, eps=cfg.rms_norm_eps)
    hnorm = hf.Glm4MoeLiteRMSNorm(hidden, eps=cfg.rms_norm_eps)
    enorm.weight.copy_(weights["enorm.weight"])
    hnorm.weight.copy_(weights["hnorm.weight"])
    input_norm = hf.Glm4MoeLiteRMSNorm(hidden, eps=cfg.rms_norm_eps)
    input_norm.weight.copy_(weights["input_layernorm.weight"])
    attn = hf.Glm4MoeLiteAttention(mtp_cfg, layer_idx=n)
    attn_state = {k.removeprefix("self_attn."): v for k, v in weights.items() if k.startswith("self_attn.")}
    attn.load_state_dict(attn_state, strict=True)
    attn.eval()

    next_ids = torch.tensor([prompt[1:] + [first_token_id]])
    emb = model.model.embed_tokens(next_ids)
    emb[:, 0] = 0.0  # vLLM masks the MTP input embedding at position 0
    x = torch.nn.functional.linear(
        torch.cat([enorm(emb), hnorm(base.last_hidden_state)], dim=-1), weights["eh_proj.weight"]
    )
    x = input_norm(x)
    positions = torch.arange(len(prompt)).unsqueeze(0)
    mtp_cache = DynamicCache(config=mtp_cfg)
    attn(
        x,
        position_embeddings=model.model.rotary_emb(x, positions),
        attention_mask=None,
        past_key_values=mtp_cache,
    )
    layers.append(torch.cat([mtp_cache.layers[n].keys[0, 0], mtp_cache.layers[n].values[0, 0]], dim=1))
    return layers
