"""A decode slot lease as the router holds it, and the hooks through which the lease code
reports and runs background work (set by the router's state)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pd_router.backends import DecodeBackend
from pd_wire.handoff import SlotWait

if TYPE_CHECKING:
    from pd_router.lease_client import Answer
    from pd_router.rawhttp import Response


@dataclass(eq=False)
class Lease:
    backend: DecodeBackend
    model: str
    lease_id: str | None = None  # granted by the decode server under this id; None: counted here
    # no lease was asked: the decode request takes the slot (a server granting leases, its count here
    # said free); it is held there by the request's KV and generation, which end it
    implicit: bool = False
    # the request's decode request, granted in the server's queue (its 200 came, the body not
    # yet): the queue's standing request for it was that decode request (:class:`DecodeFirst`)
    opened: Response | None = None
    released: bool = False

    def take_opened(self) -> Response | None:
        """The granted decode answer, now the caller's to read or close."""
        opened, self.opened = self.opened, None
        return opened


class DecodeFirst(Protocol):
    """A queued request whose decode request can be its standing request at a server: sent
    with a wait (``HandoffClaim.wait``), its 200 is the grant and the slot held by it (no
    lease); the prefill then goes out and the answer is relayed as it is."""

    def fits(self, backend: DecodeBackend) -> bool:
        """Whether its decode request can go to ``backend`` before its prefill (else it leases there)."""
        ...

    async def open(self, backend: DecodeBackend, wait: SlotWait) -> Answer:
        """The decode request sent to ``backend``: ``Answer.opened`` once granted, else the
        status that refused it (0: none; ``unreachable`` says why)."""
        ...


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


async def wait_for_grant(future: asyncio.Future[Lease], timer: asyncio.TimerHandle,
                         release: Callable[[Lease], None], forget: Callable[[], None]) -> Lease:
    """A queued request's lease. A caller that goes away gives back a lease granted at that
    very moment and leaves the queue (``forget``); the wait's ``timer`` ends either way."""
    try:
        return await future
    except BaseException:
        if future.done() and not future.cancelled() and future.exception() is None:
            release(future.result())
        forget()
        raise
    finally:
        timer.cancel()
