"""KV layouts: what one handoff's bytes look like, per layer and plane.

A handoff of ``n`` tokens is ``num_layers`` layer blocks (main layers first, then MTP
layers); a layer block is its planes one after the other, each ``plane.nbytes(n)``
bytes (:func:`plane_offsets`). The sender's staging buffer and the receiver's slot
use this same packing, so one layer is one contiguous WRITE.

This module imports no torch at module level (the connector's scheduler side and the
router import it); the packing helpers at the end import torch when called:

* CPU MLA (vLLM's CPU cache ``[num_blocks, block_size, 576]``, model dtype):
  :func:`gather_tokens` -> the ``kv`` plane ``[n, 576]``; :func:`split_cpu_mla`.
* GLM-5.1 fp8_ds_mla (vLLM's GPU cache ``[num_blocks, block_size, 656]`` uint8:
  512 fp8 e4m3 + 4 fp32 scales + 64 bf16 rope): :func:`gather_fp8_ds_mla` -> ``kv``
  ``[n, 528]`` and ``rope`` ``[n, 64]``; the DSA indexer cache (64-token blocks of
  64x128 fp8 then 64 fp32 scales) -> ``indexer`` pages ``[pages, 8448]`` with
  :func:`gather_pages`. The fp8 values are moved as bytes; the decode side's conversion
  (dequantization) is :mod:`decode_server.engine.tilert_kv`.

The gathers accept a cache and a staging view on different devices (a CUDA cache, host
staging): they gather on the cache's device and copy once (:func:`gather_layer`: one
copy per layer).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from connector.protocol import LayoutFingerprint, PlaneSpec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Plane:
    """One array per layer. Either per token (``bytes_per_token``) or per page of
    ``page_tokens`` tokens (``bytes_per_page``), never both."""

    name: str
    dtype: str  # torch dtype name of the typed view, e.g. "bfloat16", "float32", "uint8"
    width: int  # elements per token (per page for paged planes) in the typed view
    bytes_per_token: int = 0
    bytes_per_page: int = 0
    page_tokens: int = 0

    def nbytes(self, num_tokens: int) -> int:
        if self.bytes_per_token:
            return self.bytes_per_token * num_tokens
        pages = -(-num_tokens // self.page_tokens)
        return self.bytes_per_page * pages


@dataclass(frozen=True)
class KVLayout:
    profile: str  # e.g. "tiny-mla" or "glm5.1-fp8-ds-mla"
    num_main_layers: int
    num_mtp_layers: int
    planes: tuple[Plane, ...]

    @property
    def num_layers(self) -> int:
        return self.num_main_layers + self.num_mtp_layers

    def bytes_per_layer(self, num_tokens: int) -> int:
        return sum(p.nbytes(num_tokens) for p in self.planes)

    def is_mtp(self, layer: int) -> bool:
        """Whether ``layer`` (main layers first) is an MTP layer."""
        return layer >= self.num_main_layers

    def fingerprint(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return f"{self.profile}-{self.num_layers}L-" + hashlib.sha256(blob).hexdigest()[:16]


# Bytes per value of the model dtypes an MLA cache may hold (vLLM's CPU MLA: its --dtype).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def cpu_mla_layout(num_main_layers: int, num_mtp_layers: int, dtype: str = "bfloat16") -> KVLayout:
    """vLLM's CPU MLA cache: 512 latent + 64 rope values per token, model dtype."""
    itemsize = DTYPE_BYTES[dtype]
    plane = Plane(name="kv", dtype=dtype, width=576, bytes_per_token=576 * itemsize)
    return KVLayout("tiny-mla", num_main_layers, num_mtp_layers, (plane,))


# GLM-5.1 (DeepSeek-V3.2 attention) fp8_ds_mla geometry, as vLLM 0.32 caches it (docs/gpu_path.md;
# checked against vLLM's classes in tests/connector/vllm/test_vllm_cache_layouts.py).
KV_LORA_RANK = 512  # latent values per token
KV_QUANT_BLOCK = 128  # latent values per fp32 scale
KV_ROW_BYTES = KV_LORA_RANK + 4 * (KV_LORA_RANK // KV_QUANT_BLOCK)  # 528: fp8 latent, then the scales
ROPE_DIM = 64  # bf16 rope values per token
INDEX_HEAD_DIM = 128  # fp8 indexer key values per token, one fp32 scale each token
INDEX_PAGE_TOKENS = 64  # tokens per indexer page = vLLM block
INDEX_PAGE_BYTES = INDEX_PAGE_TOKENS * (INDEX_HEAD_DIM + 4)  # 8448: all keys, then all scales
GLM5_MAIN_LAYERS = 78  # GLM-5.1's main layers (+1 MTP layer)


def glm5_fp8_ds_mla_layout(num_main_layers: int = GLM5_MAIN_LAYERS, num_mtp_layers: int = 1) -> KVLayout:
    """GLM-5.1 decode-side layout: vLLM's 656-byte fp8_ds_mla row split into ``kv`` and
    ``rope``, and the indexer cache's pages."""
    planes = (
        Plane(name="kv", dtype="uint8", width=KV_ROW_BYTES, bytes_per_token=KV_ROW_BYTES),
        Plane(name="rope", dtype="bfloat16", width=ROPE_DIM, bytes_per_token=2 * ROPE_DIM),
        Plane(name="indexer", dtype="uint8", width=INDEX_PAGE_BYTES, bytes_per_page=INDEX_PAGE_BYTES,
              page_tokens=INDEX_PAGE_TOKENS),
    )
    return KVLayout("glm5.1-fp8-ds-mla", num_main_layers, num_mtp_layers, planes)


# ------------------------------------------------------------------ sizes and plans


def plane_offsets(layout: KVLayout, num_tokens: int) -> list[int]:
    """Byte offset of each plane inside one packed layer block of ``num_tokens`` tokens."""
    offsets, pos = [], 0
    for plane in layout.planes:
        offsets.append(pos)
        pos += plane.nbytes(num_tokens)
    return offsets


def plane_rows(plane: Plane, num_tokens: int) -> int:
    """Rows of the typed view: tokens for per-token planes, pages for paged planes."""
    return num_tokens if plane.bytes_per_token else -(-num_tokens // plane.page_tokens)


def layout_fingerprint(layout: KVLayout, sender_world_size: int = 1) -> LayoutFingerprint:
    planes = [PlaneSpec(name=p.name, dtype=p.dtype, bytes_per_token=p.bytes_per_token,
                        bytes_per_page=p.bytes_per_page, page_tokens=p.page_tokens) for p in layout.planes]
    return LayoutFingerprint(profile=layout.profile, num_layers=layout.num_layers,
                             num_mtp_layers=layout.num_mtp_layers, planes=planes,
                             sender_world_size=sender_world_size)


@dataclass(frozen=True)
class SenderPlan:
    """Which layers tensor-parallel rank ``rank`` of ``world_size`` sends.

    MLA KV is replicated on every TP rank, so each layer needs one sender: layers go
    round-robin (layer ``l`` is sent by rank ``l % world_size``), which spreads the
    sending over the whole forward pass. The receiver completes a handoff when every
    layer arrived, from whichever rank.
    """

    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"SenderPlan.world_size={self.world_size}: must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"SenderPlan.rank={self.rank}: must be in [0, {self.world_size})")

    def layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(range(self.rank, num_layers, self.world_size))

    def owner(self, layer: int) -> int:
        return layer % self.world_size


# ------------------------------------------------------------------ packing helpers


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"plane dtype {name!r} is not a torch dtype")
    return dtype


def layer_views(block: torch.Tensor, layout: KVLayout, num_tokens: int,
                offsets: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """Typed per-plane views of one layer inside the uint8 tensor ``block``.

    ``offsets`` are the planes' byte offsets in ``block`` (default: packed, as
    :func:`plane_offsets`). Per-token planes are ``[num_tokens, width]``, paged planes
    ``[pages, width]``.
    """
    offsets = plane_offsets(layout, num_tokens) if offsets is None else offsets
    views = {}
    for plane, off in zip(layout.planes, offsets):
        raw = block[off:off + plane.nbytes(num_tokens)]
        views[plane.name] = raw.view(torch_dtype(plane.dtype)).view(plane_rows(plane, num_tokens), plane.width)
    return views


def packed_layers_views(block: torch.Tensor, layout: KVLayout, num_tokens: int,
                        num_layers: int) -> list[dict[str, torch.Tensor]]:
    """:func:`layer_views` of ``num_layers`` packed layer blocks one after the other in
    ``block`` (layer-major, planes packed as :func:`plane_offsets`), made with a few view
    operations per plane instead of a few per layer and plane (79 layers: ~0.1 ms
    instead of ~1 ms of Python, on the path from "KV complete" to the decode engine)."""
    size = layout.bytes_per_layer(num_tokens)
    grid = block[:num_layers * size].view(num_layers, size)
    per_plane = []
    for plane, off in zip(layout.planes, plane_offsets(layout, num_tokens)):
        typed = grid[:, off:off + plane.nbytes(num_tokens)].view(torch_dtype(plane.dtype))
        per_plane.append(typed.view(num_layers, plane_rows(plane, num_tokens), plane.width).unbind(0))
    names = [plane.name for plane in layout.planes]
    return [dict(zip(names, views)) for views in zip(*per_plane)]


def _block_ids(block_ids: Sequence[int], count: int, device: torch.device) -> torch.Tensor:
    import torch

    return torch.as_tensor(list(block_ids[:count]), dtype=torch.long, device=device)


def _deliver(src: torch.Tensor, out: torch.Tensor) -> None:
    """``out.copy_(src)``: one copy, also across devices (a CUDA cache into host staging is
    one device-to-host copy, blocking, so the bytes are there when this returns)."""
    out.copy_(src)


def _token_rows(cache: torch.Tensor, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` rows of a request, ``[num_tokens, row]``, on the cache's device."""
    import torch

    block_size = cache.shape[1]
    need = -(-num_tokens // block_size)
    if len(block_ids) < need:
        raise ValueError(f"{num_tokens} tokens need {need} blocks of {block_size}, got {len(block_ids)}")
    full = num_tokens // block_size
    parts = [torch.index_select(cache, 0, _block_ids(block_ids, full, cache.device)).flatten(0, 1)] if full else []
    rest = num_tokens - full * block_size
    if rest:
        parts.append(cache[int(block_ids[full]), :rest])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def gather_tokens(cache: torch.Tensor, block_ids: Sequence[int], num_tokens: int,
                  out: torch.Tensor) -> torch.Tensor:
    """Copy the first ``num_tokens`` token rows of a request out of a paged cache.

    ``cache`` is ``[num_blocks, block_size, row]`` (vLLM's per-layer MLA cache);
    token ``t`` lives in block ``block_ids[t // block_size]`` at ``t % block_size``.
    ``out`` is ``[num_tokens, row]`` of the same dtype (e.g. a staging view), on the
    cache's device (gathered in place) or another one (gathered on the cache's device,
    then one copy into ``out``: ``index_select(out=)`` cannot write across devices).
    """
    import torch

    if out.device != cache.device:
        _deliver(_token_rows(cache, block_ids, num_tokens), out)
        return out
    block_size = cache.shape[1]
    need = -(-num_tokens // block_size)
    if len(block_ids) < need:
        raise ValueError(f"{num_tokens} tokens need {need} blocks of {block_size}, got {len(block_ids)}")
    full = num_tokens // block_size
    if full:
        ids = _block_ids(block_ids, full, cache.device)
        torch.index_select(cache, 0, ids, out=out[:full * block_size].view(full, block_size, -1))
    rest = num_tokens - full * block_size
    if rest:
        out[full * block_size:].copy_(cache[int(block_ids[full]), :rest])
    return out


def _pages(cache: torch.Tensor, block_ids: Sequence[int], num_pages: int) -> torch.Tensor:
    import torch

    flat = cache.reshape(cache.shape[0], -1)
    return torch.index_select(flat, 0, _block_ids(block_ids, num_pages, cache.device))


def gather_pages(cache: torch.Tensor, block_ids: Sequence[int], num_pages: int,
                 out: torch.Tensor) -> torch.Tensor:
    """Copy whole blocks (pages) of a paged cache: ``out[i] = cache[block_ids[i]]`` flattened
    (``out`` on any device, as :func:`gather_tokens`)."""
    import torch

    page = cache[0].numel() if cache.shape[0] else 0
    if tuple(out.shape) != (num_pages, page):
        raise ValueError(f"out is {tuple(out.shape)}, expected ({num_pages}, {page})")
    if out.device != cache.device:
        _deliver(_pages(cache, block_ids, num_pages), out)
        return out
    flat = cache.reshape(cache.shape[0], -1)
    torch.index_select(flat, 0, _block_ids(block_ids, num_pages, cache.device), out=out)
    return out


def _packed_span(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The uint8 run of memory ``parts`` cover when they lie back to back (contiguous, in
    order, on one device), as :func:`layer_views` lays out one layer; else None."""
    import torch

    first = parts[0]
    pos = first.data_ptr()
    for part in parts:
        if part.device != first.device or not part.is_contiguous() or part.data_ptr() != pos:
            return None
        pos += part.numel() * part.element_size()
    base = first.view(torch.uint8).reshape(-1)
    return torch.as_strided(base, (pos - first.data_ptr(),), (1,), base.storage_offset())


def gather_layer(cache: torch.Tensor, block_ids: Sequence[int], num_tokens: int,
                 views: dict[str, torch.Tensor], indexer: torch.Tensor | None = None) -> None:
    """One layer of a request into its staging ``views`` (:func:`layer_views`), whatever the
    devices: CPU MLA (``views`` = ``kv``) or fp8_ds_mla (``kv``, ``rope``, ``indexer``
    from the ``indexer`` cache). Across devices (a CUDA cache, host staging) the planes are
    gathered and packed on the cache's device and land with ONE copy when the views lie
    back to back (staging does), else one copy per plane. Into VRAM staging the copy is
    queued on the current CUDA stream: synchronize before a transfer reads it."""
    import torch

    if set(views) == {"kv"}:
        gather_tokens(cache, block_ids, num_tokens, views["kv"])
        return
    if indexer is None:
        raise ValueError("the fp8_ds_mla layout needs the layer's indexer cache")
    pages = views["indexer"].shape[0]
    if views["kv"].device == cache.device == indexer.device:
        gather_fp8_ds_mla(cache, block_ids, num_tokens, views["kv"], views["rope"])
        gather_pages(indexer, block_ids, pages, views["indexer"])
        return
    rows = _token_rows(cache, block_ids, num_tokens)
    split = views["kv"].shape[1]
    packed = [rows[:, :split].reshape(-1), rows[:, split:].reshape(-1),
              _pages(indexer, block_ids, pages).to(cache.device).reshape(-1)]
    targets = [views["kv"], views["rope"], views["indexer"]]
    span = _packed_span(targets)
    if span is not None and span.numel() == sum(p.numel() for p in packed):
        _deliver(torch.cat(packed), span)
        return
    for src, dst in zip(packed, targets):
        _deliver(src.view(dst.dtype).view(dst.shape), dst)


def split_cpu_mla(kv: torch.Tensor, kv_lora_rank: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU MLA ``kv`` plane ``[n, 576]`` -> (latent ``[n, 512]``, rope ``[n, 64]``) views."""
    return kv[:, :kv_lora_rank], kv[:, kv_lora_rank:]


def gather_fp8_ds_mla(cache: torch.Tensor, block_ids: Sequence[int], num_tokens: int,
                      out_kv: torch.Tensor, out_rope: torch.Tensor) -> None:
    """vLLM fp8_ds_mla cache ``[num_blocks, block_size, 656]`` uint8 -> ``kv`` ``[n, 528]``
    (fp8 latent + 4 fp32 scales, bytes as stored) and ``rope`` ``[n, 64]`` bf16 (on any
    device: the rows are gathered on the cache's device, then copied)."""
    import torch

    rows = _token_rows(cache, block_ids, num_tokens)
    split = KV_ROW_BYTES
    out_kv.copy_(rows[:, :split])
    out_rope.copy_(rows[:, split:].contiguous().view(torch.bfloat16))
