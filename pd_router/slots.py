"""Decode slot leases: a fair, bounded FIFO queue in front of the decode servers.

A request holds one :class:`Lease` from before prefill until the decode server has
finished (or acknowledged a cancel). Slots are counted here, by the router: a decode
server's capacity is its ``capabilities.slots`` (or ``--decode-slots``).

FIFO: a request never overtakes an earlier one for the same model. When a slot frees,
the oldest waiter that the freed capacity can serve gets it.

A decode server can be busy although its slot is free here (another router in front of
it, a handoff nobody claimed yet, a slot freed a little late): prefill then reports the
KV refused as ``busy``, or decode answers 429. The request gives its lease back through
:meth:`SlotPool.hold`, which keeps that slot counted as taken for a short, growing
back-off (the server has fewer free slots than counted here), and waits again with
``requeue=True``: at the head of the queue, since everything queued came after it.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pd_router.backends import Backends, DecodeBackend
from pd_router.errors import NoHealthyBackend, Overloaded

BUSY_HOLD_MIN_S = 0.05  # first back-off after a server refused for lack of a slot
BUSY_HOLD_MAX_S = 1.0  # it doubles with each refusal in a row, up to this


class Requeue(Exception):
    """The attempt on this lease cannot go on, but it is not a client error: the request
    waits for a slot again and runs prefill again. ``busy``: the decode server had no free
    slot although this pool counted one (the lease is held back, :meth:`SlotPool.hold`);
    otherwise the handoff id was stale on the decode server (a client reusing an
    ``X-Request-Id``) and the next attempt's new id is enough. ``reason``: the label of
    ``pd_router_busy_requeues_total`` (which counts the busy ones)."""

    def __init__(self, reason: str, message: str, busy: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.busy = busy


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

    async def lease(self, model: str, timeout: float | None = None, requeue: bool = False) -> Lease:
        """A slot on a usable decode server for ``model``; waits in FIFO order, at most
        ``timeout`` seconds (default ``--queue-timeout``). ``requeue``: a request that held
        a lease before and found the server busy; it waits at the head of the queue and
        is not counted against ``--max-queue``.

        Raises :class:`NoHealthyBackend` (503) when no usable server serves the model,
        :class:`Overloaded` (429) when the queue is full or the wait times out."""
        if not self.backends.decode_available(model):
            raise NoHealthyBackend(f"no healthy, compatible decode server for model {model!r}")
        if requeue or not self._queue:
            backend = self.backends.pick_decode(model)
            if backend is not None:
                return self._grant(backend, model)
        if not requeue and len(self._queue) >= self.max_queue:
            raise Overloaded(
                f"all decode slots are busy and {len(self._queue)} requests are queued", retry_after=1
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(model, loop.create_future())
        if requeue:
            self._queue.appendleft(waiter)
        else:
            self._queue.append(waiter)
        self.on_change()
        wait = self.queue_timeout if timeout is None else max(0.0, timeout)
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

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        lease.backend.in_use -= 1
        self.dispatch()

    def hold(self, lease: Lease) -> float:
        """The lease's server was busy although this pool counted its slot free: keep the
        slot counted as taken for a back-off that doubles with each such refusal in a
        row (:meth:`served` resets it), then release it. Returns the back-off."""
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
