"""The decode server's lease table (decode_server/server/leases.py): FIFO across callers,
bounded queue, queue timeout, expiry, renew, the KV's and the job's holds."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_server.server.leases import LeaseRefused, LeaseTable


def run(coro):
    return asyncio.run(coro)


async def _queued(table: LeaseTable, n: int) -> None:
    """Let the new waiter's task run until it waits (a few loop turns), then check it does."""
    for _ in range(3):
        await asyncio.sleep(0)
    assert table.queued == n


def test_fifo_by_arrival_at_the_router() -> None:
    async def main() -> list[str]:
        table = LeaseTable(1, ttl_s=60, max_queue=8)
        assert await table.acquire("a") == 0
        order: list[str] = []

        async def wait(lease_id: str, age: float) -> None:
            await table.acquire(lease_id, wait_s=10, arrived_at=-age)
            order.append(lease_id)
            table.release([lease_id])

        tasks = [asyncio.create_task(wait("b", 0.0))]
        await _queued(table, 1)
        tasks.append(asyncio.create_task(wait("c", 0.0)))
        await _queued(table, 2)
        tasks.append(asyncio.create_task(wait("d", 5.0)))  # arrived at its router 5 s ago: first
        await _queued(table, 3)
        table.release(["a"])
        await asyncio.gather(*tasks)
        assert table.free == 1 and table.busy == 0
        return order

    assert run(main()) == ["d", "b", "c"]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 0.05)), min_size=2, max_size=20))
def test_one_routers_requests_keep_their_exact_order_whatever_the_transit(requests: list) -> None:
    """(gap since the previous request at the router, transit of its lease request): the
    server grants them in the router's order, whatever the transit of each lease request,
    though the router's clock is far from the server's."""
    async def main() -> list[int]:
        now = [0.0]
        table = LeaseTable(1, ttl_s=3600, max_queue=64, clock=lambda: now[0])
        await table.acquire("holding")
        router_clock, offset = 0.0, 1000.0  # the router's clock runs 1000 s behind the server's
        tasks = []
        for i, (gap, transit) in enumerate(requests):
            router_clock += gap
            now[0] = router_clock + offset + transit
            tasks.append(asyncio.create_task(table.acquire(f"r{i}", 3600, "router-1", router_clock, router_clock)))
            await _queued(table, i + 1)
        order: list[int] = []
        table.release(["holding"])
        for _ in tasks:
            done, _pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finished = [t for t in done if tasks.index(t) not in order]
            assert len(finished) == 1
            order.append(tasks.index(finished[0]))
            table.release([f"r{order[-1]}"])
            await asyncio.sleep(0)
        return order

    assert run(main()) == list(range(len(requests)))


def test_bounded_queue_and_timeout() -> None:
    async def main() -> None:
        table = LeaseTable(1, ttl_s=60, max_queue=1)
        await table.acquire("a")
        with pytest.raises(LeaseRefused) as now:
            await table.acquire("b")  # wait_s 0: a free slot now or nothing
        assert now.value.reason == "timeout"
        waiter = asyncio.create_task(table.acquire("c", wait_s=0.05))
        await _queued(table, 1)
        with pytest.raises(LeaseRefused) as full:
            await table.acquire("d", wait_s=10)
        assert full.value.reason == "queue_full"
        with pytest.raises(LeaseRefused) as late:
            await waiter
        assert late.value.reason == "timeout"
        assert table.queued == 0 and table.refusals == {"timeout": 2, "queue_full": 1}
        with pytest.raises(LeaseRefused) as dup:
            await table.acquire("a")
        assert dup.value.reason == "duplicate"

    run(main())


def test_expiry_frees_the_slot_and_its_kv() -> None:
    async def main() -> None:
        expired: list[str] = []
        gone = asyncio.Event()

        def on_expire(lease_id: str) -> None:
            expired.append(lease_id)
            table.put(lease_id, "kv")  # what the app does: the receiver frees the handoff
            gone.set()

        table = LeaseTable(1, ttl_s=0.05, max_queue=4, on_expire=on_expire)
        await table.acquire("a")
        assert table.take("a", "kv") == 0  # the KV arrived under the lease
        waiter = asyncio.create_task(table.acquire("b", wait_s=30))
        await gone.wait()
        assert await waiter == 0
        assert expired == ["a"] and table.expiries == 1
        assert table.renew(["a", "b"]) == ["a"]

    run(main())


def test_renew_and_release() -> None:
    async def main() -> None:
        table = LeaseTable(2, ttl_s=60, max_queue=4)
        await table.acquire("a")
        assert table.renew(["a", "zz"]) == ["zz"]
        assert table.release(["a", "a", "zz"]) == 1
        assert table.free == 2 and table.renew(["a"]) == ["a"]

    run(main())


def test_a_job_keeps_its_slot_past_expiry_and_its_end_ends_the_lease() -> None:
    async def main() -> None:
        ended = asyncio.Event()
        table = LeaseTable(1, ttl_s=0.02, max_queue=4, on_expire=lambda _id: ended.set())
        await table.acquire("a")
        assert table.take("a", "job") == 0
        await asyncio.wait_for(ended.wait(), 10)  # the lease ran out (nobody renews it)
        assert table.busy == 1 and table.holders("a") == {"job"} and table.expiries == 1
        table.put("a", "job")
        assert table.free == 1 and table.holders("a") == frozenset()

    run(main())


def test_implicit_lease_only_when_nobody_waits() -> None:
    async def main() -> None:
        table = LeaseTable(1, ttl_s=60, max_queue=4)
        assert table.take("x", "kv") == 0  # no lease: a free slot is taken directly
        assert table.take("y", "kv") is None  # busy
        waiter = asyncio.create_task(table.acquire("b", wait_s=10))
        await _queued(table, 1)
        table.put("x", "kv")  # the implicit lease ends with its last holder
        assert await waiter == 0
        table.release(["b"])
        late = asyncio.create_task(table.acquire("c", wait_s=10))
        await asyncio.sleep(0)
        assert await late == 0
        assert table.take("z", "kv") is None  # c holds the only slot

    run(main())


def test_cancelled_waiter_leaves_the_queue() -> None:
    async def main() -> None:
        table = LeaseTable(1, ttl_s=60, max_queue=4)
        await table.acquire("a")
        waiter = asyncio.create_task(table.acquire("b", wait_s=10))
        await _queued(table, 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert table.queued == 0
        table.release(["a"])
        assert table.free == 1

    run(main())


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.lists(st.tuples(st.sampled_from(["acquire", "release", "take", "put", "renew"]),
                                             st.integers(0, 5), st.floats(0, 5)), max_size=40))
def test_no_slot_is_double_booked_and_waiters_go_in_arrival_order(slots: int, ops: list) -> None:
    async def main() -> None:
        table = LeaseTable(slots, ttl_s=3600, max_queue=64)
        tasks: dict[str, asyncio.Task[int]] = {}
        for n, (op, key, age) in enumerate(ops):
            lease_id = f"l{key}"
            before = {w.lease_id: w.arrived for w in table._queue}
            if op == "acquire" and lease_id not in tasks and not table.holders(lease_id):
                tasks[lease_id] = asyncio.create_task(table.acquire(lease_id, wait_s=3600, arrived_at=-age))
            elif op == "release":
                table.release([lease_id])
                tasks.pop(lease_id, None)
            elif op == "take":
                table.take(lease_id, "kv")
            elif op == "put":
                table.put(lease_id, "kv")
            elif op == "renew":
                table.renew([lease_id])
            for _ in range(3):
                await asyncio.sleep(0)
            held = [slot.index for slot in table._held.values()]
            assert len(held) == len(set(held)), f"step {n}: a slot held twice"
            assert table.busy + table.free == slots and table.busy == len(held)
            assert not (table.free and table.queued), f"step {n}: a waiter waits while a slot is free"
            waiting = {w.lease_id: w.arrived for w in table._queue}
            granted = [i for i in before if i not in waiting and table.leased(i)]
            if granted and waiting:
                assert max(before[i] for i in granted) <= min(waiting.values()), f"step {n}: overtaken"
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        for lease_id in list(table._held):
            table.release([lease_id])
            table.put(lease_id, "kv")
        assert table.free == slots

    run(main())


def test_grant_now_answers_without_waiting_and_never_jumps_the_queue() -> None:
    """The lease route's fast path: a free slot with nobody waiting is granted at once (no
    task); otherwise None (the caller queues) or the same refusals as acquire."""

    async def main() -> None:
        table = LeaseTable(2, ttl_s=60, max_queue=8)
        assert table.grant_now("a") == 0 and table.grant_now("b") == 1
        assert table.grant_now("c") is None  # full: acquire would queue it
        with pytest.raises(LeaseRefused) as dup:
            table.grant_now("a")
        assert dup.value.reason == "duplicate"
        waiter = asyncio.create_task(table.acquire("w", wait_s=10))
        await _queued(table, 1)
        with pytest.raises(LeaseRefused):
            table.grant_now("w")  # queued: a duplicate too
        table.release(["a"])  # the slot goes to the waiter, not to a later grant_now
        assert table.grant_now("d") is None
        assert await waiter == 0
        table.release(["b"])
        assert table.grant_now("d") == 1
        table.close()
        with pytest.raises(LeaseRefused) as closed:
            table.grant_now("e")
        assert closed.value.reason == "closed"

    run(main())


@pytest.mark.parametrize("own_age, winner", [(5.0, "mine"), (0.0, "other")])
def test_a_swap_gives_the_stale_grants_slot_to_whoever_waits_longest(own_age: float, winner: str) -> None:
    """A router's grant for a request it served elsewhere, swapped for the request now at the
    head of its queue (``replaces``): the new request is queued before the stale slot is
    released, so the slot goes to the oldest waiter: the router's own when it is older than
    the other router's, else the other router's."""
    async def main() -> str:
        table = LeaseTable(1, ttl_s=60, max_queue=8)
        assert await table.acquire("stale") == 0
        other = asyncio.create_task(table.acquire("other", wait_s=10, arrived_at=-1.0))
        await _queued(table, 1)
        mine = asyncio.create_task(table.acquire("mine", wait_s=10, arrived_at=-own_age, replaces="stale"))
        done, _pending = await asyncio.wait({other, mine}, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and not table.leased("stale") and table.queued == 1
        first = "mine" if mine in done else "other"
        table.release([first])
        await asyncio.gather(other, mine)
        table.release(["mine", "other"])
        assert table.free == 1
        return first

    assert run(main()) == winner


def test_a_refused_swap_still_gives_the_stale_grant_back() -> None:
    async def main() -> None:
        table = LeaseTable(2, ttl_s=60, max_queue=8)
        await table.acquire("stale")
        await table.acquire("held")
        with pytest.raises(LeaseRefused) as refused:  # the new id is held here already
            await table.acquire("held", wait_s=10, replaces="stale")
        assert refused.value.reason == "duplicate"
        assert not table.leased("stale") and table.free == 1
        await table.acquire("next", replaces="held")  # a free slot: granted at once, "held" given back
        assert not table.leased("held") and table.leased("next") and table.free == 1

    run(main())


@pytest.mark.parametrize("own_age, granted", [(5.0, True), (0.0, False)])
def test_a_swap_without_wait_is_granted_or_refused_at_once(own_age: float, granted: bool) -> None:
    async def main() -> None:
        table = LeaseTable(1, ttl_s=60, max_queue=8)
        await table.acquire("stale")
        other = asyncio.create_task(table.acquire("other", wait_s=10, arrived_at=-1.0))
        await _queued(table, 1)
        if granted:
            assert await table.acquire("mine", arrived_at=-own_age, replaces="stale") == 0
            assert table.leased("mine") and table.queued == 1
            table.release(["mine"])
        else:
            with pytest.raises(LeaseRefused) as refused:
                await table.acquire("mine", arrived_at=-own_age, replaces="stale")
            assert refused.value.reason == "timeout" and table.queued == 0 and table.leased("other")
        await other
        assert not table.leased("stale")
        table.release(["other"])
        assert table.free == 1

    run(main())
