"""Packing/unpacking of both layouts against reference tensors built token by token."""

from __future__ import annotations

import pytest
import torch

from connector.layout import (
    cpu_mla_layout,
    gather_fp8_ds_mla,
    gather_pages,
    gather_tokens,
    glm5_fp8_ds_mla_layout,
    layer_views,
    packed_layers_views,
    plane_offsets,
    split_cpu_mla,
)
from decode_server.engine.tilert_kv import dequant_indexer, dequant_latent
from tests.fakes.vllm_fp8 import quantize_fp8_ds_mla

BLOCKS = [5, 2, 7, 0]  # a request's blocks, deliberately out of order


def _reference_rows(cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    block_size = cache.shape[1]
    return torch.stack([cache[block_ids[t // block_size], t % block_size] for t in range(num_tokens)])


@pytest.mark.parametrize("num_tokens", [1, 16, 37, 64])
def test_cpu_mla_gather_matches_token_by_token_reference(num_tokens):
    cache = torch.randn(8, 16, 576, dtype=torch.bfloat16)
    layout = cpu_mla_layout(2, 1)
    block = torch.zeros(layout.bytes_per_layer(num_tokens), dtype=torch.uint8)
    out = layer_views(block, layout, num_tokens)["kv"]
    gather_tokens(cache, BLOCKS, num_tokens, out)
    ref = _reference_rows(cache, BLOCKS, num_tokens)
    assert torch.equal(out, ref)
    latent, rope = split_cpu_mla(out)
    assert torch.equal(latent, ref[:, :512]) and torch.equal(rope, ref[:, 512:])


def test_gather_rejects_too_few_blocks():
    with pytest.raises(ValueError, match="need 3 blocks"):
        gather_tokens(torch.zeros(4, 16, 576), [0, 1], 40, torch.zeros(40, 576))


def _reference_quantize(latent: torch.Tensor) -> torch.Tensor:
    rows = []
    for token in latent.float():
        values, scales = [], []
        for tile in token.split(128):
            scale = max(tile.abs().max().item() / 448.0, 1e-10)
            values.append((tile / scale).to(torch.float8_e4m3fn).view(torch.uint8))
            scales.append(torch.tensor([scale], dtype=torch.float32).view(torch.uint8))
        rows.append(torch.cat(values + scales))
    return torch.stack(rows)


def test_fp8_ds_mla_quantization_matches_reference_and_roundtrips():
    latent = torch.randn(9, 512) * torch.linspace(0.01, 10, 512)
    kv = quantize_fp8_ds_mla(latent)
    assert kv.shape == (9, 528) and kv.dtype == torch.uint8
    assert torch.equal(kv, _reference_quantize(latent))
    back = dequant_latent(kv).float()  # the decode side's dequantization (bf16)
    rel = ((back - latent).abs() / latent.abs().clamp(min=1e-3)).median()
    assert rel < 0.07  # e4m3 keeps 3 mantissa bits


def test_fp8_ds_mla_cache_split_into_kv_and_rope_planes():
    num_tokens, block_size = 100, 64
    latent = torch.randn(8 * block_size, 512)
    rope = torch.randn(8 * block_size, 64, dtype=torch.bfloat16)
    rows = torch.cat([quantize_fp8_ds_mla(latent), rope.view(torch.uint8)], dim=1)  # vLLM's 656-byte rows
    cache = rows.view(8, block_size, 656)
    layout = glm5_fp8_ds_mla_layout(1, 0)
    block = torch.zeros(layout.bytes_per_layer(num_tokens), dtype=torch.uint8)
    views = layer_views(block, layout, num_tokens)
    gather_fp8_ds_mla(cache, BLOCKS, num_tokens, views["kv"], views["rope"])
    ref = _reference_rows(cache, BLOCKS, num_tokens)
    assert torch.equal(views["kv"], ref[:, :528])
    assert torch.equal(views["rope"], ref[:, 528:].contiguous().view(torch.bfloat16))
    # the planes sit where plane_offsets says, inside one contiguous layer block
    offs = plane_offsets(layout, num_tokens)
    assert offs == [0, 528 * num_tokens, 656 * num_tokens]
    assert torch.equal(block[offs[1]:offs[2]], ref[:, 528:].reshape(-1))


def test_indexer_pages_gather_and_dequantize_against_reference():
    num_tokens, page = 100, 64
    keys = torch.randn(8 * page, 128)
    scales = keys.abs().amax(dim=1) / 448.0
    q = (keys / scales[:, None]).to(torch.float8_e4m3fn)
    blocks = []
    for b in range(8):  # vLLM's indexer block: 64x128 fp8 keys, then 64 fp32 scales
        sl = slice(b * page, (b + 1) * page)
        blocks.append(torch.cat([q[sl].reshape(-1).view(torch.uint8), scales[sl].view(torch.uint8)]))
    cache = torch.stack(blocks)
    assert cache.shape == (8, 8448)
    layout = glm5_fp8_ds_mla_layout(1, 0)
    block = torch.zeros(layout.bytes_per_layer(num_tokens), dtype=torch.uint8)
    pages = layer_views(block, layout, num_tokens)["indexer"]
    assert pages.shape == (2, 8448)
    gather_pages(cache, BLOCKS, 2, pages)
    assert torch.equal(pages[0], cache[5]) and torch.equal(pages[1], cache[2])
    # the decode side's dequantization (bf16; the identity instead of the Hadamard rotation)
    got = dequant_indexer(pages, num_tokens, torch.eye(128))
    ref = torch.stack([q[BLOCKS[t // page] * page + t % page].float() * scales[BLOCKS[t // page] * page + t % page]
                       for t in range(num_tokens)])
    assert got.shape == (num_tokens, 128) and torch.equal(got, ref.to(torch.bfloat16))


@pytest.mark.parametrize("layout", [glm5_fp8_ds_mla_layout(3, 1), cpu_mla_layout(2, 1, "bfloat16"),
                                    cpu_mla_layout(2, 1, "float32")], ids=["glm5", "cpu-bf16", "cpu-fp32"])
@pytest.mark.parametrize("num_tokens", [1, 37, 64, 129])
def test_packed_layers_views_equal_per_layer_views(layout, num_tokens):
    size = layout.bytes_per_layer(num_tokens)
    buffer = torch.randint(0, 256, (8 + layout.num_layers * size + 8,), dtype=torch.uint8)
    block = buffer[8:]  # not at the start of its storage, as a receive slot
    got = packed_layers_views(block, layout, num_tokens, layout.num_layers)
    assert len(got) == layout.num_layers
    for i, views in enumerate(got):
        ref = layer_views(block[i * size:(i + 1) * size], layout, num_tokens)
        assert list(views) == list(ref)
        for name, tensor in views.items():
            assert tensor.dtype == ref[name].dtype and tensor.shape == ref[name].shape
            assert tensor.is_contiguous() and tensor.data_ptr() == ref[name].data_ptr()
            assert torch.equal(tensor.view(torch.uint8), ref[name].view(torch.uint8))
    # views, not copies: a write through one shows in the buffer
    got[-1][layout.planes[0].name].view(torch.uint8).fill_(7)
    first = plane_offsets(layout, num_tokens)[0]
    assert int(block[(layout.num_layers - 1) * size + first]) == 7
