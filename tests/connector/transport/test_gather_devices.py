"""Gathers from a cache on another device than the staging (a CUDA cache into host
staging), checked on CPU: the cache lives on PyTorch's ``meta`` device (shapes, no data),
every op runs for real except the copies out of ``meta``, which are counted instead (they
have no bytes to move). What a GPU adds, that the bytes arrive, is bench/gpu_check.py's."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from connector.layout import (
    cpu_mla_layout,
    gather_fp8_ds_mla,
    gather_layer,
    gather_pages,
    gather_tokens,
    glm5_fp8_ds_mla_layout,
    layer_views,
)

pytestmark = pytest.mark.timeout(60)
BLOCKS = [5, 1, 7, 3, 0, 6]


class CopiesOutOfMeta(TorchDispatchMode):
    """Runs every op; a copy from ``meta`` into a real tensor is recorded (destination
    shape and bytes) instead of performed. An op that mixes devices in any other way still
    raises, as it would between CUDA and CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten.copy_.default and args[1].device.type == "meta" != args[0].device.type:
            dst = args[0]
            self.copies.append((tuple(dst.shape), dst.numel() * dst.element_size()))
            return dst
        return func(*args, **(kwargs or {}))


def test_token_rows_from_another_device_are_one_copy():
    cache = torch.empty(8, 16, 576, dtype=torch.bfloat16, device="meta")
    out = torch.zeros(37, 576, dtype=torch.bfloat16)  # 2 full blocks + a 5-token tail
    with CopiesOutOfMeta() as mode:
        gather_tokens(cache, BLOCKS, 37, out)
    assert mode.copies == [((37, 576), 37 * 576 * 2)]


def test_indexer_pages_from_another_device_are_one_copy():
    cache = torch.empty(8, 1, 64, 132, dtype=torch.uint8, device="meta")  # vLLM's [B, H, N, C] view
    out = torch.zeros(3, 8448, dtype=torch.uint8)
    with CopiesOutOfMeta() as mode:
        gather_pages(cache, BLOCKS, 3, out)
    assert mode.copies == [((3, 8448), 3 * 8448)]


def test_fp8_ds_mla_rows_from_another_device():
    cache = torch.empty(8, 64, 656, dtype=torch.uint8, device="meta")
    kv, rope = torch.zeros(70, 528, dtype=torch.uint8), torch.zeros(70, 64, dtype=torch.bfloat16)
    with CopiesOutOfMeta() as mode:
        gather_fp8_ds_mla(cache, BLOCKS, 70, kv, rope)
    assert mode.copies == [((70, 528), 70 * 528), ((70, 64), 70 * 128)]


@pytest.mark.parametrize("num_tokens", [64, 333])
def test_one_copy_per_layer_into_packed_staging(num_tokens):
    layout = glm5_fp8_ds_mla_layout(2, 1)
    block = torch.zeros(layout.bytes_per_layer(num_tokens), dtype=torch.uint8)
    views = layer_views(block, layout, num_tokens)
    cache = torch.empty(8, 64, 656, dtype=torch.uint8, device="meta")
    indexer = torch.empty(8, 1, 64, 132, dtype=torch.uint8, device="meta")
    with CopiesOutOfMeta() as mode:
        gather_layer(cache, BLOCKS, num_tokens, views, indexer)
    assert mode.copies == [((block.numel(),), block.numel())]
    # planes that do not lie back to back: one copy each
    apart = {name: torch.zeros_like(view) for name, view in views.items()}
    with CopiesOutOfMeta() as mode:
        gather_layer(cache, BLOCKS, num_tokens, apart, indexer)
    assert [nbytes for _, nbytes in mode.copies] == [v.numel() * v.element_size() for v in apart.values()]
    layout = cpu_mla_layout(2, 1)
    views = layer_views(torch.zeros(layout.bytes_per_layer(num_tokens), dtype=torch.uint8), layout, num_tokens)
    with CopiesOutOfMeta() as mode:
        gather_layer(torch.empty(8, 64, 576, dtype=torch.bfloat16, device="meta"), BLOCKS, num_tokens, views)
    assert mode.copies == [((num_tokens, 576), num_tokens * 1152)]


def test_gather_layer_bytes_on_one_device():
    """Same device: gather_layer writes exactly what the per-plane gathers write."""
    gen = torch.Generator().manual_seed(3)
    layout, n = glm5_fp8_ds_mla_layout(2, 1), 333
    cache = torch.randint(0, 256, (8, 64, 656), dtype=torch.uint8, generator=gen)
    indexer = torch.randint(0, 256, (8, 1, 64, 132), dtype=torch.uint8, generator=gen)
    got = layer_views(torch.zeros(layout.bytes_per_layer(n), dtype=torch.uint8), layout, n)
    gather_layer(cache, BLOCKS, n, got, indexer)
    rows = torch.cat([cache[b] for b in BLOCKS])[:n]
    assert torch.equal(got["kv"], rows[:, :528]) and torch.equal(got["rope"].view(torch.uint8), rows[:, 528:])
    assert torch.equal(got["indexer"], torch.stack([indexer[b].reshape(-1) for b in BLOCKS]))
    with pytest.raises(ValueError, match="indexer cache"):
        gather_layer(cache, BLOCKS, n, got)
