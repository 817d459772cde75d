"""The decode server's slots: one table, keyed by handoff id, the one authority on who holds
which slot.

A slot is held while any of its holders remains: the **job** (the decode request that took it:
its wait for the KV, then its generation; the table keeps the job with its slot) and the **KV**
the receiver holds for the slot's handoff. It is free once the last holder went, and then goes
to the oldest waiting decode request at once.

A decode request takes its slot (:meth:`SlotTable.take`, synchronous) now, when one is free and
nobody waits, or its place in the queue, then the slot after a wait there
(:meth:`SlotTable.granted`; its ``HandoffClaim.wait``: how long, its router and when the request
came there). KV that comes
before any decode request (a client of this server's own API that prefilled elsewhere) takes a
free slot nobody waits for (:meth:`take_for_kv`); its decode request then joins that slot.

A decode request may name in ``replaces`` another of its router's decode requests here, granted
for a request that router served elsewhere (a stale grant): this request is queued first, then
that slot is taken from its job (told through ``job.replaced()``: its answer ends) and handed on
at once when only that job held it (no KV came for it). Without a wait, the request leaves the
queue at once unless that slot came to it.

Waiting decode requests are granted in the order their routers give them: by ``priority``
(lower first), then ``share`` (the request's fair-share tag, lower first), then arrival at their
router (``SlotWait``; docs/decode_server.md, "The slot queue's order"), so several routers sharing
this server are served as one queue. For the arrival, a router says when the request came
(``arrived_at``) and when it sent the decode request (``sent_at``), on its own monotonic clock;
the server puts them on its clock with the smallest ``receipt - sent_at`` seen from that router
(the fastest transit observed, as NTP's minimum-delay filter), so the requests of one router keep
their exact order and those of two routers are ordered to within the difference of their fastest
transits. The server keeps, per priority class, the largest ``share`` it granted
(:attr:`SlotTable.share_clock`, in its capabilities): the routers' common virtual clock.
Bounded: ``max_queue`` waiters, each at most its ``wait_s``. Loop thread only.

The queue's events are logged (INFO, logger ``decode_server.server.slots``; only requests that
wait: an immediate grant finds the queue empty): ``slot queued: ID arrived=T priority=P share=S
tenant=N`` (T on this server's clock; again when a faster transit moves it), ``slot granted: ID
arrived=T priority=P share=S tenant=N`` and ``slot request left the queue: ID`` (timed out,
cancelled or gone). The order of the grants is this server's to answer
for, and its log shows it (tests/reliability/test_shared_slots.py replays it).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from connector.prefix import matched_tokens
from decode_server.server.api_errors import ApiError, Busy, Conflict, NotReady
from pd_wire.handoff import KeepKey, SlotWait, advance_share_clock

log = logging.getLogger(__name__)

Holder = Literal["kv", "job"]
MAX_ROUTERS = 1024  # routers whose clock offset is remembered


class SlotJob(Protocol):
    """What the table knows of the job holding a slot."""

    request_id: str
    keep: KeepKey | None  # its request's keys for the KV its slot keeps (HandoffClaim.keep)

    def replaced(self) -> None:
        """A swap took the slot: the job's answer ends."""

    def abort(self, reason: str) -> bool:
        """Stop the job (draining, shutdown); False when it had ended."""


class SlotRefused(Exception):
    """``reason``: ``queue_full``, ``timeout``, ``duplicate`` (``param`` names what: the handoff
    id, or the request id), ``closed`` or ``cancelled``."""

    def __init__(self, reason: str, message: str, param: str = "kv_transfer_params.handoff_id") -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.param = param

    def error(self) -> ApiError:
        """The decode request's answer: 409 (its handoff id or request id is held or queued
        here), 503 (draining), else 429."""
        if self.reason == "duplicate":
            return Conflict(self.message, self.param)
        if self.reason == "closed":
            return NotReady(self.message)
        return Busy(self.message)


@dataclass(frozen=True)
class Kept:
    """The sequence whose KV a free slot's engine state holds from the slot's last clean answer:
    its keys (:class:`pd_wire.handoff.KeepKey`), the hashes of its token ids' full blocks
    (:mod:`connector.prefix`) and its length (the positions whose KV is valid)."""

    scope: str
    conversation: str
    hashes: tuple[str, ...]
    tokens: int


@dataclass(eq=False)
class _Slot:
    handoff_id: str
    index: int
    holders: set[Holder] = field(default_factory=set)
    job: SlotJob | None = None
    reusable: Kept | None = None  # what the slot kept that this request may reuse (same scope)
    keep_after: Kept | None = None  # what it keeps once free (its answer ended cleanly)


@dataclass(order=True)
class Waiter:
    """A decode request's place in the queue (:meth:`SlotTable.take`): ``future`` is its grant;
    the caller awaits :meth:`SlotTable.granted`, or calls :meth:`SlotTable.leave` when it stops
    waiting."""

    priority: int
    share: float
    arrived: float  # on the server's clock: ``arrived_at`` + its router's offset
    seq: int
    handoff_id: str = field(compare=False)
    job: SlotJob = field(compare=False, repr=False)
    future: asyncio.Future[_Slot] = field(compare=False, repr=False)
    router: str = field(default="", compare=False)
    arrived_at: float = field(default=0.0, compare=False)
    wait_s: float = field(default=0.0, compare=False)
    settled: bool = field(default=False, compare=False)  # its grant taken, or it left
    tenant: str = field(default="", compare=False)

    def place(self) -> str:
        """Its place, as the queue log writes it."""
        return f"arrived={self.arrived:.6f} priority={self.priority} share={self.share:.6g} tenant={self.tenant or '-'}"


class SlotTable:
    def __init__(self, slots: int, max_queue: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = slots
        self.max_queue = max_queue
        self._clock = clock
        self._free = list(range(slots - 1, -1, -1))
        self._held: dict[str, _Slot] = {}  # handoff id -> its slot
        self._requests: dict[str, str] = {}  # request id -> the handoff id of its job's slot
        self._queue: list[Waiter] = []
        self._offsets: dict[str, float] = {}  # router -> smallest (receipt - sent_at) seen
        self.share_clock: dict[int, float] = {}  # priority class -> largest share granted
        self._seq = itertools.count()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self.grants = 0
        self.refusals: dict[str, int] = {}
        # slot index -> the sequence its engine state keeps (free slots only); kept only when
        # the engine can decode from kept KV (keeps_kv)
        self._kept: dict[int, Kept] = {}
        self.keeps_kv = False

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

    def holders(self, handoff_id: str) -> frozenset[Holder]:
        slot = self._held.get(handoff_id)
        return frozenset(slot.holders) if slot is not None else frozenset()

    def job(self, handoff_id: str) -> SlotJob | None:
        """The job holding the slot of ``handoff_id``."""
        slot = self._held.get(handoff_id)
        return slot.job if slot is not None and "job" in slot.holders else None

    def job_of_request(self, request_id: str) -> SlotJob | None:
        """The job of the request ``request_id`` holding a slot."""
        handoff_id = self._requests.get(request_id)
        return self.job(handoff_id) if handoff_id is not None else None

    def jobs(self) -> list[SlotJob]:
        return [s.job for s in self._held.values() if s.job is not None and "job" in s.holders]

    async def wait_idle(self) -> None:
        await self._idle.wait()

    # ---- a decode request's slot ----------------------------------------------------
    def arrival(self, router: str, arrived_at: float, sent_at: float) -> float:
        """When a request came to its router, on this server's clock (see the module doc);
        without a router, now less the wait it reports. A faster transit than any seen from
        that router moves its queued requests too (their order among themselves is kept)."""
        now = self._clock()
        if not router:
            return now - max(0.0, sent_at - arrived_at)
        transit = now - sent_at
        best = self._offsets.get(router)
        if best is None or transit < best:
            self._offsets.pop(router, None)
            self._offsets[router] = best = transit
            if len(self._offsets) > MAX_ROUTERS:  # routers restarted many times: forget the oldest
                del self._offsets[next(iter(self._offsets))]
            moved = False
            for waiter in self._queue:
                if waiter.router == router:
                    waiter.arrived, moved = waiter.arrived_at + best, True
                    log.info("slot queued: %s %s", waiter.handoff_id, waiter.place())
            if moved:
                self._queue.sort()
        return arrived_at + best

    def take(self, handoff_id: str, job: SlotJob, wait: SlotWait | None = None,
             kv_first: bool = False) -> int | Waiter:
        """The slot now (its index), without a task: a free one nobody waits for, or, with
        ``kv_first`` (the request's KV came first: a client that prefilled elsewhere), the slot
        that KV holds. Else, when its ``wait`` allows it, the request's place in the queue,
        taken now (so no request that comes later can pass it): await :meth:`granted`, or
        :meth:`leave`. Raises :class:`SlotRefused`."""
        replaces = wait.replaces if wait is not None else None
        now = self._take_now(handoff_id, job, replaces, kv_first)
        if now is not None:
            return now
        if wait is None or (wait.wait_s <= 0 and replaces is None) or len(self._queue) >= self.max_queue:
            self._give_back(replaces)
            if wait is None or wait.wait_s <= 0:
                raise self._refuse("timeout", f"all {self.capacity} decode slots are busy")
            raise self._refuse("queue_full", f"all {self.capacity} decode slots are busy and "
                               f"{len(self._queue)} requests wait for one")
        waiter = Waiter(wait.priority, wait.share, self.arrival(wait.holder, wait.arrived_at, wait.sent_at),
                        next(self._seq), handoff_id, job, asyncio.get_running_loop().create_future(), wait.holder,
                        wait.arrived_at, wait.wait_s, tenant=wait.tenant)
        bisect.insort(self._queue, waiter)
        log.info("slot queued: %s %s", handoff_id, waiter.place())
        self._give_back(replaces)  # may grant this very request at once (its future is then done)
        if wait.wait_s <= 0:  # a swap without wait: the slot was this request's, or it went to an older one
            if waiter.future.done():
                waiter.settled = True
                return waiter.future.result().index
            self.leave(waiter)
            raise self._refuse("timeout", f"the slot went to a request that waited longer; all {self.capacity} "
                               "decode slots are busy")
        return waiter

    async def granted(self, waiter: Waiter) -> int:
        """The slot of a queued request (:meth:`take`) once granted, within its wait. Raises
        :class:`SlotRefused`; cancelled, it leaves the queue (:meth:`leave`)."""
        try:
            async with asyncio.timeout(waiter.wait_s):
                slot = await waiter.future
        except TimeoutError:
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:  # granted as the wait ran out
                waiter.settled = True
                return fut.result().index
            self.leave(waiter)
            raise self._refuse("timeout", f"no decode slot became free within {waiter.wait_s:g}s") from None
        except BaseException:
            self.leave(waiter)
            raise
        waiter.settled = True
        return slot.index

    async def granted_unless(self, waiter: Waiter, gone: Awaitable[Any]) -> bool:
        """The grant of a queued request (:meth:`granted`), unless ``gone`` (its client's leaving)
        comes first: then it leaves the queue (a slot granted at that moment goes back) and
        False. Raises :class:`SlotRefused`."""
        waiting = asyncio.ensure_future(self.granted(waiter))
        left = asyncio.ensure_future(gone)
        try:
            await asyncio.wait({waiting, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not waiting.done():
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
                self.leave(waiter)  # (cancelled before it ran) a slot granted at that moment goes back
        if waiting.cancelled():
            return False
        waiting.result()
        return True

    def leave(self, waiter: Waiter) -> None:
        """The caller of a queued request stops waiting (its client went, its wait ran out): out
        of the queue, and a slot granted to it meanwhile goes back. Idempotent; nothing once its
        grant was taken."""
        if waiter.settled:
            return
        waiter.settled = True
        self._forget(waiter)
        fut = waiter.future
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled() and fut.exception() is None:
            self._drop(fut.result(), "job")  # granted as the caller went away

    def _take_now(self, handoff_id: str, job: SlotJob, replaces: str | None, kv_first: bool) -> int | None:
        """The slot now (its index): the one its KV holds (``kv_first``), or a free one nobody
        waits for; None when the request would have to queue; raises :class:`SlotRefused`
        (draining, or the id held or queued here already). ``replaces`` is given back unless
        the request queues."""
        try:
            if self._closed:
                raise self._refuse("closed", "the decode server is draining: it takes no new request")
            slot = self._held.get(handoff_id)
            if (slot is not None and ("job" in slot.holders or not kv_first)) or any(
                    w.handoff_id == handoff_id for w in self._queue):
                raise self._refuse("duplicate", f"handoff id {handoff_id!r} already has a decode request on this "
                                   "decode server")
            self._check_request(job)
            if slot is None:
                if not (self._free and not self._queue):
                    return None
                slot = self._grant(handoff_id, job)
            else:  # its KV came first
                slot.holders.add("job")
                slot.job = job
                self._requests[job.request_id] = handoff_id
            self.grants += 1
        except SlotRefused:
            self._give_back(replaces)
            raise
        self._give_back(replaces)
        return slot.index

    def cancel(self, handoff_id: str) -> bool:
        """A decode request waiting under ``handoff_id`` leaves the queue (refused as cancelled)."""
        for waiter in self._queue:
            if waiter.handoff_id == handoff_id and not waiter.future.done():
                waiter.future.set_exception(self._refuse("cancelled", f"the decode request of handoff {handoff_id!r} "
                                                         "was cancelled while it waited"))
                self._forget(waiter)
                return True
        return False

    def close(self) -> None:
        """Draining: no more decode requests; the waiting ones are refused; nothing is kept."""
        self._closed = True
        self._kept.clear()
        for waiter in list(self._queue):
            if not waiter.future.done():
                waiter.future.set_exception(self._refuse("closed", "the decode server is draining"))
            log.info("slot request left the queue: %s", waiter.handoff_id)
        self._queue.clear()

    # ---- kept KV ------------------------------------------------------------------------
    def kept(self) -> list[str]:
        """The conversation keys of the sequences the free slots keep (capabilities' ``kept``)."""
        return [kept.conversation for kept in self._kept.values()]

    def reuse(self, handoff_id: str, prefix: Sequence[str], num_tokens: int) -> int:
        """The leading tokens of the handoff's prompt (block hashes ``prefix``) that its slot
        keeps from its last sequence, of the same scope: 0 when none."""
        slot = self._held.get(handoff_id)
        if slot is None or slot.reusable is None:
            return 0
        kept = slot.reusable
        return matched_tokens(prefix, kept.hashes, kept.tokens, num_tokens)

    def keep(self, handoff_id: str, kept: Kept) -> None:
        """The job of ``handoff_id`` ended cleanly with ``kept`` in its engine state: the slot
        keeps it once free (unless the engine cannot decode from kept KV)."""
        slot = self._held.get(handoff_id)
        if slot is not None and self.keeps_kv:
            slot.keep_after = kept

    # ---- the KV receiver's hold ----------------------------------------------------
    def take_for_kv(self, handoff_id: str) -> int | None:
        """The slot of ``handoff_id`` for its KV: its decode request's, or a free one nobody
        waits for (KV before any decode request); None: busy."""
        slot = self._held.get(handoff_id)
        if slot is None:
            if self._closed or not self._free or self._queue:
                return None
            slot = self._grant(handoff_id, None, "kv")
            return slot.index
        slot.holders.add("kv")
        return slot.index

    def release(self, handoff_id: str, holder: Holder) -> None:
        """``holder`` gave the slot of ``handoff_id`` back (idempotent)."""
        slot = self._held.get(handoff_id)
        if slot is not None:
            self._drop(slot, holder)

    # ---- inside -------------------------------------------------------------------------
    def _give_back(self, handoff_id: str | None) -> None:
        """A swap's ``replaces``: its slot is taken from its job (told through ``replaced``) and
        handed on at once when nothing else holds it; still queued, it leaves the queue."""
        if handoff_id is None:
            return
        slot = self._held.get(handoff_id)
        if slot is None or slot.job is None or "job" not in slot.holders:
            self.cancel(handoff_id)
            return
        slot.job.replaced()
        if slot.holders == {"job"} and self._held.get(handoff_id) is slot:
            self._drop(slot, "job")  # the job's own give-back later finds the id gone

    def _check_request(self, job: SlotJob) -> None:
        if job.request_id in self._requests:
            raise self._refuse("duplicate", f"request id {job.request_id!r} is already in flight on this decode server",
                               "X-Request-Id")

    def _refuse(self, reason: str, message: str, param: str = "kv_transfer_params.handoff_id") -> SlotRefused:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        return SlotRefused(reason, message, param)

    def _grant(self, handoff_id: str, job: SlotJob | None, holder: Holder = "job") -> _Slot:
        keep = job.keep if job is not None else None
        slot = _Slot(handoff_id, self._pick_free(keep), {holder}, job)
        kept = self._kept.pop(slot.index, None)  # the new sequence writes over it (past what it reuses)
        if kept is not None and keep is not None and kept.scope == keep.scope:
            slot.reusable = kept
        self._held[handoff_id] = slot
        if job is not None:
            self._requests[job.request_id] = handoff_id
        self._idle.clear()
        return slot

    def _pick_free(self, keep: KeepKey | None) -> int:
        """A free slot's index: the one keeping the conversation the request continues, else the
        most recently freed one keeping nothing, else the one whose kept sequence is the oldest."""
        want = keep.continues if keep is not None else None
        if want is not None:
            for i, index in enumerate(self._free):
                kept = self._kept.get(index)
                if kept is not None and kept.conversation == want:
                    return self._free.pop(i)
        for i in range(len(self._free) - 1, -1, -1):
            if self._free[i] not in self._kept:
                return self._free.pop(i)
        return self._free.pop(0)

    def _drop(self, slot: _Slot, holder: Holder) -> None:
        slot.holders.discard(holder)
        if holder == "job" and slot.job is not None and self._requests.get(slot.job.request_id) == slot.handoff_id:
            del self._requests[slot.job.request_id]
        if slot.holders or self._held.get(slot.handoff_id) is not slot:
            return
        del self._held[slot.handoff_id]
        if slot.keep_after is not None and not self._closed:
            self._kept[slot.index] = slot.keep_after
        self._free.append(slot.index)
        self._dispatch()
        if not self._held:
            self._idle.set()

    def _dispatch(self) -> None:
        while self._free and self._queue:
            waiter = self._queue.pop(0)
            if waiter.future.done():  # its caller is leaving (cancelled): it never had a grant
                log.info("slot request left the queue: %s", waiter.handoff_id)
                continue
            if waiter.job.request_id in self._requests:  # its request id came again while it waited
                waiter.future.set_exception(self._refuse(
                    "duplicate", f"request id {waiter.job.request_id!r} is already in flight on this decode server",
                    "X-Request-Id"))
                log.info("slot request left the queue: %s", waiter.handoff_id)
                continue
            waiter.future.set_result(self._grant(waiter.handoff_id, waiter.job))
            self.grants += 1
            advance_share_clock(self.share_clock, waiter.priority, waiter.share)
            log.info("slot granted: %s %s", waiter.handoff_id, waiter.place())

    def _forget(self, waiter: Waiter) -> None:
        try:
            self._queue.remove(waiter)
        except ValueError:
            return
        log.info("slot request left the queue: %s", waiter.handoff_id)
