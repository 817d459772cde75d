"""Model profiles: which KV caches vLLM must register, and how they map onto a :class:`KVLayout`.

* ``glm5.1``: 78 main MLA layers + 1 MTP layer, each with a DSA indexer key cache (GPU);
  decode layout :func:`connector.layout.glm5_fp8_ds_mla_layout` (vLLM's ``fp8_ds_mla``
  cache row = 528 B of fp8 latent + scales, then 128 B of bf16 rope; indexer keys per
  64-token block). vLLM only allocates that layout when started with
  :attr:`ModelProfile.vllm_args` (``--kv-cache-dtype fp8_ds_mla --block-size 64``);
  :func:`cache_row_hint` names them when the rows vLLM allocated say otherwise.
* ``tiny``: N main MLA layers (N from the HF config) + 1 MTP layer, vLLM's CPU MLA cache
  (576 values per token in the model dtype), :func:`connector.layout.cpu_mla_layout`.
* ``auto``: ``glm5.1`` when the HF config has a DSA indexer (``index_topk``), else ``tiny``.

:func:`scan_layers` sorts the names vLLM passes to ``register_kv_caches`` into MLA and
indexer caches by layer; :func:`check_layers` checks them against the profile. Pure Python: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from connector.layout import DTYPE_BYTES, GLM5_MAIN_LAYERS, KVLayout, cpu_mla_layout, glm5_fp8_ds_mla_layout

MTP_FLAG = """--speculative-config '{"method":"mtp","num_speculative_tokens":1}'"""

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ProfileMismatch(RuntimeError):
    """The caches vLLM registered do not match the model profile; vLLM must not serve."""


@dataclass(frozen=True)
class ModelProfile:
    name: str
    layout: KVLayout
    cache_format: Literal["cpu_mla", "fp8_ds_mla"]  # how vLLM's MLA cache rows look
    mla_row_bytes: int  # bytes per token of vLLM's MLA cache row
    needs_indexer: bool = False
    # vLLM command-line flags without which vLLM does not allocate this cache layout
    vllm_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class LayerMap:
    """Cache names in layout order: main layers, then MTP layers; indexer names per layer (or None)."""

    mla: tuple[str, ...]
    indexer: tuple[str | None, ...]

    def position(self, name: str) -> tuple[int, Literal["mla", "indexer"]] | None:
        if name in self.mla:
            return self.mla.index(name), "mla"
        if name in self.indexer:
            return self.indexer.index(name), "indexer"
        return None


def _itemsize(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ProfileMismatch(f"the tiny profile supports model dtypes {sorted(DTYPE_BYTES)}, not {dtype!r}")
    return DTYPE_BYTES[dtype]


def tiny_profile(num_main_layers: int, dtype: str) -> ModelProfile:
    itemsize = _itemsize(dtype)
    return ModelProfile(
        "tiny", cpu_mla_layout(num_main_layers, 1, dtype), "cpu_mla", mla_row_bytes=576 * itemsize
    )


def _per_token_bytes(layout: KVLayout) -> int:
    return sum(p.bytes_per_token for p in layout.planes)


def _page_tokens(layout: KVLayout) -> int:
    return next(p.page_tokens for p in layout.planes if p.page_tokens)


def glm51_profile(num_main_layers: int = GLM5_MAIN_LAYERS) -> ModelProfile:
    """vLLM 0.32 on SM100 allocates the ``fp8_ds_mla`` MLA rows (656 B: the layout's kv +
    rope planes) only with ``--kv-cache-dtype fp8_ds_mla``; ``--block-size`` pins vLLM's
    block to the indexer's 64-token page, which the connector gathers block by block."""
    layout = glm5_fp8_ds_mla_layout(num_main_layers, 1)
    args = ("--kv-cache-dtype", "fp8_ds_mla", "--block-size", str(_page_tokens(layout)))
    return ModelProfile("glm5.1", layout, "fp8_ds_mla", mla_row_bytes=_per_token_bytes(layout),
                        needs_indexer=True, vllm_args=args)


def prefill_vllm_args(name: str) -> tuple[str, ...]:
    """The vLLM flags profile ``name`` needs (empty for "auto" and "tiny": vLLM's default
    cache is that layout). The prefill command builder adds them."""
    return glm51_profile().vllm_args if name == "glm5.1" else ()


# MLA cache rows vLLM 0.32 allocates for GLM-5.1 (kv_lora_rank 512 + rope 64) on SM100 by
# --kv-cache-dtype, other than fp8_ds_mla: what each means (docs/gpu_path.md).
_OTHER_MLA_ROWS = {
    576: "plain fp8 (--kv-cache-dtype fp8: FlashInfer's sparse-MLA layout, 576 fp8 values per token)",
    1152: "bf16 (--kv-cache-dtype auto, vLLM's default: 576 bf16 values per token)",
}


def cache_row_hint(row_bytes: int, profile: ModelProfile) -> str | None:
    """What to change when vLLM's MLA cache rows are ``row_bytes`` long but ``profile``
    expects another size; None when they match (or the profile needs no flag)."""
    if row_bytes == profile.mla_row_bytes or not profile.vllm_args:
        return None
    flags = " ".join(profile.vllm_args)
    meaning = _OTHER_MLA_ROWS.get(row_bytes, "not a layout the connector knows")
    return (f"vLLM allocated {row_bytes}-byte MLA cache rows: {meaning}; profile {profile.name!r} needs "
            f"{profile.cache_format} rows of {profile.mla_row_bytes} bytes: start vLLM with {flags}")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_profile(name: str, hf_config: Any, dtype: Any) -> ModelProfile:
    """The profile for ``name`` ("auto", "tiny", "glm5.1") and the served model's HF config."""
    if name == "auto":
        name = "glm5.1" if getattr(hf_config, "index_topk", None) else "tiny"
    if name == "glm5.1":
        return glm51_profile()
    if name == "tiny":
        layers = getattr(hf_config, "num_hidden_layers", None)
        if not isinstance(layers, int) or layers < 1:
            raise ProfileMismatch(
                f"profile 'tiny': the HF config has no usable num_hidden_layers ({layers!r})"
            )
        return tiny_profile(layers, _dtype_name(dtype))
    raise ProfileMismatch(f"unknown profile {name!r} (known: auto, tiny, glm5.1)")


def _layer_index(name: str) -> int | None:
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


def scan_layers(names: list[str]) -> LayerMap:
    """Sort vLLM's KV cache names by layer index into a :class:`LayerMap` (no profile check)."""
    mla: dict[int, str] = {}
    indexer: dict[int, str] = {}
    for name in names:
        idx = _layer_index(name)
        if idx is None:
            raise ProfileMismatch(f"cannot tell which layer KV cache {name!r} belongs to")
        target = indexer if "indexer" in name else mla
        if idx in target:
            raise ProfileMismatch(f"two KV caches for layer {idx}: {target[idx]!r} and {name!r}")
        target[idx] = name
    found = sorted(mla)
    if found != list(range(len(found))):
        raise ProfileMismatch(f"MLA layer indices are not 0..{len(found) - 1}: {found}")
    if sorted(indexer) and not set(indexer) <= set(found):
        raise ProfileMismatch(
            f"indexer caches for layers without an MLA cache: {sorted(set(indexer) - set(found))}"
        )
    return LayerMap(tuple(mla[i] for i in found), tuple(indexer.get(i) for i in found))


def check_layers(layers: LayerMap, profile: ModelProfile) -> None:
    """Raise :class:`ProfileMismatch` (naming the missing flag when MTP is off) unless
    ``layers`` is what ``profile`` needs."""
    layout = profile.layout
    expected, found = layout.num_layers, len(layers.mla)
    if found == layout.num_main_layers and layout.num_mtp_layers:
        raise ProfileMismatch(
            f"profile {profile.name!r} needs {layout.num_main_layers} main + {layout.num_mtp_layers} MTP MLA "
            f"layers ({expected}), but vLLM registered {found} (no MTP layer): start vLLM with {MTP_FLAG}"
        )
    if found != expected:
        raise ProfileMismatch(
            f"profile {profile.name!r} needs {expected} MLA layers ({layout.num_main_layers} main + "
            f"{layout.num_mtp_layers} MTP), but vLLM registered {found}"
        )
    with_indexer = [i for i, name in enumerate(layers.indexer) if name is not None]
    if profile.needs_indexer and len(with_indexer) != found:
        raise ProfileMismatch(
            f"profile {profile.name!r} needs a DSA indexer cache for each of the {expected} layers; "
            f"vLLM registered indexer caches for layers {with_indexer}"
        )
    if not profile.needs_indexer and with_indexer:
        raise ProfileMismatch(
            f"profile {profile.name!r} has no indexer plane, but vLLM registered "
            f"indexer caches for layers {with_indexer}"
        )


def observed_layout(layers: LayerMap, profile: ModelProfile) -> KVLayout:
    """The layout vLLM actually serves (the profile's planes, the registered layer count):
    what the handshake announces, so that a mismatch is also recorded by the decode side."""
    found = len(layers.mla)
    main = min(found, profile.layout.num_main_layers)
    return replace(profile.layout, num_main_layers=main, num_mtp_layers=found - main)
