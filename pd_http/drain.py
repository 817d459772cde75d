"""A uvicorn server that drains before it stops.

uvicorn stops on SIGTERM by closing its listening sockets at once and cutting what is
still running after ``timeout_graceful_shutdown``. :class:`DrainingServer` instead runs the
application's ``drain`` coroutine on the first SIGTERM or SIGINT (the application turns
``/ready`` 503, refuses new requests with 503 + ``Retry-After`` and waits for those in
flight, up to its drain timeout) and only then stops as uvicorn does. A second signal
stops at once, as uvicorn would on the first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

log = logging.getLogger("pd_http.drain")


async def wait_then_cut(
    idle: Callable[[], Awaitable[object]],
    in_flight: Callable[[], int],
    cut: Callable[[], None],
    timeout: float,
    grace: float,
    what: str,
) -> None:
    """The drain's waiting, for router and decode server alike: until ``idle()`` returns or
    ``timeout`` seconds passed; then ``cut()`` ends what is still in flight (each with its
    error) and ``idle()`` is awaited again for at most ``grace`` seconds. ``what`` names the
    things counted by ``in_flight()`` in the log."""
    log.warning("draining: %d %s in flight, up to %gs (--drain-timeout)", in_flight(), what, timeout)
    try:
        await asyncio.wait_for(idle(), timeout)
    except TimeoutError:
        log.warning("drain timeout: ending %d %s still in flight", in_flight(), what)
        cut()
        try:
            await asyncio.wait_for(idle(), grace)
        except TimeoutError:
            log.error("%d %s did not end after the drain", in_flight(), what)
    log.warning("drained")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]],
                 started: Callable[[], object] | None = None) -> None:
        """``started``: called once the application's start-up is over and the sockets listen."""
        super().__init__(config)
        self._drain = drain
        self._started = started
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once started
        self._drain_task: asyncio.Task[None] | None = None
        self.draining = False

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self._started is not None and not self.should_exit:
            self._started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining or self.loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        self.loop.call_soon_threadsafe(self.begin_drain)

    def begin_drain(self) -> None:
        """Drain, then stop (also for tests and embedders that do not send a signal)."""
        self.draining = True
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:
            log.exception("drain failed; stopping now")
        finally:
            self.should_exit = True
