"""Decode servers whose answers to decode requests the test gives by hand: each decode request
waits until the test answers it, so the order of grants, stale grants and refusals is the
test's (unit tests of pd_router/slots/queue.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pd_router.fleet.backends import DecodeBackend
from pd_router.slots.fair import Place
from pd_router.slots.pool import Answer
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
    handoff_id: str
    wait_s: float
    replaces: str | None
    answer: asyncio.Future[Answer] = field(repr=False)
    opened: Opened | None = None
    wait: SlotWait | None = None  # as sent

    def grant(self, free: int = 0) -> None:
        self.opened = Opened()
        self.answer.set_result(Answer(200, rtt=0.001, immediate=self.wait_s == 0, opened=self.opened,  # type: ignore[arg-type]
                                      free=free))

    def refuse(self, status: int = 429) -> None:
        self.answer.set_result(Answer(status, rtt=0.001, immediate=self.wait_s == 0))

    @property
    def closed(self) -> bool:
        """Closed by the router before an answer (its call cancelled)."""
        return self.answer.cancelled()

    @property
    def key(self) -> tuple[str, str, float, str | None]:
        return self.url, self.handoff_id, self.wait_s, self.replaces


class ScriptedServers:
    """Every decode request sent to the scripted servers, answered or not."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def open(self) -> list[Call]:
        return [c for c in self.calls if not c.answer.done()]


class ScriptedRequest:
    """A request's decode request (a pd_router.slots.queue.SlotClaimant) sent to the scripted servers."""

    def __init__(self, servers: ScriptedServers, handoff_id: str, arrived: float, priority: int = 0,
                 share: float = 0.0, tenant: str = "") -> None:
        self.servers = servers
        self.handoff_id = handoff_id
        self.place = Place(priority, share, arrived)
        self.tenant = tenant
        self.prefixes = None  # no conversation keys

    async def open(self, backend: DecodeBackend, wait: SlotWait | None) -> Answer:
        call = Call(backend.target.origin.host, self.handoff_id, wait.wait_s if wait else 0.0,
                    wait.replaces if wait else None, asyncio.get_running_loop().create_future(), wait=wait)
        self.servers.calls.append(call)
        return await call.answer
