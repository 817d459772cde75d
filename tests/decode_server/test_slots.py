"""The decode server's slot table (decode_server/server/slots.py): decode requests granted in
arrival order across routers, the bounded queue and its timeout, the KV's and the job's holds,
swaps of a stale grant."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.prefix import block_hashes
from decode_server.server.slots import Kept, SlotRefused, SlotTable, Waiter
from pd_wire.handoff import KeepKey, SlotWait


def run(coro):
    return asyncio.run(coro)


class Job:
    """A job as the table sees it; ``replaced`` counts the swaps that took its slot."""

    def __init__(self, request_id: str, keep: KeepKey | None = None) -> None:
        self.request_id = request_id
        self.keep = keep
        self.swapped = 0

    def replaced(self) -> None:
        self.swapped += 1

    def abort(self, reason: str) -> bool:
        return True


def wait(wait_s: float = 0.0, age: float = 0.0, replaces: str | None = None) -> SlotWait:
    """A claim's wait, from no router in particular: its request came ``age`` seconds before it
    was sent (the server puts it that long before now)."""
    return SlotWait(wait_s=wait_s, arrived_at=-age, sent_at=0.0, replaces=replaces)


async def acquire(table: SlotTable, handoff_id: str, job: Job, slot_wait: SlotWait | None = None,
                  kv_first: bool = False) -> int:
    """The slot of ``job``'s decode request, as a route takes it: now, or after its wait."""
    taken = table.take(handoff_id, job, slot_wait, kv_first)
    return taken if isinstance(taken, int) else await table.granted(taken)


async def take(table: SlotTable, handoff_id: str, slot_wait: SlotWait | None = None) -> int:
    return await acquire(table, handoff_id, Job(handoff_id), slot_wait)


async def _queued(table: SlotTable, n: int) -> None:
    """Let the new waiter's task run until it waits (a few loop turns), then check it does."""
    for _ in range(3):
        await asyncio.sleep(0)
    assert table.queued == n


def test_a_free_slot_is_taken_at_once_without_the_event_loop() -> None:
    """The common case (a free slot, nobody waiting) needs no task and no loop turn: the route
    takes it synchronously; without a slot, a request without a wait is refused at once."""
    table = SlotTable(1, max_queue=8)
    assert table.take("a", Job("a")) == 0 and table.busy == 1
    with pytest.raises(SlotRefused) as refused:
        table.take("b", Job("b"))
    assert refused.value.reason == "timeout" and table.queued == 0


def test_a_queued_request_has_its_place_before_it_awaits_its_grant() -> None:
    """A request that must wait is in the queue when take returns: a slot freed before its
    caller awaits the grant is its own, and a request that comes later cannot pass it (a place
    taken only once the waiting task ran left a free slot to the later one, and the queued
    request waited out its whole wait with a slot free)."""
    async def main() -> None:
        table = SlotTable(1, max_queue=8)
        assert table.take("a", Job("a")) == 0
        queued = table.take("b", Job("b"), wait(5))
        assert isinstance(queued, Waiter) and table.queued == 1
        table.release("a", "job")  # freed before b's caller awaits its grant
        later = table.take("c", Job("c"), wait(5))
        assert isinstance(later, Waiter)  # behind b, not given b's slot
        assert await asyncio.wait_for(table.granted(queued), 1) == 0
        table.leave(later)
        assert table.queued == 0 and table.holders("b") == {"job"}

    run(main())


def test_a_request_that_leaves_after_its_grant_gives_the_slot_back() -> None:
    async def main() -> None:
        table = SlotTable(1, max_queue=8)
        assert table.take("a", Job("a")) == 0
        queued = table.take("b", Job("b"), wait(5))
        assert isinstance(queued, Waiter)
        table.release("a", "job")  # granted to b...
        table.leave(queued)  # ...whose caller went away before it took the grant
        table.leave(queued)  # (idempotent)
        assert table.busy == 0 and table.queued == 0
        assert table.take("c", Job("c")) == 0

    run(main())


def test_fifo_by_arrival_at_the_router() -> None:
    async def main() -> list[str]:
        table = SlotTable(1, max_queue=8)
        assert await take(table, "a") == 0
        order: list[str] = []

        async def waiter(handoff_id: str, age: float) -> None:
            await take(table, handoff_id, wait(10, age))
            order.append(handoff_id)
            table.release(handoff_id, "job")

        tasks = [asyncio.create_task(waiter("b", 0.0))]
        await _queued(table, 1)
        tasks.append(asyncio.create_task(waiter("c", 0.0)))
        await _queued(table, 2)
        tasks.append(asyncio.create_task(waiter("d", 5.0)))  # arrived at its router 5 s ago: first
        await _queued(table, 3)
        table.release("a", "job")
        await asyncio.gather(*tasks)
        assert table.free == 1 and table.busy == 0
        return order

    assert run(main()) == ["d", "b", "c"]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 0.05)), min_size=2, max_size=20))
def test_one_routers_requests_keep_their_exact_order_whatever_the_transit(requests: list) -> None:
    """(gap since the previous request at the router, transit of its decode request): the
    server grants them in the router's order, whatever the transit of each decode request,
    though the router's clock is far from the server's."""
    async def main() -> list[int]:
        now = [0.0]
        table = SlotTable(1, max_queue=64, clock=lambda: now[0])
        await take(table, "holding")
        router_clock, offset = 0.0, 1000.0  # the router's clock runs 1000 s behind the server's
        tasks = []
        for i, (gap, transit) in enumerate(requests):
            router_clock += gap
            now[0] = router_clock + offset + transit
            slot_wait = SlotWait(wait_s=3600, holder="router-1", arrived_at=router_clock, sent_at=router_clock)
            tasks.append(asyncio.create_task(take(table, f"r{i}", slot_wait)))
            await _queued(table, i + 1)
        order: list[int] = []
        table.release("holding", "job")
        for _ in tasks:
            done, _pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finished = [t for t in done if tasks.index(t) not in order]
            assert len(finished) == 1
            order.append(tasks.index(finished[0]))
            table.release(f"r{order[-1]}", "job")
            await asyncio.sleep(0)
        return order

    assert run(main()) == list(range(len(requests)))


def test_bounded_queue_and_timeout() -> None:
    async def main() -> None:
        table = SlotTable(1, max_queue=1)
        await take(table, "a")
        with pytest.raises(SlotRefused) as now:
            await take(table, "b")  # no wait: a free slot now or nothing
        assert now.value.reason == "timeout"
        waiter = asyncio.create_task(take(table, "c", wait(0.05)))
        await _queued(table, 1)
        with pytest.raises(SlotRefused) as full:
            await take(table, "d", wait(10))
        assert full.value.reason == "queue_full"
        with pytest.raises(SlotRefused) as late:
            await waiter
        assert late.value.reason == "timeout"
        assert table.queued == 0 and table.refusals == {"timeout": 2, "queue_full": 1}
        with pytest.raises(SlotRefused) as dup:
            await take(table, "a")
        assert dup.value.reason == "duplicate"

    run(main())


def test_the_job_and_its_kv_hold_the_slot_until_both_gave_it_back() -> None:
    async def main() -> None:
        table = SlotTable(1, max_queue=4)
        job = Job("r")
        assert await acquire(table, "a", job) == 0 and table.job("a") is job and table.jobs() == [job]
        assert table.take_for_kv("a") == 0  # the KV lands on its decode request's slot
        table.release("a", "job")
        assert table.busy == 1 and table.holders("a") == {"kv"} and table.job("a") is None
        table.release("a", "kv")
        assert table.free == 1 and table.holders("a") == frozenset()

    run(main())


def test_kv_that_comes_first_takes_a_free_slot_nobody_waits_for_and_its_request_joins_it() -> None:
    async def main() -> None:
        table = SlotTable(1, max_queue=4)
        assert table.take_for_kv("x") == 0  # no decode request yet: a free slot is taken
        assert table.take_for_kv("y") is None  # busy
        with pytest.raises(SlotRefused) as dup:  # a claim's handoff must be new
            await take(table, "x")
        assert dup.value.reason == "duplicate"
        assert await acquire(table, "x", Job("x"), kv_first=True) == 0  # the request of that KV joins it
        table.release("x", "job")
        waiter = asyncio.create_task(take(table, "b", wait(10)))
        await _queued(table, 1)
        table.release("x", "kv")
        assert await waiter == 0
        assert table.take_for_kv("z") is None  # b holds the only slot

    run(main())


def test_cancelled_waiter_leaves_the_queue() -> None:
    async def main() -> None:
        table = SlotTable(1, max_queue=4)
        await take(table, "a")
        waiter = asyncio.create_task(take(table, "b", wait(10)))
        await _queued(table, 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert table.queued == 0
        other = asyncio.create_task(take(table, "c", wait(10)))
        await _queued(table, 1)
        assert table.cancel("c") and not table.cancel("c")  # the cancel endpoint: it leaves the queue
        with pytest.raises(SlotRefused) as cancelled:
            await other
        assert cancelled.value.reason == "cancelled" and table.queued == 0
        table.release("a", "job")
        assert table.free == 1

    run(main())


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.lists(st.tuples(st.sampled_from(["acquire", "release", "kv", "kv_done"]),
                                             st.integers(0, 5), st.floats(0, 5)), max_size=40))
def test_no_slot_is_double_booked_and_waiters_go_in_arrival_order(slots: int, ops: list) -> None:
    async def main() -> None:
        table = SlotTable(slots, max_queue=64)
        tasks: dict[str, asyncio.Task[int]] = {}
        for n, (op, key, age) in enumerate(ops):
            handoff_id = f"h{key}"
            before = {w.handoff_id: w.arrived for w in table._queue}
            if op == "acquire" and handoff_id not in tasks and not table.holders(handoff_id):
                tasks[handoff_id] = asyncio.create_task(take(table, handoff_id, wait(3600, age)))
            elif op == "release":  # its decode request leaves the queue, or ends
                table.cancel(handoff_id)
                table.release(handoff_id, "job")
                tasks.pop(handoff_id, None)
            elif op == "kv":
                table.take_for_kv(handoff_id)
            elif op == "kv_done":
                table.release(handoff_id, "kv")
            for _ in range(3):
                await asyncio.sleep(0)
            held = [slot.index for slot in table._held.values()]
            assert len(held) == len(set(held)), f"step {n}: a slot held twice"
            assert table.busy + table.free == slots and table.busy == len(held)
            assert not (table.free and table.queued), f"step {n}: a waiter waits while a slot is free"
            waiting = {w.handoff_id: w.arrived for w in table._queue}
            granted = [i for i in before if i not in waiting and "job" in table.holders(i)]
            if granted and waiting:
                assert max(before[i] for i in granted) <= min(waiting.values()), f"step {n}: overtaken"
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        for handoff_id in list(table._held):
            table.release(handoff_id, "job")
            table.release(handoff_id, "kv")
        assert table.free == slots

    run(main())


def test_a_free_slot_is_taken_at_once_and_never_jumps_the_queue() -> None:
    async def main() -> None:
        table = SlotTable(2, max_queue=8)
        assert await take(table, "a") == 0 and await take(table, "b") == 1
        with pytest.raises(SlotRefused):
            await take(table, "c")  # full: only a wait would queue it
        waiter = asyncio.create_task(take(table, "w", wait(10)))
        await _queued(table, 1)
        with pytest.raises(SlotRefused) as dup:
            await take(table, "w")  # queued: a duplicate
        assert dup.value.reason == "duplicate"
        table.release("a", "job")  # the slot goes to the waiter, not to a later request
        with pytest.raises(SlotRefused):
            await take(table, "d")
        assert await waiter == 0
        table.release("b", "job")
        assert await take(table, "d") == 1
        table.close()
        with pytest.raises(SlotRefused) as closed:
            await take(table, "e")
        assert closed.value.reason == "closed"

    run(main())


@pytest.mark.parametrize("own_age, winner", [(5.0, "mine"), (0.0, "other")])
def test_a_swap_gives_the_stale_grants_slot_to_whoever_waits_longest(own_age: float, winner: str) -> None:
    """A router's decode request granted for a request it served elsewhere, swapped for the
    request now at the head of its queue (``replaces``): the new request is queued before the
    stale slot is taken from its job (told: its answer ends), so the slot goes to the oldest
    waiter: the router's own when it is older than the other router's, else the other router's."""
    async def main() -> str:
        table = SlotTable(1, max_queue=8)
        stale = Job("stale")
        assert await acquire(table, "stale", stale) == 0
        other = asyncio.create_task(take(table, "other", wait(10, 1.0)))
        await _queued(table, 1)
        mine = asyncio.create_task(take(table, "mine", wait(10, own_age, replaces="stale")))
        done, _pending = await asyncio.wait({other, mine}, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and not table.holders("stale") and table.queued == 1 and stale.swapped == 1
        first = "mine" if mine in done else "other"
        table.release(first, "job")
        await asyncio.gather(other, mine)
        table.release("mine", "job")
        table.release("other", "job")
        assert table.free == 1
        return first

    assert run(main()) == winner


def test_a_refused_swap_still_gives_the_stale_grant_back() -> None:
    async def main() -> None:
        table = SlotTable(2, max_queue=8)
        await take(table, "stale")
        await take(table, "held")
        with pytest.raises(SlotRefused) as refused:  # the new id is held here already
            await take(table, "held", wait(10, replaces="stale"))
        assert refused.value.reason == "duplicate"
        assert not table.holders("stale") and table.free == 1
        await take(table, "next", wait(replaces="held"))  # a free slot: taken at once, "held" given back
        assert not table.holders("held") and table.holders("next") == {"job"} and table.free == 1

    run(main())


def test_a_swapped_slot_whose_kv_came_stays_held_by_the_kv() -> None:
    """The KV of the stale request came (its prefill ran): the swap ends the job's answer, the
    slot is free once the KV goes too."""
    async def main() -> None:
        table = SlotTable(1, max_queue=8)
        stale = Job("stale")
        await acquire(table, "stale", stale)
        assert table.take_for_kv("stale") == 0
        mine = asyncio.create_task(take(table, "mine", wait(10, replaces="stale")))
        await _queued(table, 1)
        assert stale.swapped == 1 and table.holders("stale") == {"job", "kv"}
        table.release("stale", "job")
        table.release("stale", "kv")
        assert await mine == 0

    run(main())


@pytest.mark.parametrize("own_age, granted", [(5.0, True), (0.0, False)])
def test_a_swap_without_wait_is_granted_or_refused_at_once(own_age: float, granted: bool) -> None:
    async def main() -> None:
        table = SlotTable(1, max_queue=8)
        await take(table, "stale")
        other = asyncio.create_task(take(table, "other", wait(10, 1.0)))
        await _queued(table, 1)
        if granted:
            assert await take(table, "mine", wait(0, own_age, replaces="stale")) == 0
            assert table.holders("mine") == {"job"} and table.queued == 1
            table.release("mine", "job")
        else:
            with pytest.raises(SlotRefused) as refused:
                await take(table, "mine", wait(0, own_age, replaces="stale"))
            assert refused.value.reason == "timeout" and table.queued == 0 and table.holders("other")
        await other
        assert not table.holders("stale")
        table.release("other", "job")
        assert table.free == 1

    run(main())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, 2), st.sampled_from([0.0, 0.5, 1.5]), st.integers(0, 5)),
                min_size=1, max_size=12))
def test_waiters_are_granted_by_priority_then_share_then_arrival(places: list) -> None:
    """The routers' places: lower priority first, then the lower fair-share tag, then arrival;
    the share clock of each class is the largest share granted."""

    async def body() -> None:
        table = SlotTable(1, 64)
        held = table.take("held", Job("held"))
        assert held == 0
        waiters = []
        for i, (priority, share, age) in enumerate(places):
            w = table.take(f"w{i}", Job(f"w{i}"), SlotWait(wait_s=10, arrived_at=-age, sent_at=0.0,
                                                          priority=priority, share=share, tenant=f"t{i % 3}"))
            assert isinstance(w, Waiter)
            waiters.append(w)
        order = []
        table.release("held", "job")
        for _ in places:
            granted = next(w for w in waiters if w.future.done() and w.handoff_id not in order)
            order.append(granted.handoff_id)
            table.release(granted.handoff_id, "job")
        expected = sorted(range(len(places)), key=lambda i: (places[i][0], places[i][1], -places[i][2], i))
        assert order == [f"w{i}" for i in expected]
        assert table.share_clock == {p: max(s for q, s, _ in places if q == p) for p, s, _ in places
                                     if max(s for q, s, _ in places if q == p) > 0}

    run(body())


def _keys(scope: str, conversation: str, continues: str | None = None) -> KeepKey:
    return KeepKey(scope=scope * 32, conversation=conversation * 32, continues=continues and continues * 32)


def test_a_kept_sequence_serves_only_its_scope_and_is_gone_once_the_slot_is_taken() -> None:
    ids = list(range(300))
    hashes = tuple(block_hashes(ids))
    table = SlotTable(2, max_queue=8)
    table.keeps_kv = True
    first = table.take("a", Job("a", _keys("a", "1")))
    table.keep("a", Kept("a" * 32, "1" * 32, hashes, 300))
    table.release("a", "job")
    assert table.kept() == ["1" * 32]
    # another scope continuing it takes the slot keeping it, but may not reuse it
    assert table.take("b", Job("b", _keys("b", "2", continues="1"))) == first
    assert table.reuse("b", hashes, 400) == 0 and table.kept() == []
    table.release("b", "job")  # not cleanly ended: nothing kept
    assert table.kept() == []
    table.take("c", Job("c", _keys("a", "3")))
    table.keep("c", Kept("a" * 32, "3" * 32, hashes, 300))
    table.release("c", "job")
    other = table.take("d", Job("d", _keys("a", "4")))  # continues nothing: a slot keeping nothing
    assert table.kept() == ["3" * 32] and table.reuse("d", hashes, 400) == 0
    kept_slot = table.take("e", Job("e", _keys("a", "5", continues="3")))
    assert kept_slot != other and table.reuse("e", hashes, 400) == 256


def test_a_draining_server_or_an_engine_without_kept_kv_keeps_nothing() -> None:
    table = SlotTable(1, max_queue=8)
    table.take("a", Job("a", _keys("a", "1")))
    table.keep("a", Kept("a" * 32, "1" * 32, (), 10))
    table.release("a", "job")
    assert table.kept() == []  # keeps_kv off
    table.keeps_kv = True
    table.take("b", Job("b", _keys("a", "1")))
    table.keep("b", Kept("a" * 32, "1" * 32, (), 10))
    table.close()
    table.release("b", "job")
    assert table.kept() == []
