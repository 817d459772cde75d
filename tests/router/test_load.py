"""200 concurrent streaming clients, 2 decode servers with 1 slot each: FIFO, none lost, no leak."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI

from tests.router.conftest import MODEL, raw_completion
from tests.waits import eventually

N_CLIENTS = 200
TOKENS = 4


@pytest.mark.timeout(120)
async def test_200_streaming_clients_fifo(make_rig):
    rig = make_rig(
        n_decode=2,
        decode={"hold": True, "slots": 1},
        max_queue=N_CLIENTS,
        queue_timeout=60,
        log_level="warning",
    )
    fakes = [d.app for d in rig.decodes]
    pool = rig.state.pool
    client = AsyncOpenAI(base_url=rig.url + "/v1", api_key="unused", timeout=60, max_retries=0)

    def arrived() -> list[dict]:
        return sorted((r for f in fakes for r in f.records.requests), key=lambda r: r["t"])

    async def one(i: int) -> str:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"client {i}",
            max_tokens=TOKENS,
            stream=True,
            extra_headers={"X-Request-Id": f"c{i:03d}"},
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    tasks = []
    for i in range(N_CLIENTS):  # one at a time, so that the arrival order is known
        tasks.append(asyncio.create_task(one(i)))
        if i < 2:
            await eventually(lambda i=i: len(arrived()) == i + 1, 10.0, f"client {i} at a decode server",
                             interval=0.001)
        else:
            await eventually(lambda i=i: pool.queue_depth == i - 1, 10.0, f"client {i} queued", interval=0.001)
    assert rig.state.pool.held() == 2
    async with httpx.AsyncClient(timeout=10) as http:
        for served in range(N_CLIENTS):  # free one slot at a time: exactly one waiter may move up
            oldest = arrived()[served]
            holder = next(d for d in rig.decodes if oldest in d.app.records.requests)
            await http.post(holder.url + "/fake/release", json={"request_id": oldest["request_id"]})
            rid, fake, want = oldest["request_id"], holder.app, min(N_CLIENTS, served + 3)
            await eventually(
                lambda rid=rid, fake=fake, want=want: (
                    rid not in fake.records.active and len(arrived()) >= want
                ),
                10.0, f"{rid} to end and {want} clients at the decode servers", interval=0.001,
            )
    texts = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    await client.close()
    assert texts == ["".join(f"t{k} " for k in range(TOKENS))] * N_CLIENTS  # none lost, all complete
    assert [r["request_id"] for r in arrived()] == [f"c{i:03d}" for i in range(N_CLIENTS)]  # FIFO
    assert all(f.records.max_active == 1 for f in fakes) and all(not f.records.errors for f in fakes)
    assert all(not f.records.busy for f in fakes)  # never sent more than a server's slots
    assert sum(len(f.records.requests) for f in fakes) == N_CLIENTS
    await asyncio.to_thread(rig.assert_no_leaks)


async def _stream_then_maybe_leave(port: int, rid: str, leave_after: int | None) -> int:
    """A raw streaming client; leaves after ``leave_after`` data events (None: reads to the end).
    Returns the number of data events seen."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw_completion(rid, max_tokens=20))
    events = 0
    try:
        if leave_after == 0:
            return 0
        while True:
            line = await reader.readline()
            if not line or line.startswith(b"data: [DONE]"):
                return events
            if line.startswith(b"data: "):
                events += 1
                if leave_after is not None and events >= leave_after:
                    return events
    finally:
        writer.close()


@pytest.mark.timeout(120)
async def test_mass_disconnects_leak_nothing(make_rig):
    rig = make_rig(n_decode=2, decode={"slots": 3, "token_delay": 0.01}, max_queue=100, log_level="error")
    plan = {f"m{i:02d}": (None if i % 3 == 0 else (0 if i % 3 == 1 else 1 + i % 5)) for i in range(60)}
    seen = await asyncio.gather(
        *(_stream_then_maybe_leave(rig.server.port, rid, leave) for rid, leave in plan.items())
    )
    finished = [rid for (rid, leave), n in zip(plan.items(), seen, strict=True) if leave is None]
    assert all(n == 20 for (rid, leave), n in zip(plan.items(), seen, strict=True) if leave is None)
    await asyncio.to_thread(rig.assert_no_leaks, 15)
    decoded = {r["request_id"] for d in rig.decodes for r in d.app.records.requests}
    cancelled = {c for d in rig.decodes for c in d.app.records.cancels}
    assert set(finished) <= decoded and not cancelled & set(finished)
    left_in_decode = {rid for rid, leave in plan.items() if leave} & decoded
    assert left_in_decode <= cancelled  # every client that left mid-stream was cancelled upstream
    assert all(d.app.records.max_active <= 3 for d in rig.decodes)
