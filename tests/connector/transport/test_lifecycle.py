"""Handoff life cycles on one process: complete, timeout, abort, busy, unclaimed,
sender gone, tensor-parallel ranks. Every test ends with a leak check."""

from __future__ import annotations

import asyncio

import pytest
import torch

from connector.kv_errors import AdmissionRefused, HandoffTimeout, TransferFailed
from connector.layout import SenderPlan, glm5_fp8_ds_mla_layout
from pd_wire.handoff import HandoffResult
from tests.connector.transport.helpers import SMALL, assert_no_leaks
from tests.connector.transport.synthetic import fill, layer_bytes, mismatches
from tests.waits import eventually

pytestmark = pytest.mark.timeout(60)


def _waiting(receiver) -> int:
    """Calls of ``wait_for`` parked on the receiver's condition (waiting for a change)."""
    return len(receiver._cond()._waiters or ())


def _send(sender, endpoint, hid, tokens, layers, seed=1, layout=SMALL):
    handoff = sender.begin(endpoint, hid, tokens, 5)
    for layer in layers:
        fill(handoff.staging(layer), layer_bytes(layout, layer, tokens, seed))
        handoff.post_layer(layer)
    return handoff


@pytest.mark.parametrize("transport", ["memory", "nixl"])
async def test_complete_handoff_waited_before_admission(kv, transport):
    async with kv.running_receiver(transport=transport) as receiver:
        sender = kv.make_sender(transport=transport)
        try:
            waiter = asyncio.create_task(receiver.wait_for("h", 10))
            await eventually(lambda: _waiting(receiver) == 1, what="the decode side to wait")
            handoff = await asyncio.to_thread(_send, sender, receiver.endpoint, "h", 50, range(3))
            assert await asyncio.to_thread(handoff.wait, 10) == "sent"
            kv = await waiter
            assert kv.num_tokens == 50 and len(kv.layers) == 3
            assert kv.layers[2]["kv"].shape == (50, 576) and kv.layers[2]["kv"].dtype == torch.bfloat16
            assert mismatches(kv.layers, SMALL, 50, 1) == []
            assert receiver.busy_slots() == 1
            receiver.release("h")
            receiver.release("h")  # idempotent
            assert_no_leaks(receiver, sender)
        finally:
            sender.close()


async def test_a_result_posted_by_the_router_completes_a_wait_for_kv_and_result(kv):
    """(A claim whose result is posted: vLLM's answer, read by the router, reaches the receiver
    through the decode server, not over the KV channel.)"""
    async with kv.running_receiver() as receiver:
        sender = kv.make_sender()
        try:
            result = HandoffResult(handoff_id="posted", kv_endpoint=receiver.endpoint, num_prompt_tokens=50,
                                   first_token_id=7, last_prompt_token_id=3, status="sent", prompt_token_ids=[1, 2])
            assert not await receiver.post_result(result)  # no such handoff here yet
            waiter = asyncio.create_task(receiver.wait_for("posted", 10, with_result=True))
            handoff = await asyncio.to_thread(_send, sender, receiver.endpoint, "posted", 50, range(3))
            assert await asyncio.to_thread(handoff.wait, 10) == "sent"
            assert not await receiver.post_result(result.model_copy(update={"num_prompt_tokens": 49}))
            assert await receiver.post_result(result)
            got = await asyncio.wait_for(waiter, 10)
            assert got.result is not None and got.result.prompt_token_ids == [1, 2]
            receiver.release("posted")
            assert_no_leaks(receiver, sender)
        finally:
            sender.close()


@pytest.mark.parametrize("transport", ["memory", "nixl"])
async def test_sender_never_completes_receiver_times_out_and_frees_the_slot(kv, transport):
    async with kv.running_receiver(transport=transport) as receiver:
        sender = kv.make_sender(transport=transport)
        try:
            handoff = await asyncio.to_thread(_send, sender, receiver.endpoint, "partial", 10, [0])
            # layer 0 landed (on a loaded machine a NIXL write can take longer than the wait below)
            await eventually(lambda: receiver._handoffs["partial"].arrived == {0}, timeout=30)
            with pytest.raises(HandoffTimeout, match="1/3 layers arrived"):
                await receiver.wait_for("partial", 0.5)
            assert receiver.busy_slots() == 0
            # the receiver revokes it: the sender stops writing into the freed slot
            await eventually(lambda: handoff.status() == "failed", timeout=5)
            assert "revoked by the decode server" in handoff.error and "timed out" in handoff.error
            handoff.post_layer(1)  # ignored: nothing more is written
            with pytest.raises(HandoffTimeout, match="never admitted"):
                await receiver.wait_for("nobody", 0.2)
            assert_no_leaks(receiver, sender)
            assert (receiver.stats.completed, receiver.stats.failed, receiver.stats.bytes_received) == (0, 1, 0)
        finally:
            sender.close()


@pytest.mark.parametrize("transport", ["memory", "nixl"])
async def test_abort_releases_the_receiver(kv, transport):
    async with kv.running_receiver(transport=transport) as receiver:
        sender = kv.make_sender(transport=transport)
        try:
            handoff = await asyncio.to_thread(_send, sender, receiver.endpoint, "ab", 10, [0, 1])
            waiter = asyncio.create_task(receiver.wait_for("ab", 10))
            await asyncio.to_thread(handoff.abort, "client went away")
            with pytest.raises(TransferFailed, match="aborted by the sender .*client went away"):
                await waiter
            assert handoff.status() == "failed" and "client went away" in handoff.error
            handoff.post_layer(2)  # posting after abort is ignored, not an error
            assert_no_leaks(receiver, sender)
        finally:
            sender.close()


async def test_busy_when_all_slots_are_taken_then_free_again(kv):
    async with kv.running_receiver(slots=1) as receiver:
        sender = kv.make_sender()
        try:
            first = await asyncio.to_thread(_send, sender, receiver.endpoint, "a", 8, range(3))
            with pytest.raises(AdmissionRefused) as info:
                await asyncio.to_thread(sender.begin, receiver.endpoint, "b", 8, 5)
            assert info.value.reason == "busy" and "1 KV receive slots" in str(info.value)
            assert await asyncio.to_thread(first.wait, 5) == "sent"
            await receiver.wait_for("a", 5)
            receiver.release("a")
            second = await asyncio.to_thread(_send, sender, receiver.endpoint, "b", 8, range(3))
            assert await asyncio.to_thread(second.wait, 5) == "sent"
            await receiver.wait_for("b", 5)
            receiver.release("b")
            assert_no_leaks(receiver, sender)
            # the decode server's /metrics reads these (decode_server_kv_*)
            stats = receiver.stats
            assert (stats.refusals, stats.completed, stats.failed) == ({"busy": 1}, 2, 0)
            assert stats.bytes_received == 2 * SMALL.num_layers * SMALL.bytes_per_layer(8)
            assert sum(stats.handoff_counts) == 2 and stats.handoff_seconds > 0  # the two completed, timed
        finally:
            sender.close()


async def test_unclaimed_handoff_is_freed(kv):
    async with kv.running_receiver(unclaimed_timeout_s=0.3) as receiver:
        sender = kv.make_sender()
        try:
            handoff = await asyncio.to_thread(_send, sender, receiver.endpoint, "lost", 8, range(3))
            assert await asyncio.to_thread(handoff.wait, 5) == "sent"
            assert receiver.busy_slots() == 1
            await eventually(lambda: receiver.busy_slots() == 0, timeout=5)
            assert_no_leaks(receiver, sender)
        finally:
            sender.close()


async def test_sender_that_disappears_fails_its_incomplete_handoffs(kv):
    async with kv.running_receiver() as receiver:
        sender = kv.make_sender()
        handoff = await asyncio.to_thread(_send, sender, receiver.endpoint, "orphan", 8, [0])
        waiter = asyncio.create_task(receiver.wait_for("orphan", 10))
        await asyncio.to_thread(sender.close)
        assert handoff.status() == "failed" and "closed" in handoff.error
        assert await asyncio.to_thread(handoff.wait, 0.1) == "failed"  # returns at once
        with pytest.raises(TransferFailed, match="disconnected after 1/3 layers"):
            await waiter
        assert_no_leaks(receiver)


async def test_sender_wait_timeout_aborts(kv):
    async with kv.running_receiver() as receiver:
        sender = kv.make_sender()
        try:
            handoff = await asyncio.to_thread(_send, sender, receiver.endpoint, "slow", 8, [0])
            assert await asyncio.to_thread(handoff.wait, 0.2) == "failed"
            assert "1/3 layers sent" in handoff.error
            with pytest.raises(TransferFailed):
                await receiver.wait_for("slow", 5)
            assert_no_leaks(receiver, sender)
        finally:
            sender.close()


def test_sender_plan_spreads_layers_round_robin():
    plans = [SenderPlan(world_size=4, rank=r) for r in range(4)]
    shares = [p.layers(79) for p in plans]
    assert shares[0][:3] == (0, 4, 8) and shares[3][-1] == 75
    assert sorted(layer for share in shares for layer in share) == list(range(79))
    assert [len(s) for s in shares] == [20, 20, 20, 19]
    assert all(plans[0].owner(layer) == layer % 4 for layer in range(79))
    assert SenderPlan(world_size=8, rank=7).layers(3) == ()
    with pytest.raises(ValueError, match="rank=2"):
        SenderPlan(world_size=2, rank=2)


async def test_tensor_parallel_ranks_complete_one_handoff_together(kv):
    layout = glm5_fp8_ds_mla_layout(6, 1)
    async with kv.running_receiver(layout, 130) as receiver:
        # the ranks of one prefill instance share a sender group: each may admit, all write
        senders = [kv.make_sender(layout, 130, sender_plan=SenderPlan(3, r), group="prefill-tp") for r in range(3)]
        try:
            waiter = asyncio.create_task(receiver.wait_for("tp", 10))
            handoffs = []
            for rank, sender in enumerate(senders[:2]):
                handoffs.append(await asyncio.to_thread(_send, sender, receiver.endpoint, "tp", 130,
                                                        sender.plan_layers, 3, layout))
                with pytest.raises(ValueError, match="not sent by this rank"):
                    handoffs[-1].post_layer((rank + 1) % 3)
            landed = sum(len(sender.plan_layers) for sender in senders[:2])
            await eventually(lambda: len(receiver._handoffs["tp"].arrived) == landed,
                             what="ranks 0 and 1's layers to land")
            assert not waiter.done()  # rank 2's layers are missing
            handoffs.append(await asyncio.to_thread(_send, senders[2], receiver.endpoint, "tp", 130,
                                                    senders[2].plan_layers, 3, layout))
            assert [await asyncio.to_thread(h.wait, 5) for h in handoffs] == ["sent"] * 3
            kv = await waiter
            assert mismatches(kv.layers, layout, 130, 3) == []
            assert kv.layers[0]["indexer"].shape == (3, 8448)
            receiver.release("tp")
            assert_no_leaks(receiver, *senders)
        finally:
            for sender in senders:
                sender.close()


async def test_stop_ends_every_wait_and_wait_before_start_is_an_error(kv):
    from connector.kv_errors import ReceiverError
    from connector.receiver import KVReceiver, ReceiverSettings

    with pytest.raises(ReceiverError, match="not running"):
        await KVReceiver(ReceiverSettings(layout=SMALL, max_tokens=8), kv.transport("memory")).wait_for("x", 1)
    async with kv.running_receiver() as receiver:
        sender = kv.make_sender()
        try:
            await asyncio.to_thread(_send, sender, receiver.endpoint, "admitted", 8, [0])
            waiters = [asyncio.create_task(receiver.wait_for(hid, 30)) for hid in ("admitted", "never-seen")]
            await eventually(lambda: _waiting(receiver) == 2, what="both waits to begin")
            await receiver.stop()
            results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 5)
            assert all(isinstance(r, ReceiverError) for r in results), results
            assert "stopped" in str(results[0]) and "stopped" in str(results[1])
            assert receiver.busy_slots() == 0
        finally:
            sender.close()


def test_settings_errors_name_option_value_and_reason():
    from connector.receiver import ReceiverSettings

    with pytest.raises(ValueError, match=r"ReceiverSettings.slots=0: must be >= 1"):
        ReceiverSettings(layout=SMALL, max_tokens=8, slots=0)
    with pytest.raises(ValueError, match=r"ReceiverSettings.port=70000: must be in 0..65535"):
        ReceiverSettings(layout=SMALL, max_tokens=8, port=70000)


async def test_one_sender_two_decode_servers(kv):
    async with kv.running_receiver() as first, kv.running_receiver() as second:
        sender = kv.make_sender()
        try:
            a = await asyncio.to_thread(_send, sender, first.endpoint, "to-first", 20, range(3), 5)
            b = await asyncio.to_thread(_send, sender, second.endpoint, "to-second", 30, range(3), 6)
            assert [await asyncio.to_thread(h.wait, 5) for h in (a, b)] == ["sent", "sent"]
            kv_a, kv_b = await first.wait_for("to-first", 5), await second.wait_for("to-second", 5)
            assert mismatches(kv_a.layers, SMALL, 20, 5) == [] and mismatches(kv_b.layers, SMALL, 30, 6) == []
            first.release("to-first")
            second.release("to-second")
            assert_no_leaks(first, sender)
            assert_no_leaks(second)
        finally:
            sender.close()


async def test_release_before_completion_revokes_and_release_before_admission_cancels(kv):
    async with kv.running_receiver() as receiver:
        sender = kv.make_sender()
        try:
            early = await asyncio.to_thread(_send, sender, receiver.endpoint, "early", 8, [0])
            receiver.release("early")  # e.g. the client went away while prefill was still sending
            assert receiver.busy_slots() == 0
            await eventually(lambda: early.status() == "failed")
            assert "released by the decode server" in early.error
            receiver.release("not-yet")  # the decode request died before prefill admitted its KV
            with pytest.raises(AdmissionRefused) as info:
                await asyncio.to_thread(sender.begin, receiver.endpoint, "not-yet", 8, 5)
            assert info.value.reason == "cancelled"
            # without a tombstone (a decode request the router gave up before any prefill for
            # it): the same id, granted later, has its KV taken
            receiver.release("later", tombstone=False)
            later = await asyncio.to_thread(sender.begin, receiver.endpoint, "later", 8, 5)  # admitted
            receiver.release("later")
            await eventually(lambda: later.status() == "failed")
            assert_no_leaks(receiver, sender)
        finally:
            sender.close()


async def test_a_retried_connection_keeps_the_senders_handoffs(kv):
    async with kv.running_receiver(disconnect_grace_s=0.3) as receiver:
        sender = kv.make_sender()
        try:
            handoff = await asyncio.to_thread(_send, sender, receiver.endpoint, "kept", 8, [0])
            old = sender._peers[receiver.endpoint]
            # a new connection of the same sender (as a retried Admit makes), then the old one breaks
            sender._peers[receiver.endpoint] = await asyncio.to_thread(sender._handshake, receiver.endpoint, 5)
            old.client.close()
            # the receiver saw the old connection go, and its disconnect grace ran out and was acted on
            await eventually(lambda: receiver.connections(sender.agent_name) == 1)
            await receiver.settled()
            for layer in (1, 2):
                handoff.post_layer(layer)
            assert await asyncio.to_thread(handoff.wait, 5) == "sent"
            await receiver.wait_for("kept", 5)
            receiver.release("kept")
            assert_no_leaks(receiver, sender)
        finally:
            sender.close()


async def test_a_crashing_sender_thread_fails_its_handoffs_instead_of_hanging(kv):
    async with kv.running_receiver() as receiver:
        sender = kv.make_sender()
        try:
            handoff = await asyncio.to_thread(sender.begin, receiver.endpoint, "crash", 8, 5)

            def broken_write(*args, **kwargs):
                raise RuntimeError("simulated bug")

            sender._transport.write = broken_write
            handoff.post_layer(0)
            assert await asyncio.to_thread(handoff.wait, 5) == "failed"
            assert "thread died: RuntimeError: simulated bug" in handoff.error
        finally:
            sender.close()
