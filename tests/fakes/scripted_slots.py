"""A decode servers' lease endpoints the test answers by hand (the router's LeaseClient's
interface): each acquire waits until the test answers it, so the order of grants, stale
grants and refusals is the test's (unit tests of pd_router/lease_queue.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pd_router.backends import DecodeBackend
from pd_router.lease_client import Answer
from pd_router.upstream import Target
from pd_wire.decode import LeaseGrant
from pd_wire.handoff import SlotWait


class Opened:
    """A granted decode request's open answer, as far as the queue uses it."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


@dataclass(eq=False)
class Call:
    url: str
    lease_id: str
    wait_s: float
    replaces: str | None
    answer: asyncio.Future[Answer] = field(repr=False)
    decode: bool = False  # the request's decode request (ScriptedDecodeFirst), not a lease request
    opened: Opened | None = None

    def grant(self, free: int = 0) -> None:
        if self.decode:
            self.opened = Opened()
            self.answer.set_result(Answer(200, rtt=0.001, immediate=self.wait_s == 0, opened=self.opened,  # type: ignore[arg-type]
                                          free=free))
            return
        self.answer.set_result(Answer(200, LeaseGrant(lease_id=self.lease_id, slot=0, ttl_s=3600, free=free,
                                                      queued=0), 0.001, self.wait_s == 0))

    def refuse(self, status: int = 429) -> None:
        self.answer.set_result(Answer(status, rtt=0.001, immediate=self.wait_s == 0))

    @property
    def key(self) -> tuple[str, str, float, str | None]:
        return self.url, self.lease_id, self.wait_s, self.replaces


class ScriptedLeases:
    holder = "scripted"

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.releases: list[tuple[str, list[str]]] = []

    async def acquire(self, target: Target, lease_id: str, wait_s: float, arrived: float,
                      replaces: str | None = None) -> Answer:
        call = Call(target.origin.host, lease_id, wait_s, replaces, asyncio.get_running_loop().create_future())
        self.calls.append(call)
        return await call.answer

    async def renew(self, target: Target, lease_ids: list[str]) -> list[str] | None:
        return []

    async def release(self, target: Target, lease_ids: list[str]) -> bool:
        self.releases.append((target.origin.host, list(lease_ids)))
        for call in self.calls:  # as a server: a released request that waits is answered (refused)
            if call.url == target.origin.host and call.lease_id in lease_ids and not call.answer.done():
                call.refuse()
        return True

    def open(self) -> list[Call]:
        return [c for c in self.calls if not c.answer.done()]


class ScriptedDecodeFirst:
    """A queued request whose decode request stands for it (pd_router.lease_types.DecodeFirst):
    its calls join the same list, answered by the test."""

    def __init__(self, leases: ScriptedLeases, lease_id: str, fits: bool = True) -> None:
        self.leases = leases
        self.lease_id = lease_id
        self._fits = fits

    def fits(self, backend: DecodeBackend) -> bool:
        return self._fits

    async def open(self, backend: DecodeBackend, wait: SlotWait) -> Answer:
        call = Call(backend.target.origin.host, self.lease_id, wait.wait_s, wait.replaces,
                    asyncio.get_running_loop().create_future(), decode=True)
        self.leases.calls.append(call)
        return await call.answer
