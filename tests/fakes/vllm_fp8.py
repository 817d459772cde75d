"""What vLLM's fp8_ds_mla cache kernel writes, for tests and bench/gpu_check.py: a prompt's
latent as the 528-byte ``kv`` rows the connector moves (docs/gpu_path.md). Reading them
back is the product's job (:mod:`decode_server.engine.tilert_kv`), checked against these."""

from __future__ import annotations

import torch

from connector.layout import KV_LORA_RANK, KV_QUANT_BLOCK

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8_ds_mla(latent: torch.Tensor) -> torch.Tensor:
    """Latent ``[n, 512]`` -> ``kv`` bytes ``[n, 528]``: per 128-value tile, scale =
    amax / 448 (fp32), values = latent / scale as fp8 e4m3, then the 4 scales."""
    n = latent.shape[0]
    tiles = latent.float().view(n, KV_LORA_RANK // KV_QUANT_BLOCK, KV_QUANT_BLOCK)
    scale = (tiles.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-10)
    q = (tiles / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch.empty((n, KV_LORA_RANK + 4 * scale.shape[1]), dtype=torch.uint8)
    out[:, :KV_LORA_RANK].copy_(q.view(n, KV_LORA_RANK).view(torch.uint8))
    out[:, KV_LORA_RANK:].copy_(scale.contiguous().view(torch.uint8).view(n, -1))
    return out
