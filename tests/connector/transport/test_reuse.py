"""A handoff that reuses KV its slot keeps: the Admit offers the prompt's block hashes, the
receiver's slot source answers how many leading tokens it keeps, and the sender writes only
every plane's bytes past them (paged planes included; an MTP layer's from one block earlier),
over NIXL and the memory fabric."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from connector.layout import KVLayout, glm5_fp8_ds_mla_layout
from connector.prefix import PREFIX_BLOCK_TOKENS, block_hashes, first_written, matched_tokens, split_prompt
from tests.connector.transport.helpers import assert_no_leaks
from tests.connector.transport.synthetic import fill, layer_bytes

pytestmark = pytest.mark.timeout(60)
GLM = glm5_fp8_ds_mla_layout(num_main_layers=2, num_mtp_layers=1)


class KeepingSlots:
    """One slot that keeps the token ids of the last prompt it received (a decode server's slot
    table does so with its answer's too)."""

    def __init__(self) -> None:
        self.kept: list[int] = []
        self.offered: list[tuple[str, int]] = []  # (handoff id, tokens reused)

    def take(self, handoff_id: str) -> int | None:
        return 0

    def give(self, handoff_id: str, slot: int) -> None:
        pass

    def reuse(self, handoff_id: str, slot: int, prefix: Sequence[str], num_tokens: int) -> int:
        reused = matched_tokens(prefix, block_hashes(self.kept), len(self.kept), num_tokens)
        self.offered.append((handoff_id, reused))
        return reused


def _rows(layout: KVLayout, data: dict[str, torch.Tensor], num_tokens: int, start: int) -> dict[str, torch.Tensor]:
    """Each plane's bytes from token ``start`` on (whole pages of a paged plane)."""
    return {p.name: data[p.name][p.nbytes(start):p.nbytes(num_tokens)] for p in layout.planes}


def _send(sender, endpoint: str, hid: str, ids: list[int], seed: int) -> object:
    handoff = sender.begin(endpoint, hid, len(ids), 5, prefix=split_prompt(ids))
    for layer in range(GLM.num_layers):
        fill(handoff.staging(layer), layer_bytes(GLM, layer, len(ids), seed))
    handoff.post_layers(list(range(GLM.num_layers)))
    return handoff


@pytest.mark.parametrize("transport", ["memory", "nixl"])
async def test_only_the_kv_past_the_kept_blocks_is_written(kv, transport):
    first = list(range(1000, 1200))  # 200 tokens: 3 full blocks kept
    second = first[:150] + list(range(5000, 5110))  # differs from token 150 on: 2 blocks match
    slots = KeepingSlots()
    async with kv.running_receiver(layout=GLM, max_tokens=512, transport=transport) as receiver:
        receiver.use_slots(slots)
        sender = kv.make_sender(layout=GLM, max_tokens=512, transport=transport)
        try:
            handoff = await asyncio.to_thread(_send, sender, receiver.endpoint, "a", first, 1)
            assert await asyncio.to_thread(handoff.wait, 10) == "sent"
            got = await receiver.wait_for("a", 10)
            assert got.reused == 0 and list(got.tail) == first[192:] and len(got.prefix) == 3
            receiver.release("a")
            slots.kept = first
            receiver._buffer.view(torch.uint8).fill_(0xAB)  # bytes no handoff wrote since

            handoff = await asyncio.to_thread(_send, sender, receiver.endpoint, "b", second, 2)
            assert handoff.reused == 2 * PREFIX_BLOCK_TOKENS
            assert await asyncio.to_thread(handoff.wait, 10) == "sent"
            got = await receiver.wait_for("b", 10)
            assert got.reused == 128 and slots.offered[-1] == ("b", 128)
            n = len(second)
            kept = 0
            for layer, views in enumerate(got.layers):
                sent = layer_bytes(GLM, layer, n, 2)
                start = first_written(128, GLM.is_mtp(layer))
                assert start == (64 if layer == 2 else 128)
                for plane in GLM.planes:
                    raw = views[plane.name].contiguous().view(torch.uint8).view(-1)
                    skip = plane.nbytes(start)
                    kept += skip
                    assert torch.equal(raw[skip:], _rows(GLM, sent, n, start)[plane.name]), (layer, plane.name)
                    assert bool((raw[:skip] == 0xAB).all()), f"layer {layer} {plane.name}: a reused byte was written"
            stats = receiver.stats
            assert (stats.reused_tokens, stats.pushed_tokens, stats.reused_handoffs) == (128, 200 + n - 128, 1)
            assert stats.bytes_reused == kept
            assert stats.bytes_received == (GLM.bytes_per_layer(200) + GLM.bytes_per_layer(n)) * GLM.num_layers - kept
            receiver.release("b")
            assert_no_leaks(receiver, sender)
        finally:
            sender.close()


async def test_a_prompt_that_keeps_nothing_or_differs_in_its_first_block_is_written_whole(kv):
    slots = KeepingSlots()
    slots.kept = list(range(300))
    async with kv.running_receiver(layout=GLM, max_tokens=512) as receiver:
        receiver.use_slots(slots)
        sender = kv.make_sender(layout=GLM, max_tokens=512)
        try:
            other = [7, *range(1, 300)]  # the first token differs
            handoff = await asyncio.to_thread(_send, sender, receiver.endpoint, "c", other, 3)
            assert handoff.reused == 0 and await asyncio.to_thread(handoff.wait, 10) == "sent"
            receiver.release("c")
            same = list(range(128))  # all of it kept, but its last token's KV always comes with it
            handoff = await asyncio.to_thread(_send, sender, receiver.endpoint, "d", same, 4)
            assert handoff.reused == 64 and await asyncio.to_thread(handoff.wait, 10) == "sent"
            receiver.release("d")
            assert_no_leaks(receiver, sender)
        finally:
            sender.close()


def test_matched_tokens_is_whole_blocks_within_both_lengths():
    ids = list(range(1000))
    hashes = block_hashes(ids)
    assert len(hashes) == 1000 // 64 and block_hashes(ids[:130]) == hashes[:2]
    assert block_hashes(ids[64:128], hashes[0]) == [hashes[1]]  # a chain continued from a block
    assert matched_tokens(hashes, hashes, 1000, 1000) == 960  # one token short of the prompt
    assert matched_tokens(hashes, hashes, 700, 1000) == 640  # within the kept length
    assert matched_tokens(hashes, hashes, 1000, 64) == 0
    changed = block_hashes([*ids[:200], 9999, *ids[201:]])
    assert matched_tokens(changed, hashes, 1000, 1000) == 192  # up to the block of the first difference
