"""pd_http.heap and its caller: the start-up heap is frozen once the server serves."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
import uvicorn

from pd_http.drain import DrainingServer
from tests.procs import REPO

pytestmark = pytest.mark.timeout(60)

FREEZE = """
import gc
from pd_http.heap import freeze_startup_heap
live = [[i] for i in range(50_000)]  # what a start-up leaves alive (lists: tracked by the collector)
assert gc.get_freeze_count() == 0
frozen = freeze_startup_heap("test")
assert frozen == gc.get_freeze_count(), (frozen, gc.get_freeze_count())
assert frozen >= len(live), frozen
gc.collect()
assert gc.get_freeze_count() == frozen  # a full collection leaves them frozen
print("ok", frozen)
"""


def test_freezing_moves_the_live_heap_out_of_the_collector():
    """In a process of its own: freezing the test process would keep its later cycles forever."""
    out = subprocess.run([sys.executable, "-c", FREEZE], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")


def test_the_server_calls_started_after_the_application_started_and_before_serving():
    order: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await asyncio.sleep(0)
                    order.append("application started")
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def drain() -> None:
        return None

    async def run() -> None:
        started = asyncio.Event()

        def on_started() -> None:
            order.append("started")
            started.set()

        config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_config=None)
        server = DrainingServer(config, drain, on_started)
        task = asyncio.ensure_future(server.serve())
        await asyncio.wait_for(started.wait(), 10)
        assert server.started  # uvicorn's sockets listen
        server.should_exit = True
        await asyncio.wait_for(task, 10)

    asyncio.run(run())
    assert order == ["application started", "started"]
