"""Decode slots: where a request's decode request takes one (docs/router.md, "Decode slots").

A decode server of ours holds a slot for a request's decode request itself: the decode request
goes first, the server answers 200 once the slot is the request's, at once or after a wait in
its queue, and the prefill goes out on that 200. :meth:`SlotPool.take` hands the attempt a
:class:`~pd_router.slots.queue.Slot`, the open decode answer, or an error:

1. a server this router counts free, nobody waiting here: the request's decode request without
   wait (one round trip); refused (the slot taken meanwhile, draining) or unanswered, one more
   server counted free, then the queue. A free server keeping the KV of the request's
   conversation (``SlotClaimant.prefixes``, ``DecodeBackend.kept``) is asked first;
2. the queue (:mod:`pd_router.slots.queue`): in the order of the requests' places
   (:mod:`pd_router.slots.fair`), behind at most one standing decode request per server;
   ``--max-queue`` bounds this router's waiters, a tenant's ``max_queued`` its own
   (:mod:`pd_router.tenants`), ``--queue-timeout`` the wait.

The count of free slots per server (``DecodeBackend.free_slots``, from the servers' answers and
the probes) only chooses where to ask first: the server is the authority. A server without a
capabilities endpoint (a plain vLLM decode, ``--decode-slots``) is counted here instead: its
slot is the count alone, the request then runs its prefill and decode one after the other, and
a server busy although counted free (prefill reports the KV refused as ``busy``, or decode
answers 429) keeps that slot counted as taken for a back-off (:meth:`SlotPool.hold`) while the
request waits again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from pd_router.errors import NoHealthyBackend, Overloaded
from pd_router.fleet.backends import Backends, DecodeBackend
from pd_router.fleet.kept import Affinity
from pd_router.slots.fair import FairShares
from pd_router.slots.queue import Answer, Slot, SlotClaimant, SlotQueue, backoff

__all__ = ["Answer", "SlotClaimant", "Slot", "SlotHooks", "SlotPool", "backoff"]
IMMEDIATE_TRIES = 2  # servers counted free asked at once for a new request, before the queue


class SlotHooks:
    """What the pool reports and how it runs background work (set by the router's state)."""

    def __init__(self, spawn: Callable[[Coroutine[Any, Any, Any]], Any] = asyncio.ensure_future,
                 rtt: Callable[[float], None] = lambda s: None,
                 answered: Callable[[str, str], None] = lambda backend, result: None,
                 unreachable: Callable[[DecodeBackend, str], None] = lambda backend, why: None,
                 affinity: Callable[[Affinity], None] = lambda outcome: None) -> None:
        self.spawn = spawn
        self.unreachable = unreachable  # a decode request could not connect: mark the server down
        self.rtt = rtt  # seconds of a decode request granted without waiting in a queue
        self.answered = answered  # (backend url, Answer.result)
        # how a request's kept prefix chose the server its first decode request asked at once
        self.affinity = affinity


class SlotPool:
    def __init__(self, backends: Backends, max_queue: int, queue_timeout: float, holder: str,
                 hooks: SlotHooks | None = None, aging: float | None = None, fair: bool = True) -> None:
        self.backends = backends
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.hooks = hooks or SlotHooks()
        self.shares = FairShares(fair)  # the places of this router's requests (pd_router.slots.fair)
        self.queue = SlotQueue(backends, holder, queue_timeout, self._took, self._count, self.release,
                               self.hooks.spawn, aging)

    @property
    def queue_depth(self) -> int:
        return self.queue.waiting

    def held(self) -> int:
        """Slots this router's requests hold (0 when it is idle)."""
        return sum(d.in_use for d in self.backends.decode)

    async def take(self, model: str, request: SlotClaimant, timeout: float | None = None,
                   first_try: bool = True, max_queued: int | None = None) -> Slot:
        """A slot for ``request`` on a usable decode server for ``model``, within ``timeout``
        seconds (default ``--queue-timeout``). ``first_try``: a request's first attempt asks the
        servers counted free at once when nobody here waits; a later attempt (after a busy,
        stale or failed one) waits in the queue, where it keeps its place.

        Raises :class:`NoHealthyBackend` (503) when no usable server serves the model,
        :class:`Overloaded` (429) when the queue is full, its tenant has ``max_queued`` requests
        waiting here or the wait times out, and the decode server's own refusal of the request
        (:class:`~pd_router.errors.UpstreamRejected`)."""
        slot = await self._take(model, request, timeout, first_try, max_queued)
        self.shares.granted(request.place)
        return slot

    async def _take(self, model: str, request: SlotClaimant, timeout: float | None, first_try: bool,
                    max_queued: int | None) -> Slot:
        if not self.backends.decode_available(model):
            raise NoHealthyBackend.for_decode(model)
        wait = self.queue_timeout if timeout is None else max(0.0, timeout)
        if first_try and not self.queue.waiting:
            prefer = request.prefixes
            for i in range(IMMEDIATE_TRIES):
                # a server keeping the request's conversation first, when it has a free slot: which
                # server, never the request's place (the queue below is the places' order alone)
                backend, affinity = self.backends.choose_decode(model, prefer)
                if prefer and i == 0:
                    self.hooks.affinity(affinity)
                if backend is None:
                    break
                if not backend.owns_slots:
                    return self._count(backend, model)
                # counted taken until the server answers (its answer sets the count): requests
                # arriving meanwhile ask another server, not all the one that may not answer
                backend.free_slots -= 1
                answer = await request.open(backend, None)
                slot = self._took(backend, model, answer)
                if slot is not None:
                    return slot
                if answer.rejected is not None:
                    raise answer.rejected
        if first_try and self.queue.waiting >= self.max_queue:
            raise Overloaded(f"all decode slots are busy and {self.queue.waiting} requests are queued", retry_after=1)
        if first_try and max_queued is not None and (mine := self.queue.queued(request.tenant)) >= max_queued:
            raise Overloaded(f"all decode slots are busy and tenant {request.tenant!r} has {mine} requests queued at "
                             f"this router, its bound (max_queued / --max-queued-per-tenant: {max_queued})",
                             retry_after=2, code="tenant_queue_full")
        return await self.queue.wait(model, request, wait)

    # ---- a server's answer, and giving back ------------------------------------------------
    def _took(self, backend: DecodeBackend, model: str, answer: Answer) -> Slot | None:
        """Report a server's answer to a decode request and count it; the slot of a grant."""
        self.hooks.answered(backend.url, answer.result)
        if answer.opened is None:
            if answer.status in (429, 503):
                backend.free_slots = 0
            if answer.unreachable is not None:
                self.hooks.unreachable(backend, answer.unreachable)
            return None
        if answer.immediate:  # a round trip, not a wait in the queue
            self.hooks.rtt(answer.rtt)
        backend.free_slots = answer.free
        backend.in_use += 1
        return Slot(backend, model, opened=answer.opened)

    def _count(self, backend: DecodeBackend, model: str) -> Slot:
        """A slot of a server this router counts."""
        backend.in_use += 1
        return Slot(backend, model)

    def release(self, slot: Slot) -> None:
        """Give the slot back (idempotent): an unused open decode answer is closed (its slot is
        free there once the server sees it go); a counted slot goes to the next request here."""
        if slot.released:
            return
        slot.released = True
        opened = slot.take_opened()
        if opened is not None:
            opened.close()
        backend = slot.backend
        backend.in_use -= 1
        if backend.owns_slots:
            backend.free_slots += 1
        self.queue.refresh()

    def hold(self, slot: Slot) -> None:
        """The slot's server was busy although counted free: a counted slot stays taken for a
        back-off that doubles with each such refusal in a row (:meth:`served` resets it), then
        goes back; a slot of ours goes back at once, its server counted full."""
        backend = slot.backend
        if backend.owns_slots:
            self.release(slot)
            backend.free_slots = 0
            return
        backend.refusals += 1
        asyncio.get_running_loop().call_later(backoff(backend.refusals), self.release, slot)

    @staticmethod
    def served(backend: DecodeBackend) -> None:
        """The server took a handoff: its back-off starts over."""
        backend.refusals = 0

    def dispatch(self) -> None:
        """After a probe: fail the waits nobody can serve, give out what is free."""
        self.queue.fail_unservable()

