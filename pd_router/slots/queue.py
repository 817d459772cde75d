"""This router's queue for decode slots, and its standing decode requests.

A request that finds no free slot waits here, in the order of its place
(:class:`pd_router.slots.fair.Place`: priority class, fair share between tenants, arrival; a request
sent back keeps its place, so it waits ahead of later ones; one that waited ``--priority-aging``
seconds moves ahead of every class). A server the router counts (a plain vLLM decode:
:attr:`DecodeBackend.owns_slots` false) gives a slot freed there to the first request here it
serves. For the servers of ours, which hold their slots for decode requests, the router keeps
at most one **standing decode request** per server: the decode request of the first request
here that the server serves (its *head*), waiting in that server's queue under its handoff id
and place (``HandoffClaim.wait``). A request that comes ahead of the head (a better class, a
tenant's fair share, aged) takes the standing request's place: that one is closed and the new
head's sent, one close and one call per server. So a queued request costs O(1) calls, not one
at every server (docs/router.md, "Decode slots"). The standing request's 200 is the grant, and
the open request holds the slot: closing it gives the slot back.

When a server grants a standing decode request:

- it is the head of this queue: that request gets the slot (the open answer), and the server
  gets a standing request for the next one (if any);
- it is stale (its request was served elsewhere, or left): the router sends the head's decode
  request with ``replaces`` naming the stale one and no wait, in one call (a *swap*); the
  server queues the head, then takes the stale request's slot (its answer ends), which goes to
  the first place there: the head, granted at once, or an earlier one (the swap is then
  refused at once and a standing request for the head is sent again). A stale request stands
  for a place no later than the head's, so it never loses a slot its router should have had,
  and the swap hands on any slot it should not have had: the grants stay in the order of the
  places across routers, at the price of one round trip per stale grant. While its swap is in
  flight the head is reserved for it: another server's grant goes to the next request (a swap that
  waited, or one for a head that other servers kept serving, would chase the head from grant to
  grant, holding the slot: measured, ten swaps per request at 72 servers);
- nobody here waits for that server any more: the grant is closed (the slot is free there).

When nobody here waits for a server any more (the queue emptied, the server went away), its
standing request is closed, which takes it out of the server's queue. So each time the queue
fills from empty it costs one call per server, and when it empties one close per server:
O(servers) per such turn, O(1) per request while the queue stays (docs/benchmarks.md, the scale
simulation, measures both). One the server refused (busy, its id still being taken out,
draining) is sent again after the back-off of :func:`backoff`. A decode request the server
refuses for what it asks (a 4xx other than 409 and 429) is that request's answer.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Protocol

from pd_router.errors import NoHealthyBackend, Overloaded, RouterError
from pd_router.fleet.backends import Backends, DecodeBackend
from pd_router.slots.fair import AGED, Place
from pd_router.upstream.rawhttp import Response
from pd_wire.handoff import SlotWait

BACKOFF_MIN_S = 0.05  # the first back-off after a server refused
BACKOFF_MAX_S = 1.0  # it doubles with each refusal in a row, up to this


def backoff(refusals: int) -> float:
    """Seconds before asking a server again after ``refusals`` refusals in a row."""
    return min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** min(max(refusals, 1) - 1, 16))


@dataclass(frozen=True)
class Answer:
    """A decode server's answer to a decode request asking for its slot."""

    status: int  # 0: no answer (unreachable, hung, invalid)
    opened: Response | None = None  # 200: the decode request holding its slot, its answer open
    rtt: float = 0.0
    immediate: bool = False  # asked without waiting
    unreachable: str | None = None  # the connection failed before any answer: why
    # the decode request refused for what it asks (a 4xx other than 409 and 429; or by the
    # router, for what the server's capabilities exclude): the request's answer
    rejected: RouterError | None = None
    free: int = 0  # with ``opened``: the server's free slots after that grant

    @property
    def result(self) -> str:
        """The answer as ``pd_router_slot_requests_total`` counts it."""
        if self.opened is not None:
            return "granted"
        if self.rejected is not None:
            return "rejected"
        return {429: "refused", 409: "conflict", 503: "unavailable"}.get(self.status, "error")


@dataclass(eq=False)
class Slot:
    """A decode slot this router's request holds: at a server of ours, its decode request's open
    answer (:meth:`take_opened`); at a server the router counts, nothing but the count."""

    backend: DecodeBackend
    model: str
    opened: Response | None = None
    released: bool = False

    def take_opened(self) -> Response | None:
        """The granted decode answer, now the caller's to read or close."""
        opened, self.opened = self.opened, None
        return opened


class SlotClaimant(Protocol):
    """What takes a slot: an attempt's decode request (:class:`pd_router.request.legs.DecodeRequest`),
    sent before its prefill to hold its slot."""

    handoff_id: str

    @property
    def place(self) -> Place:
        """Its place in the queues (its arrival: this router's ``perf_counter``)."""
        ...

    @property
    def tenant(self) -> str:
        """Whose request it is (:mod:`pd_router.tenants`)."""
        ...

    @property
    def prefixes(self) -> Mapping[str, int] | None:
        """Its conversation's prefix keys (key -> index in the chain, :mod:`pd_router.request.keys`):
        a free server keeping one is asked first (``Backends.choose_decode``); None: no preference."""
        ...

    async def open(self, backend: DecodeBackend, wait: SlotWait | None) -> Answer:
        """The decode request sent to ``backend``, waiting as ``wait`` says (None: a free slot
        now or a refusal): ``Answer.opened`` once it holds its slot, else the status that
        refused it (0: none; ``unreachable`` says why)."""
        ...


@dataclass(eq=False)
class _Waiter:
    model: str
    request: SlotClaimant
    future: asyncio.Future[Slot] = field(repr=False)
    reserved: bool = False  # a swap for it is in flight
    aged: bool = False  # it waited --priority-aging: ahead of every class
    place: Place = field(init=False)

    def __post_init__(self) -> None:
        self.place = self.request.place

    def age(self) -> None:
        self.aged = True
        self.place = Place(AGED, 0.0, self.request.place.arrived)


@dataclass(eq=False)
class _Standing:
    backend: DecodeBackend
    handoff_id: str
    place: Place
    swap: bool = False  # a swap (it replaces a stale grant): never dropped for a better head
    dropped: bool = False
    task: asyncio.Future[None] | None = None  # its call: dropped by cancelling it (closing the request)


Took = Callable[[DecodeBackend, str, Answer], "Slot | None"]  # a server's answer -> the slot (counted), or None
Counted = Callable[[DecodeBackend, str], Slot]  # a slot of a server the router counts, taken
Release = Callable[[Slot], None]
Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Future[None]"]


class SlotQueue:
    def __init__(self, backends: Backends, holder: str, queue_timeout: float, took: Took, counted: Counted,
                 release: Release, spawn: Spawn, aging: float | None = None) -> None:
        self.backends = backends
        self.holder = holder  # this router's name in the servers' queues (its clock's)
        self.queue_timeout = queue_timeout
        self.aging = aging  # --priority-aging (None: off)
        self._took = took  # a server's answer: counted and reported; the slot of a grant
        self._counted = counted  # a slot of a server the router counts, taken for a head
        self._release = release  # a slot given back (as its request would have)
        self._spawn = spawn
        self._waiters: list[_Waiter] = []  # by place
        self._tenants: dict[str, int] = {}  # tenant -> its requests waiting here
        self._ahead = False  # a request was placed ahead of another since the last refresh
        self._standing: dict[str, _Standing] = {}  # backend url -> its standing request
        self._retry_at: dict[str, float] = {}  # backend url -> no standing request there before (loop time)
        self._retry_timer: asyncio.TimerHandle | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def standing(self) -> int:
        return len(self._standing)

    def queued(self, tenant: str) -> int:
        """``tenant``'s requests waiting here."""
        return self._tenants.get(tenant, 0)

    def depths(self) -> list[tuple[str, int]]:
        """(tenant, priority) of every waiting request (the metrics' gauges)."""
        return [(w.request.tenant, w.request.place.priority) for w in self._waiters]

    async def wait(self, model: str, request: SlotClaimant, wait: float) -> Slot:
        """A slot for ``request`` when its turn comes, within ``wait`` seconds."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(model, request, loop.create_future())
        self._insert(waiter)
        tenant = request.tenant
        self._tenants[tenant] = self._tenants.get(tenant, 0) + 1
        t0 = perf_counter()
        timer = loop.call_later(wait, self._expire, waiter, t0)
        aging = None
        if self.aging is not None and waiter.place.priority != AGED:
            aging = loop.call_later(max(0.0, self.aging - (t0 - waiter.place.arrived)), self._age, waiter)
        self.refresh()
        try:
            return await waiter.future
        except BaseException:
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(fut.result())  # granted as its request went away
            self._forget(waiter)
            raise
        finally:
            timer.cancel()
            if aging is not None:
                aging.cancel()
            left = self._tenants.get(tenant, 0) - 1
            if left > 0:
                self._tenants[tenant] = left
            else:
                self._tenants.pop(tenant, None)

    def fail_unservable(self) -> None:
        """Fail the waits of models no usable server serves any more; stand where one now can."""
        for waiter in list(self._waiters):
            if not self.backends.decode_available(waiter.model):
                self._forget(waiter, refresh=False)
                if not waiter.future.done():
                    waiter.future.set_exception(NoHealthyBackend.for_decode(waiter.model))
        self.refresh()

    def refresh(self) -> None:
        """The slots of counted servers to their heads; a standing decode request at every
        server of ours that can serve a waiter, none elsewhere."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        usable = {d.url: d for d in self.backends.decode if d.accepting}
        ahead, self._ahead = self._ahead, False
        for url, ask in list(self._standing.items()):
            if url not in usable or self._head(ask.backend, reserved_too=True) is None:
                self._drop(ask)
            elif ahead and not ask.swap and (head := self._head(ask.backend)) is not None and head.place < ask.place:
                self._drop(ask)  # a request came ahead of the one it stands for: it stands for that one
        for url, d in usable.items():
            if not d.owns_slots:
                while d.free > 0 and (head := self._head(d)) is not None:
                    self._waiters.remove(head)
                    head.future.set_result(self._counted(d, head.model))
                continue
            if url in self._standing:
                continue
            head = self._head(d)
            if head is None:
                continue
            at = self._retry_at.get(url, 0.0)
            if at > now:
                if self._retry_timer is None or self._retry_timer.when() > at:
                    if self._retry_timer is not None:
                        self._retry_timer.cancel()
                    self._retry_timer = loop.call_at(at, self._retry)
                continue
            self._open(d, head)

    # ---- inside -------------------------------------------------------------------------
    def _retry(self) -> None:
        self._retry_timer = None
        self.refresh()

    def _head(self, backend: DecodeBackend, reserved_too: bool = False) -> _Waiter | None:
        """The oldest request here that ``backend`` serves (not one a swap has reserved, unless
        ``reserved_too``)."""
        return next((w for w in self._waiters if backend.serves(w.model) and not w.future.done()
                     and (reserved_too or not w.reserved)), None)

    def _insert(self, waiter: _Waiter) -> None:
        waiters = self._waiters
        if not waiters or not waiter.place < waiters[-1].place:  # (arrivals in order: the common case)
            waiters.append(waiter)
            return
        bisect.insort(waiters, waiter, key=lambda w: w.place)
        self._ahead = True  # it may come before a standing request's: refresh() looks

    def _age(self, waiter: _Waiter) -> None:
        """``waiter`` waited --priority-aging: ahead of every class, by arrival among the aged."""
        if waiter.future.done() or waiter not in self._waiters:
            return
        self._waiters.remove(waiter)
        waiter.age()
        self._insert(waiter)
        self.refresh()

    def _open(self, backend: DecodeBackend, head: _Waiter, replaces: str | None = None,
              stale: Response | None = None) -> None:
        """A standing decode request at ``backend`` for ``head``; with ``replaces`` a swap
        instead: ``head`` is reserved for it (no other server's grant takes it meanwhile), and it
        waits for nothing (the server answers at once: the slot is the head's if the head waits
        longest there, else it went to whoever does). ``stale``: the replaced grant's open
        decode request, closed once the swap answered."""
        ask = _Standing(backend, head.request.handoff_id, head.place, swap=replaces is not None)
        self._standing[backend.url] = ask
        if replaces is not None:
            head.reserved = True
        ask.task = self._spawn(self._run(ask, head, replaces, stale))

    def _drop(self, ask: _Standing) -> None:
        """Close a standing request: it leaves the server's queue, or frees its grant there."""
        ask.dropped = True
        if self._standing.get(ask.backend.url) is ask:
            del self._standing[ask.backend.url]
        if ask.task is not None:
            ask.task.cancel()

    async def _run(self, ask: _Standing, head: _Waiter, replaces: str | None, stale: Response | None) -> None:
        place = head.place
        wait = SlotWait(wait_s=0.0 if replaces is not None else self.queue_timeout, holder=self.holder,
                        arrived_at=place.arrived, sent_at=perf_counter(), replaces=replaces,
                        priority=place.priority, share=place.share, tenant=head.request.tenant[:64])
        try:
            answer = await head.request.open(ask.backend, wait)
        except asyncio.CancelledError:  # dropped (:meth:`_drop`)
            if replaces is not None:
                head.reserved = False
                self.refresh()
            raise
        finally:
            if stale is not None:  # its slot was handed on (or went to an older request there)
                stale.close()
        self._answered(ask, head, replaces, answer)

    def _answered(self, ask: _Standing, head: _Waiter, replaces: str | None, answer: Answer) -> None:
        d = ask.backend
        swap = replaces is not None
        if self._standing.get(d.url) is ask:
            del self._standing[d.url]
        if swap:
            head.reserved = False
        if answer.rejected is not None and not ask.dropped and not head.future.done():
            # the decode server refuses the request itself (a prompt or max_tokens it cannot
            # take, ...): its answer; the server stands for the next one here
            self._took(d, head.model, answer)
            self._waiters.remove(head)
            head.future.set_exception(answer.rejected)
            self.refresh()
            return
        if answer.opened is None:
            self._took(d, head.model, answer)  # reports the refusal
            # a swap refused at once (429) gave the slot to a request that waited longer
            # there: not a refusal to back off from
            if not ask.dropped and answer.unreachable is None and not (swap and answer.status == 429):
                d.refusals += 1
                self._retry_at[d.url] = asyncio.get_running_loop().time() + backoff(d.refusals)
            self.refresh()
            return
        d.refusals = 0
        self._retry_at.pop(d.url, None)
        # the grant is the head's: the request it was asked for, if none here that this
        # server serves has an earlier place (one reserved by a swap elsewhere included: that swap's
        # grant, if it comes, is then the stale one)
        if not ask.dropped and not head.future.done() and (swap or head is self._head(d, reserved_too=True)):
            slot = self._took(d, head.model, answer)
            assert slot is not None  # a grant
            self._waiters.remove(head)
            head.future.set_result(slot)
            self.refresh()
            return
        first = None if ask.dropped else self._head(d)
        if first is None:  # stale, and nobody here waits for this server
            # closed, the decode request frees its slot there once the server saw it go: not
            # counted free here before a probe or a grant says so (a decode request sent
            # meanwhile would find it still taken)
            d.free_slots = answer.free
            answer.opened.close()
            self.refresh()
            return
        self._open(d, first, ask.handoff_id, answer.opened)  # stale: the swap

    def _expire(self, waiter: _Waiter, t0: float) -> None:
        if waiter.future.done():
            return
        self._forget(waiter)
        waiter.future.set_exception(Overloaded(
            f"no decode slot became free within --queue-timeout {self.queue_timeout:g}s (waited "
            f"{perf_counter() - t0:.1f}s, {self.waiting} more requests queued here)",
            retry_after=math.ceil(min(self.queue_timeout, 30))))

    def _forget(self, waiter: _Waiter, refresh: bool = True) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return
        if refresh:
            self.refresh()
