"""Waiting on observable state in tests: poll a predicate until it holds, fail naming what
was awaited. The one place tests wait (a sleep followed by an assertion is a race)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.01) -> float:
    """Poll ``predicate`` until it is true; fail naming ``what`` after ``timeout`` s.
    Returns the seconds it took."""
    start = time.monotonic()
    deadline = start + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(interval)
    return time.monotonic() - start


async def eventually(predicate: Callable[[], object], timeout: float = 5.0, what: str = "condition",
                     interval: float = 0.01) -> None:
    """:func:`wait_until` for a coroutine: the event loop runs while it polls."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(interval)
