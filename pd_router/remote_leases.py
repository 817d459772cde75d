"""Leases granted by decode servers that own their slots (capabilities with ``lease_ttl_s``).

:class:`RemoteLeases` is the half of :class:`pd_router.slots.SlotPool` that talks to those
servers: it asks the server its cache says has a free slot first (one round trip), else
long-polls every usable server at once (the first grant wins; the other polls are taken
out of their queues), renews the live leases at a third of their ttl (one call per server)
and gives them back. The pool keeps the counting of servers without leases and the
``--max-queue`` bound over both halves.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from pd_router.backends import Backends, DecodeBackend
from pd_router.errors import NoHealthyBackend, Overloaded
from pd_router.lease_client import Answer, LeaseClient

log = logging.getLogger("pd_router.slots")
CALL_GRACE_S = 10.0  # how long a dropped poll may take to be answered after its release


@dataclass(eq=False)
class Lease:
    backend: DecodeBackend
    model: str
    lease_id: str | None = None  # granted by the decode server under this id; None: counted here
    released: bool = False


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


def _unservable(model: str) -> NoHealthyBackend:
    return NoHealthyBackend(f"no healthy, compatible decode server for model {model!r}")


class RemoteLeases:
    def __init__(self, backends: Backends, client: LeaseClient, hooks: LeaseHooks, queue_timeout: float) -> None:
        self.backends = backends
        self.client = client
        self.hooks = hooks
        self.queue_timeout = queue_timeout
        self.waiting = 0  # requests waiting in the decode servers' queues
        self._live: dict[str, Lease] = {}  # granted leases by id
        self._waiters: dict[asyncio.Future[Answer], str] = {}  # failed by fail_unservable() -> model
        self._renewer: asyncio.Future[None] | None = None

    async def lease(self, model: str, lease_id: str, servers: list[DecodeBackend], wait: float, arrived: float,
                    check_queue: Callable[[int], None]) -> Lease:
        """A lease from one of ``servers``; ``check_queue(waiting)`` raises when this router
        may not queue one more request."""
        first = max(servers, key=lambda d: d.lease_free)
        if first.lease_free > 0:
            # counted taken until the server answers (its answer sets the count): requests
            # arriving meanwhile ask another server, not all the one that may not answer
            first.lease_free -= 1
            got = self._take(await self.client.acquire(first.target, lease_id, 0.0, arrived), first, model, lease_id)
            if got is not None:
                return got
        check_queue(self.waiting)
        self.waiting += 1
        t0 = perf_counter()
        polls: dict[asyncio.Future[Answer], DecodeBackend] = {
            asyncio.ensure_future(self.client.acquire(d.target, lease_id, wait, arrived)): d for d in servers}
        gone: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()  # none usable any more
        self._waiters[gone] = model
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
            self._waiters.pop(gone, None)
            self.waiting -= 1
            for poll, d in polls.items():
                if poll not in seen:
                    self.hooks.spawn(self._drop_poll(poll, d, lease_id))
        if winner is None and not self.backends.decode_available(model):
            raise _unservable(model)
        if winner is None:
            raise Overloaded(f"no decode slot became free within --queue-timeout {self.queue_timeout:g}s "
                             f"(waited {perf_counter() - t0:.1f}s in {len(servers)} decode servers' queues)",
                             retry_after=math.ceil(min(self.queue_timeout, 30)))
        return winner

    def fail_unservable(self) -> None:
        """Fail the waits of models no usable server serves any more."""
        for gone, model in list(self._waiters.items()):
            if not gone.done() and not self.backends.decode_available(model):
                gone.set_exception(_unservable(model))

    def release(self, lease: Lease, tell_server: bool = True) -> None:
        """Give a granted lease back (idempotent); ``tell_server``: False when the server ended it."""
        if lease.released or lease.lease_id is None:
            return
        lease.released = True
        lease.backend.in_use -= 1
        self._live.pop(lease.lease_id, None)
        lease.backend.lease_free += 1
        if tell_server:
            self.hooks.spawn(self.client.release(lease.backend.target, [lease.lease_id]))

    async def _drop_poll(self, poll: asyncio.Future[Answer], backend: DecodeBackend, lease_id: str) -> None:
        """Take a poll nobody waits for any more out of its server's queue: the release makes
        the server answer it (refused), so its connection stays open for the next call;
        a grant that was on its way is ended by the same release."""
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
