"""Decode slot leases.

The decode server owns its slots (docs/architecture.md, "Decode slot leases"): a server
whose capabilities carry ``lease_ttl_s`` grants a lease (id = the attempt's handoff id,
expiry unless renewed) and queues the requests that find no free slot, in order of arrival
at their router, so several routers in front of the same servers act as one queue. This
pool asks for a lease (:meth:`SlotPool.lease`):

1. at the server its cache says has a free slot, without waiting (one round trip); or, for
   a request whose decode request can take the slot itself (``implicit``), not at all: that
   decode request is the slot request (:attr:`Lease.implicit`, ``docs/router.md``);
2. else it waits in this router's queue, behind at most one standing request per server
   (:mod:`pd_router.lease_queue`: waiting in that server's queue for the oldest request
   here; that request's own decode request where it can go before its prefill, ``decode_first``,
   else a lease request); ``--max-queue`` bounds this router's waiters, ``--queue-timeout`` the wait.

While it lives, every lease is renewed at a third of its ttl (one call per server for all
of this router's leases there); it ends when its generation ends (the server ends it), on
the cancel endpoint, or on :meth:`SlotPool.release`. The cache of free slots
(``DecodeBackend.lease_free``, from grants, refusals and probes) only chooses where to ask
first: it is never the authority.

Servers without leases (plain vLLM as decode, ``--decode-slots``) are counted here: a fair
FIFO queue in this router; a server busy although its slot is free here (prefill reports
the KV refused as ``busy``, or decode answers 429) gets the lease back through
:meth:`SlotPool.hold`, which keeps that slot counted as taken for a short, growing
back-off, and the request waits again with ``requeue=True`` (at the head of the queue).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field
from time import perf_counter

from pd_router.backends import Backends, DecodeBackend
from pd_router.errors import NoHealthyBackend, Overloaded
from pd_router.lease_client import LeaseClient
from pd_router.lease_types import DecodeFirst, Lease, LeaseHooks, wait_for_grant
from pd_router.remote_leases import RemoteLeases

__all__ = ["Lease", "LeaseHooks", "Requeue", "SlotNotTaken", "SlotPool"]
BUSY_HOLD_MIN_S = 0.05  # first back-off after a server refused for lack of a slot
BUSY_HOLD_MAX_S = 1.0  # it doubles with each refusal in a row, up to this


class Requeue(Exception):
    """The attempt on this lease cannot go on, but it is not a client error: the request
    waits for a slot again and runs prefill again. ``busy``: the decode server had no free
    slot for this lease (a server without leases counted free here: held back,
    :meth:`SlotPool.hold`; a lease that ran out); otherwise the handoff id was stale on the
    decode server (a client reusing an ``X-Request-Id``) and the next attempt's new id is
    enough. ``reason``: the label of ``pd_router_busy_requeues_total`` (which counts the busy ones)."""

    def __init__(self, reason: str, message: str, busy: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.busy = busy


class SlotNotTaken(Exception):
    """A decode request holding its slot itself (:attr:`Lease.implicit`) did not get it, before
    its 200 and so before any prefill: ``result`` ``refused`` (429: taken meanwhile, or requests
    wait there), ``unavailable`` (503) or ``error`` (no answer: ``unreachable`` says why). As
    after a lease call answered so (:meth:`SlotPool.not_taken`), the request asks for a lease."""

    def __init__(self, result: str, message: str, unreachable: str | None = None) -> None:
        super().__init__(message)
        self.result = result
        self.message = message
        self.unreachable = unreachable


@dataclass(eq=False)
class _Waiter:
    model: str
    future: asyncio.Future[Lease] = field(repr=False)


class SlotPool:
    def __init__(
        self,
        backends: Backends,
        max_queue: int,
        queue_timeout: float,
        client: LeaseClient | None = None,
        hooks: LeaseHooks | None = None,
    ) -> None:
        self.backends = backends
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.client = client
        self.hooks = hooks or LeaseHooks()
        self._queue: deque[_Waiter] = deque()
        self.remote = RemoteLeases(backends, client, self.hooks, queue_timeout) if client is not None else None

    @property
    def queue_depth(self) -> int:
        return len(self._queue) + (self.remote.waiting if self.remote is not None else 0)

    def leased(self) -> int:
        return sum(d.in_use for d in self.backends.decode)

    async def lease(self, model: str, timeout: float | None = None, requeue: bool = False,
                    lease_id: str | None = None, arrived: float | None = None, implicit: bool = False,
                    decode_first: DecodeFirst | None = None) -> Lease:
        """A slot on a usable decode server for ``model``; waits in FIFO order, at most
        ``timeout`` seconds (default ``--queue-timeout``). ``lease_id`` (the attempt's handoff
        id): the id of a lease from a server that grants them; ``arrived``: when the request
        came (``perf_counter``; its place in the servers' queues). ``requeue``: a request that held a
        lease before; it waits at the head of the queue and is not counted against ``--max-queue``.
        ``implicit``: a server granting leases whose slot is free in this router's count is not
        asked for a lease; the request's decode request takes the slot (:attr:`Lease.implicit`).
        ``decode_first``: queued for a server granting leases, the request's decode request
        stands in that server's queue for it (:attr:`Lease.opened` once granted).

        Raises :class:`NoHealthyBackend` (503) when no usable server serves the model,
        :class:`Overloaded` (429) when the queue is full or the wait times out."""
        if not self.backends.decode_available(model):
            raise NoHealthyBackend.for_decode(model)
        wait = self.queue_timeout if timeout is None else max(0.0, timeout)
        if lease_id is not None and self.remote is not None:
            servers = [d for d in self.backends.decode if d.accepting and d.serves(model) and d.leases]
            if servers:
                return await self.remote.lease(model, lease_id, servers, wait,
                                               perf_counter() if arrived is None else arrived,
                                               lambda waiting: self._check_queue(requeue, waiting), implicit,
                                               decode_first)
        if requeue or not self._queue:
            backend = self.backends.pick_decode(model)
            if backend is not None:
                return self._grant(backend, model)
        self._check_queue(requeue, len(self._queue))
        loop = asyncio.get_running_loop()
        waiter = _Waiter(model, loop.create_future())
        if requeue:
            self._queue.appendleft(waiter)
        else:
            self._queue.append(waiter)
        timer = loop.call_later(wait, self._expire, waiter)
        return await wait_for_grant(waiter.future, timer, self.release, lambda: self._forget(waiter))

    def _check_queue(self, requeue: bool, queued: int) -> None:
        if not requeue and self.queue_depth >= self.max_queue:
            raise Overloaded(f"all decode slots are busy and {queued} requests are queued", retry_after=1)

    # ---- giving back ----------------------------------------------------------------------
    def release(self, lease: Lease, tell_server: bool = True) -> None:
        """Give the lease back (idempotent). ``tell_server``: False when the decode server
        already ended it (its generation ended, or the cancel endpoint answered)."""
        if (lease.lease_id is not None or lease.implicit) and self.remote is not None:
            self.remote.release(lease, tell_server)
            return
        if lease.released:
            return
        lease.released = True
        lease.backend.in_use -= 1
        self.dispatch()

    def hold(self, lease: Lease) -> float:
        """The lease's server was busy although this pool counted its slot free: keep the
        slot counted as taken for a back-off that doubles with each such refusal in a
        row (:meth:`served` resets it), then release it. Returns the back-off. A lease
        granted by the server is given back at once (its server counts, not this pool); an
        implicit one too, and that server counts as full here (the next try asks for a lease,
        in the servers' queues)."""
        if lease.lease_id is not None or lease.implicit:
            self.release(lease)
            if lease.implicit:
                lease.backend.lease_free = 0
            return 0.0
        backend = lease.backend
        backend.busy_refusals += 1
        delay = min(BUSY_HOLD_MAX_S, BUSY_HOLD_MIN_S * 2 ** min(backend.busy_refusals - 1, 16))
        asyncio.get_running_loop().call_later(delay, self.release, lease)
        return delay

    def not_taken(self, lease: Lease, missed: SlotNotTaken) -> None:
        """An implicit lease whose decode request did not get the slot: reported as a lease call
        answered so would be (a server that did not answer is marked down), given back here;
        a server that refused (or is unavailable: draining, not ready) counts as full."""
        self.hooks.answered(lease.backend.url, missed.result)
        if missed.unreachable is not None:
            self.hooks.unreachable(lease.backend, missed.unreachable)
        if missed.result in ("refused", "unavailable"):
            self.hold(lease)
        else:
            self.release(lease)

    @staticmethod
    def served(backend: DecodeBackend) -> None:
        """The server took a handoff: its back-off starts over."""
        backend.busy_refusals = 0

    def dispatch(self) -> None:
        """Give free slots to waiters (oldest first); fail waiters nobody can serve."""
        if self.remote is not None:
            self.remote.fail_unservable()
        for waiter in list(self._queue):
            if waiter.future.done():
                continue
            if not self.backends.decode_available(waiter.model):
                self._forget(waiter)
                waiter.future.set_exception(NoHealthyBackend.for_decode(waiter.model))
                continue
            backend = self.backends.pick_decode(waiter.model)
            if backend is None:
                continue
            self._forget(waiter)
            waiter.future.set_result(self._grant(backend, waiter.model))

    @staticmethod
    def _grant(backend: DecodeBackend, model: str) -> Lease:
        backend.in_use += 1
        return Lease(backend, model)

    def _expire(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            self._forget(waiter)
            waiter.future.set_exception(
                Overloaded(
                    f"no decode slot became free within --queue-timeout {self.queue_timeout:g}s",
                    retry_after=math.ceil(min(self.queue_timeout, 30)),
                )
            )

    def _forget(self, waiter: _Waiter) -> None:
        try:
            self._queue.remove(waiter)
        except ValueError:
            pass
