"""The sender's lanes: how queued layers are split, and that a burst uses every idle lane."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from connector.lanes import LaneQueue
from connector.layout import glm5_fp8_ds_mla_layout
from connector.sender import lane_cpus
from tests.connector.transport.helpers import assert_no_leaks
from tests.connector.transport.synthetic import fill, layer_bytes, mismatches
from tests.waits import eventually, wait_until

pytestmark = pytest.mark.timeout(60)


def _lanes_taking(queue: LaneQueue, lanes: int) -> tuple[list[threading.Thread], list[list[int]]]:
    got: list[list[int]] = []

    def lane() -> None:
        batch, _ = queue.take(timeout=5.0)
        got.append(batch)

    threads = [threading.Thread(target=lane) for _ in range(lanes)]
    for t in threads:
        t.start()
    wait_until(lambda: queue.idle_lanes >= lanes, 5.0, f"{lanes} idle lanes", 0.001)
    return threads, got


@pytest.mark.parametrize("lanes,items,sizes", [(2, 10, [5, 5]), (2, 79, [40, 39]), (3, 7, [3, 2, 2]),
                                                (2, 1, [1, 0])])
def test_a_burst_is_split_evenly_between_idle_lanes(lanes, items, sizes):
    queue: LaneQueue[int] = LaneQueue()
    threads, got = _lanes_taking(queue, lanes)
    queue.put_many(list(range(items)))
    if items < lanes:
        queue.close()  # the lanes that got nothing return at once
    for t in threads:
        t.join(5)
    assert sorted(len(b) for b in got) == sorted(sizes)
    assert sorted(i for b in got for i in b) == list(range(items))
    for batch in got:
        assert batch == sorted(batch)  # each share is a run of consecutive items, in order


def test_a_lone_lane_takes_everything_queued():
    queue: LaneQueue[int] = LaneQueue()
    queue.put_many([1, 2, 3])
    queue.put(4)
    assert queue.take(timeout=0) == ([1, 2, 3, 4], False)
    start = time.monotonic()
    assert queue.take(timeout=0.05) == ([], False)
    assert time.monotonic() - start >= 0.04


def test_close_delivers_what_is_queued_then_stops():
    queue: LaneQueue[int] = LaneQueue()
    queue.put_many([1, 2])
    queue.close()
    assert not queue.put(3)
    assert queue.take(timeout=1) == ([1, 2], False)
    assert queue.take(timeout=1) == ([], True)
    assert len(queue) == 0


@pytest.mark.parametrize("transport", ["memory", "nixl"])
async def test_a_burst_of_layers_is_written_by_both_lanes(kv, transport):
    layout, tokens = glm5_fp8_ds_mla_layout(6, 1), 256
    sender = kv.make_sender(layout, max_tokens=tokens, transport=transport, lanes=2)
    writers: list[tuple[str, int]] = []
    write = sender._transport.write
    both = threading.Barrier(2, timeout=5)  # a lane that took both runs would wait here in vain

    def recording_write(peer, pieces, notif, remote_region=None):
        writers.append((threading.current_thread().name, sum(p[2] for p in pieces)))
        both.wait()
        return write(peer, pieces, notif, remote_region)

    sender._transport.write = recording_write  # type: ignore[method-assign]
    try:
        async with kv.running_receiver(layout, max_tokens=tokens, transport=transport) as receiver:
            handoff = await asyncio.to_thread(sender.begin, receiver.endpoint, "burst", tokens, 5)
            for layer in range(layout.num_layers):
                fill(handoff.staging(layer), layer_bytes(layout, layer, tokens, 3))
            await asyncio.to_thread(wait_until, lambda: sender._queue.idle_lanes >= 2, 5.0, "2 idle lanes", 0.001)
            handoff.post_layers(list(range(layout.num_layers)))
            kv = await receiver.wait_for("burst", timeout=10)
            assert await asyncio.to_thread(handoff.wait, 10) == "sent"
            assert mismatches(kv.layers, layout, tokens, 3) == []
            receiver.release("burst")
            assert len({name for name, _ in writers}) == 2, writers  # 4 layers on one lane, 3 on the other
            assert sorted(n for _, n in writers) == [3 * layout.bytes_per_layer(tokens),
                                                     4 * layout.bytes_per_layer(tokens)]
            await eventually(lambda: not sender._active)
            assert_no_leaks(receiver, sender)
    finally:
        sender.close()


async def test_posting_a_layer_twice_is_refused(kv):
    async with kv.running_receiver() as receiver:
        sender = kv.make_sender(lanes=1)
        try:
            handoff = await asyncio.to_thread(sender.begin, receiver.endpoint, "twice", 8, 5)
            with pytest.raises(ValueError, match="layer 0 posted twice"):
                handoff.post_layers([0, 0])
            handoff.post_layers([0, 1])
            with pytest.raises(ValueError, match="layer 1 posted twice"):
                handoff.post_layer(1)
            with pytest.raises(ValueError, match="not sent by this rank"):
                handoff.post_layers([2, 7])
            handoff.post_layer(2)
            assert await asyncio.to_thread(handoff.wait, 5) == "sent"
            await receiver.wait_for("twice", timeout=5)
            receiver.release("twice")
            assert_no_leaks(receiver, sender)
        finally:
            sender.close()


def test_lanes_are_validated(kv):
    with pytest.raises(ValueError, match="lanes=0"):
        kv.make_sender(lanes=0)
    with pytest.raises(ValueError, match="lanes=9"):
        kv.make_sender(lanes=9)


def test_lanes_pin_to_distinct_cpus_when_there_are_enough(kv):
    import os

    cpus = sorted(os.sched_getaffinity(0))
    sender = kv.make_sender(lanes=2)
    try:
        pinned = [os.sched_getaffinity(t.native_id) for t in sender._threads]
        if len(cpus) >= 2:
            assert all(len(p) == 1 for p in pinned) and pinned[0] != pinned[1]
            assert pinned[0] | pinned[1] <= set(cpus)
        else:
            assert all(p == set(cpus) for p in pinned)
    finally:
        sender.close()
    unpinned = kv.make_sender(lanes=2, pin_lanes=False)
    try:
        assert all(os.sched_getaffinity(t.native_id) == set(cpus) for t in unpinned._threads)
    finally:
        unpinned.close()
    # GPU staging is not pinned (every TP rank would pick the same CPUs), nor one lane
    assert lane_cpus(2, "cuda:0") == [] and lane_cpus(1, "cpu") == []
    assert lane_cpus(2, "cpu") == (cpus if len(cpus) >= 2 else [])


@pytest.mark.parametrize("lanes", [1, 2])
async def test_a_revocation_is_seen_while_layers_keep_coming(kv, lanes):
    """A decode server that gives up on a handoff mid-prefill stops its WRITEs at once, not
    after the model's last layer: lanes read Revoked even while every take() finds work."""
    layout, tokens = glm5_fp8_ds_mla_layout(78, 1), 16
    sender = kv.make_sender(layout, max_tokens=tokens, lanes=lanes)
    try:
        async with kv.running_receiver(layout, max_tokens=tokens) as receiver:
            handoff = await asyncio.to_thread(sender.begin, receiver.endpoint, "revoked", tokens, 5)
            posted: list[float] = []

            def model() -> None:  # a layer every 50 ms (~4 s in all) until the handoff failed
                for layer in range(layout.num_layers):
                    if handoff.status() == "failed":
                        return
                    handoff.post_layer(layer)
                    posted.append(layer)
                    time.sleep(0.05)
                posted.append(-1)  # every layer posted: the model's end

            running = asyncio.create_task(asyncio.to_thread(model))
            await eventually(lambda: len(posted) >= 5)
            receiver.release("revoked")  # incomplete: the receiver revokes it
            await eventually(lambda: handoff.status() == "failed", timeout=10)
            assert "revoked by the decode server" in handoff.error
            assert -1 not in posted, "the revocation was only seen after the last layer"
            await running
            await eventually(lambda: not sender._active)
            assert_no_leaks(receiver, sender)
    finally:
        sender.close()
