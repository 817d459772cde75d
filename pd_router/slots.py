"""Decode slot leases.

The decode server owns its slots (docs/architecture.md, "Decode slot leases"): a server
whose capabilities carry ``lease_ttl_s`` grants a lease (id = the attempt's handoff id,
expiry unless renewed) and queues the requests that find no free slot, in order of arrival
at their router, so several routers in front of the same servers act as one queue. This
pool asks for a lease (:meth:`SlotPool.lease`):

1. at the server its cache says has a free slot, without waiting (one round trip);
2. else at every usable server at once, each a long poll in that server's queue; the first
   grant wins, the other polls are dropped and their ids released there (a grant in flight
   is ended too). ``--max-queue`` bounds this router's waiters, ``--queue-timeout`` the wait.

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
import logging
import math
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from pd_router.backends import Backends, DecodeBackend
from pd_router.errors import NoHealthyBackend, Overloaded
from pd_router.lease_client import Answer, LeaseClient

log = logging.getLogger("pd_router.slots")
BUSY_HOLD_MIN_S = 0.05  # first back-off after a server refused for lack of a slot
BUSY_HOLD_MAX_S = 1.0  # it doubles with each refusal in a row, up to this
CALL_GRACE_S = 10.0  # how long a dropped poll may take to be answered after its release


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


@dataclass(eq=False)
class Lease:
    backend: DecodeBackend
    model: str
    lease_id: str | None = None  # granted by the decode server under this id; None: counted here
    released: bool = False


@dataclass(eq=False)
class _Waiter:
    model: str
    future: asyncio.Future[Lease] = field(repr=False)


class LeaseHooks:
    """What the pool reports and how it runs background work (set by the router's state)."""

    def __init__(self, spawn: Callable[[Coroutine[Any, Any, Any]], Any] = asyncio.ensure_future,
                 rtt: Callable[[float], None] = lambda s: None,
                 answered: Callable[[str, str], None] = lambda backend, result: None,
                 unreachable: Callable[[DecodeBackend, str], None] = lambda backend, why: None) -> None:
        self.spawn = spawn
        self.unreachable = unreachable  # a lease call could not connect: mark the server down
        self.rtt = rtt  # seconds of a lease call answered without waiting in a queue
        self.answered = answered  # (backend url, "granted" | "refused" | "conflict" | "unavailable" | "error")


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
        self._waiting = 0  # requests waiting in the decode servers' queues (leases)
        self._live: dict[str, Lease] = {}  # granted leases by id
        self._remote_waiters: dict[asyncio.Future[Answer], str] = {}  # failed by dispatch() -> model
        self._renewer: asyncio.Future[None] | None = None

    @property
    def queue_depth(self) -> int:
        return len(self._queue) + self._waiting

    def leased(self) -> int:
        return sum(d.in_use for d in self.backends.decode)

    async def lease(self, model: str, timeout: float | None = None, requeue: bool = False,
                    lease_id: str | None = None, arrived: float | None = None) -> Lease:
        """A slot on a usable decode server for ``model``; waits in FIFO order, at most
        ``timeout`` seconds (default ``--queue-timeout``). ``lease_id`` (the attempt's handoff
        id): the id of a lease from a server that grants them; ``arrived``: when the request
        came (``perf_counter``; its place in the servers' queues). ``requeue``: a request that held a
        lease before; it waits at the head of the queue and is not counted against ``--max-queue``.

        Raises :class:`NoHealthyBackend` (503) when no usable server serves the model,
        :class:`Overloaded` (429) when the queue is full or the wait times out."""
        if not self.backends.decode_available(model):
            raise NoHealthyBackend(f"no healthy, compatible decode server for model {model!r}")
        wait = self.queue_timeout if timeout is None else max(0.0, timeout)
        if lease_id is not None and self.client is not None:
            servers = [d for d in self.backends.decode if d.accepting and d.serves(model) and d.leases]
            if servers:
                return await self._remote(model, lease_id, servers, wait,
                                          perf_counter() if arrived is None else arrived, requeue)
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
        try:
            return await waiter.future
        except BaseException:
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())  # granted just as the caller went away
            self._forget(waiter)
            raise
        finally:
            timer.cancel()

    def _check_queue(self, requeue: bool, queued: int) -> None:
        if not requeue and self.queue_depth >= self.max_queue:
            raise Overloaded(f"all decode slots are busy and {queued} requests are queued", retry_after=1)

    # ---- leases granted by the decode servers ----------------------------------------
    async def _remote(self, model: str, lease_id: str, servers: list[DecodeBackend], wait: float, arrived: float,
                      requeue: bool) -> Lease:
        assert self.client is not None
        first = max(servers, key=lambda d: d.lease_free)
        if first.lease_free > 0:
            # counted taken until the server answers (its answer sets the count): requests
            # arriving meanwhile ask another server, not all the one that may not answer
            first.lease_free -= 1
            got = self._take(await self.client.acquire(first.target, lease_id, 0.0, arrived), first, model, lease_id)
            if got is not None:
                return got
        self._check_queue(requeue, self._waiting)
        self._waiting += 1
        t0 = perf_counter()
        polls: dict[asyncio.Future[Answer], DecodeBackend] = {
            asyncio.ensure_future(self.client.acquire(d.target, lease_id, wait, arrived)): d for d in servers}
        gone: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()  # dispatch(): none usable
        self._remote_waiters[gone] = model
        winner: Lease | None = None
        seen: set[asyncio.Future[Answer]] = set()
        try:
            pending: set[asyncio.Future[Answer]] = {*polls, gone}
            while winner is None and len(pending) > 1:  # a poll still out (gone is always there)
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    gone.result()  # raises NoHealthyBackend
                for poll in done:
                    seen.add(poll)
                    got = self._take(poll.result(), polls[poll], model, lease_id)
                    if got is not None and winner is None:
                        winner = got
                    elif got is not None:  # two grants at once: keep one
                        self.release(got)
        finally:
            self._remote_waiters.pop(gone, None)
            self._waiting -= 1
            for poll, d in polls.items():
                if poll not in seen:
                    self.hooks.spawn(self._drop_poll(poll, d, lease_id))
        if winner is None and not self.backends.decode_available(model):
            raise NoHealthyBackend(f"no healthy, compatible decode server for model {model!r}")
        if winner is None:
            raise Overloaded(f"no decode slot became free within --queue-timeout {self.queue_timeout:g}s "
                             f"(waited {perf_counter() - t0:.1f}s in {len(servers)} decode servers' queues)",
                             retry_after=math.ceil(min(self.queue_timeout, 30)))
        return winner

    async def _drop_poll(self, poll: asyncio.Future[Answer], backend: DecodeBackend, lease_id: str) -> None:
        """Take a poll nobody waits for any more out of its server's queue: the release makes
        the server answer it (refused), so its connection stays open for the next call;
        a grant that was on its way is ended by the same release."""
        assert self.client is not None
        if not poll.done():
            await self.client.release(backend.target, [lease_id])
        try:
            async with asyncio.timeout(CALL_GRACE_S):
                answer = await poll
        except TimeoutError:
            return  # the poll's own timeout closes it
        if answer.grant is not None:  # granted before the release arrived
            backend.lease_free = answer.grant.free
            await self.client.release(backend.target, [lease_id])

    def _take(self, answer: Answer, backend: DecodeBackend, model: str, lease_id: str) -> Lease | None:
        grant = answer.grant
        if grant is None:
            if answer.status == 429:
                backend.lease_free = 0
            if answer.unreachable is not None:
                self.hooks.unreachable(backend, answer.unreachable)
            result = {429: "refused", 409: "conflict", 503: "unavailable"}.get(answer.status, "error")
            self.hooks.answered(backend.url, result)
            return None
        self.hooks.answered(backend.url, "granted")
        if answer.immediate:  # a round trip, not a wait in the queue
            self.hooks.rtt(answer.rtt)
        backend.lease_free = grant.free
        backend.in_use += 1
        lease = Lease(backend, model, lease_id)
        self._live[lease_id] = lease
        if self._renewer is None or self._renewer.done():
            self._renewer = self.hooks.spawn(self._renew_while_leased(grant.ttl_s))
        return lease

    async def _renew_while_leased(self, ttl: float) -> None:
        """Renew every live lease at a third of its ttl, one call per server."""
        assert self.client is not None
        while self._live:
            await asyncio.sleep(ttl / 3)
            by_server: dict[str, tuple[DecodeBackend, list[str]]] = {}
            for lease_id, lease in self._live.items():
                by_server.setdefault(lease.backend.url, (lease.backend, []))[1].append(lease_id)
            for backend, ids in by_server.values():
                t0 = perf_counter()
                unknown = await self.client.renew(backend.target, ids)
                if unknown is None:
                    log.warning("renewing %d lease(s) on %s failed", len(ids), backend.url)
                    continue
                self.hooks.rtt(perf_counter() - t0)
                if unknown:  # ended there already (their generations ended, or they ran out)
                    log.debug("leases %s no longer held on %s", unknown, backend.url)

    # ---- giving back ----------------------------------------------------------------------
    def release(self, lease: Lease, tell_server: bool = True) -> None:
        """Give the lease back (idempotent). ``tell_server``: False when the decode server
        already ended it (its generation ended, or the cancel endpoint answered)."""
        if lease.released:
            return
        lease.released = True
        lease.backend.in_use -= 1
        if lease.lease_id is None:
            self.dispatch()
            return
        self._live.pop(lease.lease_id, None)
        lease.backend.lease_free += 1
        if tell_server and self.client is not None:
            self.hooks.spawn(self.client.release(lease.backend.target, [lease.lease_id]))

    def hold(self, lease: Lease) -> float:
        """The lease's server was busy although this pool counted its slot free: keep the
        slot counted as taken for a back-off that doubles with each such refusal in a
        row (:meth:`served` resets it), then release it. Returns the back-off. A lease
        granted by the server is given back at once (its server counts, not this pool)."""
        if lease.lease_id is not None:
            self.release(lease)
            return 0.0
        backend = lease.backend
        backend.busy_refusals += 1
        delay = min(BUSY_HOLD_MAX_S, BUSY_HOLD_MIN_S * 2 ** min(backend.busy_refusals - 1, 16))
        asyncio.get_running_loop().call_later(delay, self.release, lease)
        return delay

    @staticmethod
    def served(backend: DecodeBackend) -> None:
        """The server took a handoff: its back-off starts over."""
        backend.busy_refusals = 0

    def dispatch(self) -> None:
        """Give free slots to waiters (oldest first); fail waiters nobody can serve."""
        for gone, model in list(self._remote_waiters.items()):
            if not gone.done() and not self.backends.decode_available(model):
                gone.set_exception(NoHealthyBackend(f"no healthy, compatible decode server for model {model!r}"))
        for waiter in list(self._queue):
            if waiter.future.done():
                continue
            if not self.backends.decode_available(waiter.model):
                self._forget(waiter)
                waiter.future.set_exception(
                    NoHealthyBackend(f"no healthy, compatible decode server for model {waiter.model!r}")
                )
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
