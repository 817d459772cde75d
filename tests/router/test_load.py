"""200 concurrent streaming clients, 2 decode servers with 1 slot each: FIFO, none lost, no leak."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI

from tests.router.conftest import MODEL

N_CLIENTS = 200
TOKENS = 4


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.001)


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
            await _until(lambda i=i: len(arrived()) == i + 1)
        else:
            await _until(lambda i=i: pool.queue_depth == i - 1)
    assert rig.state.pool.leased() == 2
    async with httpx.AsyncClient(timeout=10) as http:
        for served in range(N_CLIENTS):  # free one slot at a time: exactly one waiter may move up
            oldest = arrived()[served]
            holder = next(d for d in rig.decodes if oldest in d.app.records.requests)
            await http.post(holder.url + "/fake/release", json={"request_id": oldest["request_id"]})
            rid, fake, want = oldest["request_id"], holder.app, min(N_CLIENTS, served + 3)
            await _until(
                lambda rid=rid, fake=fake, want=want: (
                    rid not in fake.records.active and len(arrived()) >= want
                )
            )
    texts = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    await client.close()
    assert texts == ["".join(f"t{k} " for k in range(TOKENS))] * N_CLIENTS  # none lost, all complete
    assert [r["request_id"] for r in arrived()] == [f"c{i:03d}" for i in range(N_CLIENTS)]  # FIFO
    assert all(f.records.max_active == 1 for f in fakes) and all(not f.records.errors for f in fakes)
    assert sum(len(f.records.requests) for f in fakes) == N_CLIENTS
    await asyncio.to_thread(rig.assert_no_leaks)
