"""The decode server's slots: the one authority on who holds which slot.

A slot is held while any of its holders remains: the router's **lease** (granted by
:meth:`LeaseTable.acquire`, ends on release, on expiry unless renewed, or when its
generation ends), the **KV** the receiver holds for the slot's handoff, and the **job**
(the generation running on it). The slot is free again once the last holder went, and
then goes to the oldest waiter at once. A lease id is its handoff id: the KV receiver
(:meth:`take` with ``"kv"``) and the generation request (``"job"``) find their slot by it.

Someone who takes a slot without a lease (a client talking to the decode server directly,
the connector's tests) gets one if a slot is free and nobody waits (an implicit lease:
no expiry, it ends with its KV and job); else the take is refused as busy. A decode request
that holds its slot itself (``HandoffClaim.grant_first``) may instead wait in the queue
(:meth:`LeaseTable.acquire` with ``kind="job"``): its grant is the job's hold, no lease.
A swap's ``replaces`` may name such a request's slot (a router's standing decode request
granted for a request it served elsewhere): the slot is handed on at once when only that
job holds it (no KV came for it), and the job is told (``on_replaced``: its answer ends).

Waiters are granted in order of arrival at their router, so several routers sharing this
server are served as one queue: a router says when the request came (``arrived_at``) and
when it sent the lease request (``sent_at``), on its own monotonic clock; the server puts
them on its clock with the smallest ``receipt - sent_at`` seen from that router (the
fastest transit observed, as NTP's minimum-delay filter), so the requests of one router
keep their exact order and those of two routers are ordered to within the difference of
their fastest transits. Bounded: ``max_queue`` waiters, each at most its ``wait_s``. Loop
thread only.

The queue's events are logged (INFO, logger ``decode_server.server.leases``; only requests
that wait: an immediate grant finds the queue empty): ``lease queued: ID arrived=T`` (T on
this server's clock; again when a faster transit moves it), ``lease granted: ID
arrived=T`` and ``lease left the queue: ID`` (timed out or gone). The order of the grants is
this server's to answer for, and its log shows it (tests/reliability/test_shared_slots.py
replays it).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

Holder = Literal["lease", "kv", "job"]
MAX_HOLDERS = 1024  # routers whose clock offset is remembered


class LeaseRefused(Exception):
    """``reason``: ``queue_full``, ``timeout``, ``duplicate`` or ``closed``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(eq=False)
class _Slot:
    lease_id: str
    index: int
    holders: set[Holder] = field(default_factory=set)
    expiry: asyncio.TimerHandle | None = None


@dataclass(order=True)
class _Waiter:
    arrived: float  # on the server's clock: ``arrived_at`` + its holder's offset
    seq: int
    lease_id: str = field(compare=False)
    future: asyncio.Future[_Slot] = field(compare=False, repr=False)
    holder: str = field(default="", compare=False)
    arrived_at: float = field(default=0.0, compare=False)
    kind: Holder = field(default="lease", compare=False)  # who holds the slot once granted


class LeaseTable:
    def __init__(self, slots: int, ttl_s: float, max_queue: int,
                 on_expire: Callable[[str], None] = lambda lease_id: None,
                 on_replaced: Callable[[str], None] = lambda lease_id: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = slots
        self.ttl_s = ttl_s
        self.max_queue = max_queue
        self.on_expire = on_expire  # a lease ran out: the app frees the KV unless a generation runs on it
        self.on_replaced = on_replaced  # a swap took a job's slot: the app ends that request's answer
        self._clock = clock
        self._free = list(range(slots - 1, -1, -1))
        self._held: dict[str, _Slot] = {}
        self._queue: list[_Waiter] = []
        self._offsets: dict[str, float] = {}  # holder -> smallest (receipt - sent_at) seen
        self._seq = itertools.count()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self.grants = 0
        self.expiries = 0
        self.refusals: dict[str, int] = {}

    # ---- what is held -----------------------------------------------------------
    @property
    def busy(self) -> int:
        return self.capacity - len(self._free)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def holders(self, lease_id: str) -> frozenset[Holder]:
        slot = self._held.get(lease_id)
        return frozenset(slot.holders) if slot is not None else frozenset()

    def leased(self, lease_id: str) -> bool:
        """Whether a router holds ``lease_id`` (granted, not ended)."""
        return "lease" in self.holders(lease_id)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    # ---- the router's lease -----------------------------------------------------
    def arrival(self, holder: str, arrived_at: float, sent_at: float) -> float:
        """When a request came to its router, on this server's clock (see the module doc);
        without a holder, now less the wait it reports. A faster transit than any seen from
        that holder moves its queued requests too (their order among themselves is kept)."""
        now = self._clock()
        if not holder:
            return now - max(0.0, sent_at - arrived_at)
        transit = now - sent_at
        best = self._offsets.get(holder)
        if best is None or transit < best:
            self._offsets.pop(holder, None)
            self._offsets[holder] = best = transit
            if len(self._offsets) > MAX_HOLDERS:  # routers restarted many times: forget the oldest
                del self._offsets[next(iter(self._offsets))]
            moved = False
            for waiter in self._queue:
                if waiter.holder == holder:
                    waiter.arrived, moved = waiter.arrived_at + best, True
                    log.info("lease queued: %s arrived=%.6f", waiter.lease_id, waiter.arrived)
            if moved:
                self._queue.sort()
        return arrived_at + best

    def grant_now(self, lease_id: str, replaces: str | None = None, kind: Holder = "lease") -> int | None:
        """A slot for ``lease_id`` (its index) if one is free and nobody waits; None when the
        caller would have to queue (:meth:`acquire` does that); raises :class:`LeaseRefused`
        (draining, or the id is held or queued). Synchronous: an immediate grant is answered
        without a task. ``replaces``: a lease given back with this request (released here
        unless the request must queue: then :meth:`acquire` releases it once it is queued).
        ``kind``: who holds the slot granted (``"job"``: a decode request holding it itself)."""
        try:
            if self._closed:
                raise self._refuse("closed", "the decode server is draining: it grants no lease")
            if lease_id in self._held or any(w.lease_id == lease_id for w in self._queue):
                raise self._refuse("duplicate", f"lease {lease_id!r} is already held or queued on this decode server")
            if not (self._free and not self._queue):
                return None
            index = self._grant(lease_id, kind).index
            self.grants += 1
        except LeaseRefused:
            self._give_back(replaces)
            raise
        self._give_back(replaces)
        return index

    async def acquire(self, lease_id: str, wait_s: float = 0.0, holder: str = "", arrived_at: float = 0.0,
                      sent_at: float = 0.0, replaces: str | None = None, kind: Holder = "lease") -> int:
        """A slot for ``lease_id`` (its index), now or within ``wait_s`` in arrival order;
        raises :class:`LeaseRefused`. Cancelling the caller leaves the queue (a slot granted
        at that moment goes back). ``replaces``: a lease of the caller's, released once this
        request is queued, so that its slot goes to whoever waits longest (this request
        included) in one step; with no wait, the request leaves the queue at once unless that
        slot came to it."""
        now = self.grant_now(lease_id, replaces, kind)
        if now is not None:
            return now
        if (wait_s <= 0 and replaces is None) or len(self._queue) >= self.max_queue:
            self._give_back(replaces)
            if wait_s <= 0:
                raise self._refuse("timeout", f"all {self.capacity} decode slots are leased")
            raise self._refuse("queue_full", f"all {self.capacity} decode slots are leased and "
                               f"{len(self._queue)} requests wait for one")
        waiter = _Waiter(self.arrival(holder, arrived_at, sent_at), next(self._seq), lease_id,
                         asyncio.get_running_loop().create_future(), holder, arrived_at, kind)
        bisect.insort(self._queue, waiter)
        log.info("lease queued: %s arrived=%.6f", lease_id, waiter.arrived)
        self._give_back(replaces)  # may grant this very request at once (its future is then done)
        if wait_s <= 0:  # a swap without wait: the slot was this request's, or it went to an older one
            if waiter.future.done():
                return waiter.future.result().index
            self._forget(waiter)
            raise self._refuse("timeout", f"the slot went to a request that waited longer; all {self.capacity} "
                               "decode slots are leased")
        try:
            async with asyncio.timeout(wait_s):
                slot = await waiter.future
        except BaseException as exc:
            self._forget(waiter)
            fut = waiter.future
            granted = fut.done() and not fut.cancelled() and fut.exception() is None
            if isinstance(exc, TimeoutError):
                if granted:
                    return fut.result().index  # granted as the wait ran out
                raise self._refuse("timeout", f"no decode slot became free within {wait_s:g}s") from None
            if granted:
                self._drop(fut.result(), kind)  # granted as the caller went away
            raise
        return slot.index

    def renew(self, lease_ids: list[str]) -> list[str]:
        """Push the expiry of these leases ``ttl_s`` ahead; returns the ids not leased here."""
        unknown = []
        for lease_id in lease_ids:
            slot = self._held.get(lease_id)
            if slot is None or "lease" not in slot.holders:
                unknown.append(lease_id)
                continue
            self._arm(slot)
        return unknown

    def release(self, lease_ids: list[str]) -> int:
        """End these leases and take their waiters out of the queue (idempotent); how many were ended."""
        ended = 0
        for lease_id in lease_ids:
            for waiter in self._queue:
                if waiter.lease_id == lease_id and not waiter.future.done():
                    waiter.future.set_exception(self._refuse("released", f"lease {lease_id!r} was released "
                                                             "while it waited"))
                    self._forget(waiter)
                    ended += 1
                    break
            slot = self._held.get(lease_id)
            if slot is not None and "lease" in slot.holders:
                self._drop(slot, "lease")
                ended += 1
        return ended

    def close(self) -> None:
        """Draining: no more leases; the waiters are refused."""
        self._closed = True
        for waiter in list(self._queue):
            if not waiter.future.done():
                waiter.future.set_exception(self._refuse("closed", "the decode server is draining"))
            log.info("lease left the queue: %s", waiter.lease_id)
        self._queue.clear()

    # ---- the KV receiver's and the generation's hold ----------------------------------
    def take(self, lease_id: str, holder: Holder) -> int | None:
        """The slot of ``lease_id`` for ``holder`` (the KV or the job); an implicit lease when
        none is granted and a slot is free with nobody waiting; None: busy."""
        slot = self._held.get(lease_id)
        if slot is None:
            if self._closed or not self._free or self._queue:
                return None
            slot = self._grant(lease_id, holder)
            return slot.index
        slot.holders.add(holder)
        return slot.index

    def put(self, lease_id: str, holder: Holder) -> None:
        """``holder`` gave the slot back (idempotent). The job's end also ends the lease: a
        lease serves one generation."""
        slot = self._held.get(lease_id)
        if slot is None:
            return
        if holder == "job":
            slot.holders.discard("lease")
        self._drop(slot, holder)

    # ---- inside -------------------------------------------------------------------------
    def _give_back(self, lease_id: str | None) -> None:
        """A swap's ``replaces``: a lease is released; a decode request's slot is taken from its
        job (told through ``on_replaced``) and handed on at once when nothing else holds it."""
        if lease_id is None:
            return
        slot = self._held.get(lease_id)
        if slot is not None and "job" in slot.holders:
            self.on_replaced(lease_id)
            if slot.holders == {"job"} and self._held.get(lease_id) is slot:
                self._drop(slot, "job")  # the job's own give-back later finds the id gone
            return
        self.release([lease_id])

    def _refuse(self, reason: str, message: str) -> LeaseRefused:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        return LeaseRefused(reason, message)

    def _grant(self, lease_id: str, holder: Holder = "lease") -> _Slot:
        slot = _Slot(lease_id, self._free.pop(), {holder})
        self._held[lease_id] = slot
        self._idle.clear()
        if holder == "lease":
            self._arm(slot)
        return slot

    def _arm(self, slot: _Slot) -> None:
        if slot.expiry is not None:
            slot.expiry.cancel()
        slot.expiry = asyncio.get_running_loop().call_later(self.ttl_s, self._expire, slot)

    def _expire(self, slot: _Slot) -> None:
        slot.expiry = None
        if "lease" not in slot.holders or self._held.get(slot.lease_id) is not slot:
            return
        self.expiries += 1
        self._drop(slot, "lease")
        self.on_expire(slot.lease_id)

    def _drop(self, slot: _Slot, holder: Holder) -> None:
        slot.holders.discard(holder)
        if holder == "lease" and slot.expiry is not None:
            slot.expiry.cancel()
            slot.expiry = None
        if slot.holders or self._held.get(slot.lease_id) is not slot:
            return
        del self._held[slot.lease_id]
        self._free.append(slot.index)
        self._dispatch()
        if not self._held:
            self._idle.set()

    def _dispatch(self) -> None:
        while self._free and self._queue:
            waiter = self._queue.pop(0)
            if waiter.future.done():  # its caller is leaving (cancelled): it never had a grant
                log.info("lease left the queue: %s", waiter.lease_id)
                continue
            waiter.future.set_result(self._grant(waiter.lease_id, waiter.kind))
            self.grants += 1
            log.info("lease granted: %s arrived=%.6f", waiter.lease_id, waiter.arrived)

    def _forget(self, waiter: _Waiter) -> None:
        try:
            self._queue.remove(waiter)
        except ValueError:
            return
        log.info("lease left the queue: %s", waiter.lease_id)
