"""GLM-5 ``fp8_ds_mla`` KV planes -> the bf16 tensors TileRT's ``inject_cache`` takes.

Received planes per layer (:func:`connector.layout.glm5_fp8_ds_mla_layout`):

* ``kv``: ``[T, 528]`` uint8 — 512 fp8 e4m3 latent values, then 4 fp32 scales, one per
  128-value block. Dequantized: ``latent[t, b*128 + i] = fp8[t, b*128 + i] * scale[t, b]``.
* ``rope``: ``[T, 64]`` bf16, taken as is.
* ``indexer``: ``[pages, 8448]`` uint8 per 64-token page — 64 x 128 fp8 keys (token-major),
  then 64 fp32 scales (one per token). Dequantized per token, then rotated by the
  normalized Sylvester-Hadamard transform of size 128 (TileRT's indexer keys live in
  the rotated basis; the prefill side stores them unrotated).

``inject_cache`` takes one ``(indexer_keys [T,128], latent [T,512], rope [T,64])`` tuple
per layer, all bf16, main layers first, then the MTP layer. The conversion runs on the
engine's device (:func:`convert_layers`): with the receive buffer in VRAM (the TileRT
default) nothing crosses PCIe; from host memory each plane is copied to the device first.
Checked bit for bit against TileRT's own conversion (tests/decode_server/test_tilert_oracle.py).
"""

from __future__ import annotations

import math

import torch

from connector.layout import (  # the layout's geometry, defined once
    INDEX_HEAD_DIM,
    INDEX_PAGE_BYTES,
    INDEX_PAGE_TOKENS,
    KV_LORA_RANK,
    KV_QUANT_BLOCK,
    KV_ROW_BYTES,
    ROPE_DIM,
)

__all__ = ["INDEX_HEAD_DIM", "INDEX_PAGE_BYTES", "INDEX_PAGE_TOKENS", "KV_LORA_RANK", "KV_QUANT_BLOCK", "KV_ROW_BYTES",
           "ROPE_DIM", "convert_layer", "convert_layers", "dequant_indexer", "dequant_latent", "hadamard_matrix"]


def hadamard_matrix(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Normalized Sylvester-Hadamard matrix (symmetric, orthonormal), float32."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"Hadamard size {dim} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h / math.sqrt(dim)


def dequant_latent(raw: torch.Tensor) -> torch.Tensor:
    """``[T, 528]`` uint8 -> ``[T, 512]`` bf16."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != KV_ROW_BYTES:
        raise ValueError(f"kv plane must be uint8 [T, {KV_ROW_BYTES}], got {raw.dtype} {tuple(raw.shape)}")
    t = raw.shape[0]
    blocks = KV_LORA_RANK // KV_QUANT_BLOCK
    values = raw[:, :KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn).float()
    scales = raw[:, KV_LORA_RANK:].contiguous().view(torch.float32)  # [T, 4]
    return (values.view(t, blocks, KV_QUANT_BLOCK) * scales.unsqueeze(-1)).view(t, KV_LORA_RANK).to(torch.bfloat16)


def dequant_indexer(pages: torch.Tensor, num_tokens: int, hadamard: torch.Tensor) -> torch.Tensor:
    """``[P, 8448]`` uint8 -> ``[T, 128]`` bf16 indexer keys, Hadamard-rotated."""
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != INDEX_PAGE_BYTES:
        raise ValueError(f"indexer plane must be uint8 [pages, {INDEX_PAGE_BYTES}], got {pages.dtype} "
                         f"{tuple(pages.shape)}")
    if pages.shape[0] * INDEX_PAGE_TOKENS < num_tokens:
        raise ValueError(f"indexer plane has {pages.shape[0]} pages, {num_tokens} tokens need "
                         f"{-(-num_tokens // INDEX_PAGE_TOKENS)}")
    n = pages.shape[0] * INDEX_PAGE_TOKENS
    split = INDEX_PAGE_TOKENS * INDEX_HEAD_DIM
    keys = pages[:, :split].contiguous().view(torch.float8_e4m3fn).view(n, INDEX_HEAD_DIM)[:num_tokens]
    scales = pages[:, split:].contiguous().view(torch.float32).view(n, 1)[:num_tokens]
    deq = (keys.float() * scales).to(torch.bfloat16)
    return (deq.float() @ hadamard.to(deq.device)).to(torch.bfloat16)


def convert_layer(planes: dict[str, torch.Tensor], num_tokens: int,
                  hadamard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One received layer -> ``(indexer_keys, latent, rope)`` for ``inject_cache``."""
    missing = {"kv", "rope", "indexer"} - set(planes)
    if missing:
        raise ValueError(f"layer lacks plane(s) {sorted(missing)}")
    kv, rope = planes["kv"][:num_tokens], planes["rope"][:num_tokens]
    if rope.dtype != torch.bfloat16 or rope.shape != (num_tokens, ROPE_DIM):
        raise ValueError(f"rope plane must be bfloat16 [{num_tokens}, {ROPE_DIM}], got {rope.dtype} "
                         f"{tuple(rope.shape)}")
    if kv.shape[0] != num_tokens:
        raise ValueError(f"kv plane has {kv.shape[0]} rows, expected {num_tokens}")
    return dequant_indexer(planes["indexer"], num_tokens, hadamard), dequant_latent(kv), rope.contiguous().clone()


def convert_layers(layers: list[dict[str, torch.Tensor]], num_tokens: int, hadamard: torch.Tensor,
                   device: torch.device | str | None = None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every received layer, converted on ``device`` (default: where the planes are).

    Planes received elsewhere (host memory, for a CUDA ``device``) are copied there first,
    so dequantization and the Hadamard rotation always run on ``device``. On CUDA this
    waits for the conversion to finish before returning: the caller may then hand the
    receive buffer to the next request."""
    target = torch.device(device) if device is not None else None
    out = []
    for i, planes in enumerate(layers):
        if target is not None:
            planes = {name: plane.to(target, non_blocking=True) for name, plane in planes.items()}
        try:
            out.append(convert_layer(planes, num_tokens, hadamard))
        except ValueError as exc:
            raise ValueError(f"layer {i}: {exc}") from exc
    if target is not None and target.type == "cuda":
        torch.cuda.synchronize(target)
    return out
