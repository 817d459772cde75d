"""This router's queue for decode servers that own their slots, and its standing requests.

A request that finds no free slot waits here, in order of arrival at this router (a request
sent back keeps its first arrival, so it waits ahead of later ones). The router keeps at
most one **standing request** per decode server: a request waiting in that
server's queue under the id (the handoff id) and arrival of the oldest request here that
the server can serve. So a queued request costs O(1) calls, not one long poll at every
server (docs/router.md, "Decode slot leases").

A standing request is the head's **decode request** where the head can send it before its
prefill (:class:`~pd_router.lease_types.DecodeFirst`: ``HandoffClaim.wait``, protocol 7):
its 200 is the grant, and the open request holds the slot (no lease id, no renewal, no
release call: closing it gives the slot back). Elsewhere it is a lease request. Both wait in
the same queue on the server, and a swap may replace either with either.

When a server grants a standing request:

- it names the request now at the head of this queue: that request gets the lease, and the
  server gets a standing request for the next one (if any);
- it is stale (its request was served elsewhere, or left): the router sends the head's id
  and arrival with ``replaces`` naming the stale grant and no wait, in one call (a *swap*);
  the server queues the head, then releases the stale slot, which goes to whoever waits
  longest there: the head, granted at once, or an older request (the swap is then refused
  at once and a standing request for the head is sent again). A stale request stands for an
  arrival earlier than the head's, so it never loses a slot its router should have had, and
  the swap hands on any slot it should not have had: the grants stay in arrival order across
  routers, at the price of one round trip per stale grant. While its swap is in flight the
  head is reserved for it: another server's grant goes to the next request (a swap that
  waited, or one for a head that other servers kept serving, would chase the head from grant
  to grant, holding the slot: measured, ten swaps per request at 72 servers);
- nobody here waits for that server any more: the grant is released.

When nobody here waits for a server any more (the queue emptied, the server went away),
its standing request is released there (the server answers the waiting call; its
connection stays open). So each time the queue fills from empty it costs one call per
server, and when it empties one release per server: O(servers) per such turn, O(1) per
request while the queue stays (docs/benchmarks.md, the scale simulation, measures both).
Left standing instead, a request nobody waits for would keep a place in the server's queue
(the server's queue gauge would say a request waits while slots are free elsewhere), and
win each slot freed there only to give it back. One the server refused (busy, a duplicate
id still being taken out, draining) is sent again after a back-off that doubles with each
refusal in a row.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter

from pd_router.backends import Backends, DecodeBackend
from pd_router.errors import NoHealthyBackend, Overloaded
from pd_router.lease_client import Answer, LeaseClient
from pd_router.lease_types import DecodeFirst, Lease, LeaseHooks, wait_for_grant
from pd_router.rawhttp import Response
from pd_wire.handoff import SlotWait

RETRY_MIN_S = 0.05  # the first back-off after a server refused a standing request
RETRY_MAX_S = 1.0


@dataclass(eq=False)
class _Waiter:
    model: str
    lease_id: str
    arrived: float
    future: asyncio.Future[Lease] = field(repr=False)
    reserved: bool = False  # a swap for it is in flight
    decode_first: DecodeFirst | None = None  # its decode request may stand for it


@dataclass(eq=False)
class _Standing:
    backend: DecodeBackend
    lease_id: str
    dropped: bool = False
    task: asyncio.Future[None] | None = None  # its call: a decode request is dropped by cancelling it
    decode: bool = False  # the head's decode request (else a lease request)


Take = Callable[[Answer, DecodeBackend, str, str], "Lease | None"]
GiveBack = Callable[[DecodeBackend, str], None]


class LeaseQueue:
    def __init__(self, backends: Backends, client: LeaseClient, hooks: LeaseHooks, queue_timeout: float,
                 take: Take, give_back: GiveBack, release: Callable[[Lease], None]) -> None:
        self.backends = backends
        self.client = client
        self.hooks = hooks
        self.queue_timeout = queue_timeout
        self._take = take  # a grant answer -> the lease (registered and renewed), or None for a refusal
        self._give_back = give_back  # tell a server that a grant nobody uses is free again
        self._release = release  # give a lease back (as the request would have)
        self._waiters: list[_Waiter] = []  # by arrival
        self._standing: dict[str, _Standing] = {}  # backend url -> its standing request
        self._refusals: dict[str, int] = {}  # backend url -> refused standing requests in a row
        self._retry_at: dict[str, float] = {}  # backend url -> no standing request there before (loop time)
        self._retry_timer: asyncio.TimerHandle | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def standing(self) -> int:
        return len(self._standing)

    async def wait(self, model: str, lease_id: str, wait: float, arrived: float,
                   decode_first: DecodeFirst | None = None) -> Lease:
        """A lease for the request ``lease_id`` when its turn comes, within ``wait`` seconds;
        ``decode_first``: its decode request may stand for it (the lease is then that open request)."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(model, lease_id, arrived, loop.create_future(), decode_first=decode_first)
        bisect.insort(self._waiters, waiter, key=lambda w: w.arrived)
        t0 = perf_counter()
        timer = loop.call_later(wait, self._expire, waiter, t0)
        self.refresh()
        return await wait_for_grant(waiter.future, timer, self._release, lambda: self._forget(waiter))

    def fail_unservable(self) -> None:
        """Fail the waits of models no usable server serves any more; stand where one now can."""
        for waiter in list(self._waiters):
            if not self.backends.decode_available(waiter.model):
                self._forget(waiter, refresh=False)
                if not waiter.future.done():
                    waiter.future.set_exception(NoHealthyBackend.for_decode(waiter.model))
        self.refresh()

    def refresh(self) -> None:
        """A standing request at every usable server that can serve a waiter, none elsewhere."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        usable = {d.url: d for d in self.backends.decode if d.accepting and d.leases}
        for url, ask in list(self._standing.items()):
            if url not in usable or self._head(ask.backend, reserved_too=True) is None:
                self._drop(ask)
        for url, d in usable.items():
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

    def _open(self, backend: DecodeBackend, head: _Waiter, replaces: str | None = None,
              stale: Response | None = None) -> None:
        """A standing request at ``backend`` for ``head`` (its decode request where it may
        stand for it); with ``replaces`` a swap instead: ``head`` is reserved for it (no other
        server's grant takes it meanwhile), and it waits for nothing (the server answers at
        once: the slot is the head's if the head waits longest there, else it went to whoever
        does). ``stale``: the replaced grant's open decode request, closed once the swap answered."""
        decode = head.decode_first is not None and head.decode_first.fits(backend)
        ask = _Standing(backend, head.lease_id, decode=decode)
        self._standing[backend.url] = ask
        if replaces is not None:
            head.reserved = True
        ask.task = self.hooks.spawn(self._run(ask, head, replaces, stale))

    def _drop(self, ask: _Standing) -> None:
        ask.dropped = True
        if self._standing.get(ask.backend.url) is ask:
            del self._standing[ask.backend.url]
        if ask.decode:  # closing the decode request takes it out of the server's queue, or frees its grant
            if ask.task is not None:
                ask.task.cancel()
            return
        self.hooks.spawn(self.client.release(ask.backend.target, [ask.lease_id]))

    async def _ask(self, ask: _Standing, head: _Waiter, replaces: str | None) -> Answer:
        wait = 0.0 if replaces is not None else self.queue_timeout
        if ask.decode and head.decode_first is not None:
            return await head.decode_first.open(ask.backend, SlotWait(
                wait_s=wait, holder=self.client.holder, arrived_at=head.arrived, sent_at=perf_counter(),
                replaces=replaces))
        return await self.client.acquire(ask.backend.target, ask.lease_id, wait, head.arrived, replaces)

    async def _run(self, ask: _Standing, head: _Waiter, replaces: str | None, stale: Response | None) -> None:
        try:
            answer = await self._ask(ask, head, replaces)
        except asyncio.CancelledError:  # a decode request dropped (:meth:`_drop`)
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
            # take, ...): its answer, as when its decode request found a free slot; the server
            # stands for the next one here
            self.hooks.answered(d.url, "rejected")
            self._waiters.remove(head)
            head.future.set_exception(answer.rejected)
            self.refresh()
            return
        if not answer.granted:
            self._take(answer, d, "", ask.lease_id)  # reports the refusal
            # a swap refused at once (429) gave the slot to a request that waited longer
            # there: not a refusal to back off from
            if not ask.dropped and answer.unreachable is None and not (swap and answer.status == 429):
                refusals = self._refusals[d.url] = self._refusals.get(d.url, 0) + 1
                delay = min(RETRY_MAX_S, RETRY_MIN_S * 2 ** min(refusals - 1, 16))
                self._retry_at[d.url] = asyncio.get_running_loop().time() + delay
            self.refresh()
            return
        self._refusals.pop(d.url, None)
        self._retry_at.pop(d.url, None)
        # the grant is the head's: the request it was asked for, if none here that this
        # server serves waits longer (one reserved by a swap elsewhere included: that swap's
        # grant, if it comes, is then the stale one)
        if not ask.dropped and not head.future.done() and (swap or head is self._head(d, reserved_too=True)):
            lease = self._take(answer, d, head.model, ask.lease_id)
            assert lease is not None  # a grant
            self._waiters.remove(head)
            head.future.set_result(lease)
            self.refresh()
            return
        first = None if ask.dropped else self._head(d)
        if first is None:  # stale, and nobody here waits for this server
            if answer.opened is not None:
                # closed, the decode request frees its slot there once the server saw it go: not
                # counted free here before a probe or a grant says so (a decode request sent
                # meanwhile would find it still taken)
                d.lease_free = answer.free
                answer.opened.close()
            elif answer.grant is not None:
                d.lease_free = answer.grant.free
                self._give_back(d, ask.lease_id)
            self.refresh()
            return
        self._open(d, first, ask.lease_id, answer.opened)  # stale: the swap

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
