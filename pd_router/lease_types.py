"""A decode slot lease as the router holds it, and the hooks through which the lease code
reports and runs background work (set by the router's state)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from pd_router.backends import DecodeBackend


@dataclass(eq=False)
class Lease:
    backend: DecodeBackend
    model: str
    lease_id: str | None = None  # granted by the decode server under this id; None: counted here
    # no lease was asked: the decode request takes the slot (a server granting leases, its count here
    # said free); it is held there by the request's KV and generation, which end it
    implicit: bool = False
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
