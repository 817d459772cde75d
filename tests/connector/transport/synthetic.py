"""Deterministic synthetic KV for transport tests: the same (seed, layer) gives the same
bytes in every process, so a receiving process can check what it got independently."""

from __future__ import annotations

import torch

from connector.layout import KVLayout


def layer_bytes(layout: KVLayout, layer: int, num_tokens: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + layer)
    return {p.name: torch.randint(0, 256, (p.nbytes(num_tokens),), dtype=torch.uint8, generator=gen)
            for p in layout.planes}


def fill(views: dict[str, torch.Tensor], data: dict[str, torch.Tensor]) -> None:
    for name, view in views.items():
        view.view(torch.uint8).view(-1).copy_(data[name])


def mismatches(layers: list[dict[str, torch.Tensor]], layout: KVLayout, num_tokens: int, seed: int) -> list[str]:
    bad = []
    for i, views in enumerate(layers):
        want = layer_bytes(layout, i, num_tokens, seed)
        for name, view in views.items():
            if not torch.equal(view.contiguous().view(torch.uint8).view(-1), want[name]):
                bad.append(f"layer {i} plane {name}")
    return bad
