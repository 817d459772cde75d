"""Decode slot leases: a fair, bounded FIFO queue in front of the decode servers.

A request holds one :class:`Lease` from before prefill until the decode server has
finished (or acknowledged a cancel). Slots are counted here, by the router: a decode
server's capacity is its ``capabilities.slots`` (or ``--decode-slots``).

FIFO: a request never overtakes an earlier one for the same model. When a slot frees,
the oldest waiter that the freed capacity can serve gets it.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pd_router.backends import Backends, DecodeBackend
from pd_router.errors import NoHealthyBackend, Overloaded


@dataclass(eq=False)
class Lease:
    backend: DecodeBackend
    model: str
    released: bool = False


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
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.backends = backends
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.on_change = on_change
        self._queue: deque[_Waiter] = deque()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def leased(self) -> int:
        return sum(d.in_use for d in self.backends.decode)

    async def lease(self, model: str) -> Lease:
        """A slot on a usable decode server for ``model``; waits in FIFO order.

        Raises :class:`NoHealthyBackend` (503) when no usable server serves the model,
        :class:`Overloaded` (429) when the queue is full or the wait times out."""
        if not self.backends.decode_available(model):
            raise NoHealthyBackend(f"no healthy, compatible decode server for model {model!r}")
        if not self._queue:
            backend = self.backends.pick_decode(model)
            if backend is not None:
                return self._grant(backend, model)
        if len(self._queue) >= self.max_queue:
            raise Overloaded(
                f"all decode slots are busy and {len(self._queue)} requests are queued", retry_after=1
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(model, loop.create_future())
        self._queue.append(waiter)
        self.on_change()
        timer = loop.call_later(self.queue_timeout, self._expire, waiter)
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

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        lease.backend.in_use -= 1
        self.dispatch()

    def dispatch(self) -> None:
        """Give free slots to waiters (oldest first); fail waiters nobody can serve."""
        granted = False
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
            waiter.future.set_result(self._grant(backend, waiter.model, notify=False))
            granted = True
        if granted or not self._queue:
            self.on_change()

    def _grant(self, backend: DecodeBackend, model: str, notify: bool = True) -> Lease:
        backend.in_use += 1
        if notify:
            self.on_change()
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
            return
        self.on_change()
