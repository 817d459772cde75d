"""Leases granted by decode servers that own their slots (capabilities with ``lease_ttl_s``).

:class:`RemoteLeases` is the half of :class:`pd_router.slots.SlotPool` that talks to those
servers: it asks the server its cache says has a free slot first (one round trip) when no
request of this router waits, else queues the request here, behind this router's standing
lease requests (:mod:`pd_router.lease_queue`: at most one per server), renews the
live leases at a third of their ttl (one call per server) and gives them back. The pool
keeps the counting of servers without leases and the ``--max-queue`` bound over both halves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import perf_counter

from pd_router.backends import Backends, DecodeBackend
from pd_router.lease_client import Answer, LeaseClient
from pd_router.lease_queue import LeaseQueue
from pd_router.lease_types import DecodeFirst, Lease, LeaseHooks

__all__ = ["Lease", "LeaseHooks", "RemoteLeases"]
log = logging.getLogger("pd_router.slots")


class RemoteLeases:
    def __init__(self, backends: Backends, client: LeaseClient, hooks: LeaseHooks, queue_timeout: float) -> None:
        self.backends = backends
        self.client = client
        self.hooks = hooks
        self.queue_timeout = queue_timeout
        self._live: dict[str, Lease] = {}  # granted leases by id
        self._renewer: asyncio.Future[None] | None = None
        self.queue = LeaseQueue(backends, client, hooks, queue_timeout, self._take, self._give_back, self.release)

    @property
    def waiting(self) -> int:
        """Requests of this router waiting for a slot on a server that grants leases."""
        return self.queue.waiting

    async def lease(self, model: str, lease_id: str, servers: list[DecodeBackend], wait: float, arrived: float,
                    check_queue: Callable[[int], None], implicit: bool = False,
                    decode_first: DecodeFirst | None = None) -> Lease:
        """A lease from one of ``servers``; ``check_queue(waiting)`` raises when this router
        may not queue one more request. ``implicit``: where this router counts a slot free
        (and nobody here waits longer), no lease is asked: the request's decode request takes
        the slot (:attr:`Lease.implicit`). ``decode_first``: queued, its decode request may be
        its standing request (:mod:`pd_router.lease_queue`)."""
        first = max(servers, key=lambda d: d.lease_free)
        # nobody here waits longer; a try after one that found its slot taken, failed or was
        # busy, whose decode request may stand in the queues, asks there (answered at once)
        if first.lease_free > 0 and not self.queue.waiting and (implicit or decode_first is None):
            # counted taken until the server answers (its answer sets the count): requests
            # arriving meanwhile ask another server, not all the one that may not answer
            first.lease_free -= 1
            if implicit:
                first.in_use += 1
                return Lease(first, model, implicit=True)
            got = self._take(await self.client.acquire(first.target, lease_id, 0.0, arrived), first, model, lease_id)
            if got is not None:
                return got
        check_queue(self.waiting)
        return await self.queue.wait(model, lease_id, wait, arrived, decode_first)

    def fail_unservable(self) -> None:
        """Fail the waits of models no usable server serves any more."""
        self.queue.fail_unservable()

    def release(self, lease: Lease, tell_server: bool = True) -> None:
        """Give a granted lease back (idempotent); ``tell_server``: False when the server ended it.
        An implicit one is never told: its request's KV and generation end it there."""
        if lease.released or (lease.lease_id is None and not lease.implicit):
            return
        lease.released = True
        opened = lease.take_opened()
        if opened is not None:  # granted and never used: closing it frees the slot there
            opened.close()
        lease.backend.in_use -= 1
        lease.backend.lease_free += 1
        if lease.lease_id is None:
            return
        self._live.pop(lease.lease_id, None)
        if tell_server:
            self._give_back(lease.backend, lease.lease_id)

    def _give_back(self, backend: DecodeBackend, lease_id: str) -> None:
        self.hooks.spawn(self.client.release(backend.target, [lease_id]))

    def _take(self, answer: Answer, backend: DecodeBackend, model: str, lease_id: str) -> Lease | None:
        grant = answer.grant
        if not answer.granted:
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
        backend.in_use += 1
        if grant is None:  # the request's decode request holds the slot: no lease, no renewal
            backend.lease_free = answer.free
            return Lease(backend, model, implicit=True, opened=answer.opened)
        backend.lease_free = grant.free
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
