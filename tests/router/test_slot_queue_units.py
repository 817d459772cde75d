"""The router's slot queue (pd_router/slots/queue.py) against decode servers the test answers by
hand (tests/fakes/scripted_slots.py): one standing decode request per server whatever the
queue's length, the head's grant, the swap of a stale grant (no wait, the head reserved
meanwhile), a grant for a reserved head, the standing requests closed when nobody waits."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from pd_router.fleet.backends import Backends
from pd_router.slots.pool import Slot, SlotHooks, SlotPool
from pd_wire.decode import DecodeCapabilities
from pd_wire.handoff import PROTOCOL_VERSION, PeerStatus
from tests.fakes.scripted_slots import Call, ScriptedRequest, ScriptedServers
from tests.waits import eventually

pytestmark = pytest.mark.timeout(30)
WAIT = 30.0


def _backends(n: int) -> Backends:
    b = Backends.from_urls(("http://p",), tuple(f"http://d{i}" for i in range(n)), None, True)
    b.prefill[0].healthy, b.prefill[0].models = True, frozenset({"m"})
    for d in b.decode:
        d.healthy, d.models = True, frozenset({"m"})
        d.capabilities = DecodeCapabilities(
            protocol_version=PROTOCOL_VERSION, model="m", engine="reference", slots=1, busy_slots=0,
            max_seq_len=8, num_mtp=0, kv_endpoint="h:1", layout_fingerprint="f",
            peers=[PeerStatus(peer="p", state="ok")])
    b.refresh()
    for d in b.decode:
        d.free_slots = 0  # every slot taken: requests queue (no call without wait)
    return b


class Rig:
    def __init__(self, n: int) -> None:
        self.backends = _backends(n)
        self.servers = ScriptedServers()
        self.tasks: list[asyncio.Future] = []
        self.pool = SlotPool(self.backends, 64, WAIT, "scripted", SlotHooks(spawn=self._spawn))
        self.waits: dict[str, asyncio.Task[Slot]] = {}

    def _spawn(self, coro) -> asyncio.Future:
        task = asyncio.ensure_future(coro)
        self.tasks.append(task)
        return task

    def ask(self, handoff_id: str, arrived: float) -> None:
        request = ScriptedRequest(self.servers, handoff_id, arrived)
        self.waits[handoff_id] = asyncio.ensure_future(self.pool.take("m", request, WAIT))

    def open(self) -> list[tuple[str, str, float, str | None]]:
        return [c.key for c in self.servers.open()]

    def call(self, url: str, handoff_id: str):
        return next(c for c in self.servers.open() if (c.url, c.handoff_id) == (url, handoff_id))

    def served(self) -> dict[str, str]:
        return {rid: t.result().backend.url for rid, t in self.waits.items() if t.done()}


async def _turns() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


@pytest.fixture
def rig() -> Iterator[Rig]:
    made: list[Rig] = []

    def make(n: int) -> Rig:
        made.append(Rig(n))
        return made[-1]

    yield make  # type: ignore[misc]
    for r in made:
        for task in [*r.tasks, *r.waits.values()]:
            task.cancel()


async def test_one_standing_request_per_server_the_head_and_the_swaps(rig) -> None:
    r: Rig = rig(3)
    for i, rid in enumerate(("r0", "r1", "r2")):
        r.ask(rid, float(i))
    await _turns()
    # three queued requests, three servers: three standing requests, all for the head
    assert sorted(r.open()) == [(f"d{i}", "r0", WAIT, None) for i in range(3)]
    r.call("d1", "r0").grant()
    await _turns()
    assert r.served() == {"r0": "http://d1"}
    assert ("d1", "r1", WAIT, None) in r.open()  # d1 stands for the next one
    r.call("d0", "r0").grant()  # stale: r0 was served at d1
    await _turns()
    assert ("d0", "r1", 0.0, "r0") in r.open()  # swapped for the head, at once, without wait
    r.call("d2", "r0").grant()  # stale too, while r1's swap is in flight: r1 is reserved
    await _turns()
    assert ("d2", "r2", 0.0, "r0") in r.open()
    r.call("d2", "r2").refuse()  # that slot went to a request that waited longer there
    await _turns()
    assert ("d2", "r2", WAIT, None) in r.open()  # standing again at once (no back-off)
    r.call("d0", "r1").grant()
    await _turns()
    assert r.served() == {"r0": "http://d1", "r1": "http://d0"}
    r.call("d1", "r1").grant()  # stale: swapped for r2
    await _turns()
    r.call("d1", "r2").grant()
    await _turns()
    assert r.served() == {"r0": "http://d1", "r1": "http://d0", "r2": "http://d1"}
    # nobody waits any more: the standing request left at d2 is closed (it leaves that server's queue)
    assert r.open() == [] and ("d2", "r2", WAIT, None) in [c.key for c in r.servers.calls if c.closed]
    assert r.pool.queue.waiting == 0 and r.pool.queue.standing == 0
    assert len(r.servers.calls) == 9  # each of the 3 queued requests asked each server: 9 long polls before


async def test_a_grant_for_a_head_reserved_by_a_swap_elsewhere_is_the_heads(rig) -> None:
    """A standing request's grant for the head whose swap is in flight elsewhere goes to that
    head (it waited longest): the swap's grant, when it comes, is then the stale one."""
    r: Rig = rig(3)
    for i, rid in enumerate(("r0", "r1", "r2")):
        r.ask(rid, float(i))
    await _turns()
    r.call("d0", "r0").grant()
    await _turns()
    r.call("d1", "r0").grant()  # stale: a swap for r1 at d1, r1 reserved
    await _turns()
    assert ("d1", "r1", 0.0, "r0") in r.open() and ("d0", "r1", WAIT, None) in r.open()
    r.call("d0", "r1").grant()  # d0 granted r1's standing request: r1's, although reserved
    await _turns()
    assert r.served() == {"r0": "http://d0", "r1": "http://d0"}
    r.call("d1", "r1").grant()  # the swap's grant: stale now, swapped for r2
    await _turns()
    assert ("d1", "r2", 0.0, "r1") in r.open()
    r.call("d1", "r2").grant()
    await _turns()
    assert r.served()["r2"] == "http://d1" and r.pool.queue.waiting == 0


async def test_a_refused_standing_request_is_sent_again_after_a_back_off(rig) -> None:
    r: Rig = rig(1)
    r.ask("r0", 0.0)
    await _turns()
    r.call("d0", "r0").refuse(409)  # e.g. the id still being taken out of that queue
    await _turns()
    assert r.open() == []  # not at once: a back-off
    await eventually(lambda: r.open() == [("d0", "r0", WAIT, None)], 5.0, "the standing request sent again")
    r.call("d0", "r0").grant()
    await _turns()
    assert r.served() == {"r0": "http://d0"}


async def test_a_queued_requests_decode_request_stands_for_it_and_is_closed_when_no_longer_needed(rig) -> None:
    """The standing requests are the request's own decode requests: the grant is its slot with
    the open answer; the others are closed (their calls cancelled); the router counts the
    server's free slots as its 200 said."""
    r: Rig = rig(3)
    r.ask("r0", 0.0)
    await _turns()
    assert sorted(r.open()) == [(f"d{i}", "r0", WAIT, None) for i in range(3)]
    r.call("d1", "r0").grant(free=0)
    await _turns()
    slot = r.waits["r0"].result()
    assert slot.opened is r.servers.calls[1].opened
    assert r.open() == [] and r.pool.queue.standing == 0
    assert [c.url for c in r.servers.calls if c.closed] == ["d0", "d2"]
    r.pool.release(slot)
    assert r.servers.calls[1].opened.closed  # given back unused: closing it frees the slot there


async def _stale_at_d1(r: Rig) -> Call:
    """r0 and r1 queued with their decode requests; r0 served at d0, then d1 grants r0: stale,
    a swap for r1 at d1 goes out (r1 reserved). The stale grant's call."""
    r.ask("r0", 0.0)
    r.ask("r1", 1.0)
    await _turns()
    r.call("d0", "r0").grant()
    await _turns()
    stale = r.call("d1", "r0")
    stale.grant(free=0)
    await _turns()
    return stale


async def test_a_stale_decode_grant_is_swapped_and_closed_once_the_swap_answered(rig) -> None:
    r: Rig = rig(2)
    stale = await _stale_at_d1(r)
    swap = r.call("d1", "r1")
    assert swap.key == ("d1", "r1", 0.0, "r0")
    assert not stale.opened.closed  # (closed before the swap came, its slot could go to anyone)
    swap.grant()
    await _turns()
    assert stale.opened.closed and r.served() == {"r0": "http://d0", "r1": "http://d1"}
    # d0's standing request for r1 was closed as r1 was served (nobody waits)
    assert r.open() == [] and r.pool.queue.standing == 0


async def test_a_decode_swap_dropped_in_flight_gives_its_head_back_to_the_other_servers(rig) -> None:
    """The server of a swap in flight goes away: the swap (a decode request) is closed, and the
    head it reserved is the head again, for the next grant elsewhere."""
    r: Rig = rig(3)
    await _stale_at_d1(r)
    assert ("d1", "r1", 0.0, "r0") in r.open()
    r.backends.decode[1].healthy = False
    r.backends.refresh()
    r.pool.queue.refresh()  # d1 unusable: its swap is closed
    await _turns()
    assert ("d1", "r1", 0.0, "r0") not in r.open()
    r.call("d2", "r0").grant()  # stale (r0 served at d0): r1, no longer reserved, is swapped in here
    await _turns()
    assert ("d2", "r1", 0.0, "r0") in r.open()


async def test_a_request_ahead_of_the_head_takes_its_standing_requests_place(rig) -> None:
    """A request with a better place (here its class) than the head's: the head's standing
    request is closed at each server and the newcomer's sent with its place, one close and one
    call per server; a later request behind it changes nothing."""
    r: Rig = rig(3)
    r.servers.calls.clear()
    r.waits["low"] = asyncio.ensure_future(r.pool.take("m", ScriptedRequest(r.servers, "low", 0.0, priority=10), WAIT))
    await _turns()
    assert sorted(r.open()) == [(f"d{i}", "low", WAIT, None) for i in range(3)]
    assert {c.wait.priority for c in r.servers.open()} == {10}
    r.waits["high"] = asyncio.ensure_future(r.pool.take("m", ScriptedRequest(r.servers, "high", 1.0, tenant="t"),
                                                        WAIT))
    await _turns()
    assert sorted(r.open()) == [(f"d{i}", "high", WAIT, None) for i in range(3)]
    assert [(c.wait.priority, c.wait.tenant) for c in r.servers.open()] == [(0, "t")] * 3
    assert sum(c.closed for c in r.servers.calls) == 3 and len(r.servers.calls) == 6
    r.waits["later"] = asyncio.ensure_future(r.pool.take("m", ScriptedRequest(r.servers, "later", 2.0), WAIT))
    await _turns()
    assert len(r.servers.calls) == 6  # behind the head: no call
    r.call("d0", "high").grant()
    await _turns()
    assert r.served() == {"high": "http://d0"}
    # d0 stands for the next: "later" (class 0) before "low" (class 10)
    assert ("d0", "later", WAIT, None) in r.open()
