"""A thread that drains a transport's notifications and hands them to an asyncio loop.

Transports have no progress thread of their own (see :mod:`connector.transport.nixl`),
so the pump also keeps the agent progressing: every ``busy_s`` while ``busy()`` says
transfers are expected, every ``idle_s`` otherwise; ``wake()`` ends an idle wait early.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from connector.transport.base import Transport

log = logging.getLogger(__name__)

Deliver = Callable[[list[tuple[str, bytes]]], None]


class NotificationPump:
    def __init__(self, transport: Transport, loop: asyncio.AbstractEventLoop, deliver: Deliver,
                 busy: Callable[[], bool], busy_s: float = 0.0005, idle_s: float = 0.05) -> None:
        self._transport, self._loop, self._deliver, self._busy = transport, loop, deliver, busy
        self._busy_s, self._idle_s = busy_s, idle_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{transport.name}-notifs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                notifs = self._transport.notifications()
            except Exception as exc:  # the transport died: keep running until stop()
                log.error("polling %s's notifications failed: %s", self._transport.name, exc)
                notifs = []
            if notifs:
                self._loop.call_soon_threadsafe(self._deliver, notifs)
            if self._busy():
                self._stop.wait(self._busy_s)
            else:
                self._wake.wait(self._idle_s)
                self._wake.clear()
