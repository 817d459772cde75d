"""Queued requests behind standing decode requests (pd_router/slots/queue.py): two routers in
front of the same six single-slot decode servers. A request that queues costs no call at
every server (one standing decode request per router and server, whatever the queue's length),
each router's requests are served in its own arrival order, stale grants are swapped, and
nothing is lost, sent back as busy or leaked."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI

from tests.router.conftest import MODEL
from tests.waits import eventually

N_DECODE = 6
FILL = N_DECODE  # the first requests take every slot
QUEUED = 12  # then these wait, alternately at each router
TOKENS = 3


@pytest.mark.timeout(120)
async def test_queued_requests_cost_one_standing_decode_request_per_server(make_rig):
    a = make_rig(n_decode=N_DECODE, decode={"hold": True, "slots": 1}, max_queue=64, queue_timeout=60)
    b = make_rig(n_decode=0, decode_urls=tuple(d.url for d in a.decodes), max_queue=64, queue_timeout=60)
    routers = [a, b]
    fakes = [d.app for d in a.decodes]
    clients = [AsyncOpenAI(base_url=r.url + "/v1", api_key="unused", timeout=60, max_retries=0) for r in routers]

    def arrived() -> list[dict]:  # (not those answered busy: a cache that said a slot was free)
        return sorted((r for f in fakes for r in f.records.requests if not r.get("busy")), key=lambda r: r["t"])

    def slot_calls() -> int:  # slot requests: decode requests standing in a queue
        return sum(len(f.records.queued_claims) for f in fakes)

    async def one(i: int, router: int) -> str:
        stream = await clients[router].completions.create(
            model=MODEL, prompt=f"client {i}", max_tokens=TOKENS, stream=True,
            extra_headers={"X-Request-Id": f"c{i:03d}"})
        return "".join([chunk.choices[0].text async for chunk in stream])

    tasks, by_router = [], {0: [], 1: []}
    for i in range(FILL):  # one at a time through the first router, each to a slot
        tasks.append(asyncio.create_task(one(i, 0)))
        await eventually(lambda i=i: len(arrived()) == i + 1, 10.0, f"client {i} at a decode server", interval=0.001)
    before = slot_calls()
    for k in range(QUEUED):
        i, router = FILL + k, k % 2
        depth = routers[router].state.pool.queue_depth
        tasks.append(asyncio.create_task(one(i, router)))
        by_router[router].append(f"c{i:03d}")
        await eventually(lambda r=router, d=depth: routers[r].state.pool.queue_depth == d + 1, 10.0,
                         f"client {i} queued", interval=0.001)
    # one standing decode request per router and server, however many requests wait (the
    # long poll of every queued request at every server: QUEUED x N_DECODE = 72 calls)
    await eventually(lambda: slot_calls() - before >= 2 * N_DECODE, 10.0,
                     "a standing decode request from each router at each server", interval=0.001)
    queued_calls = slot_calls() - before
    # (+ the second router's first request: its cache, from a probe, said a slot was free;
    # its decode request was answered busy, and so was its next try at a server its cache
    # still said had a free slot, before it queued)
    assert queued_calls <= 2 * N_DECODE + 1, [f.records.queued_claims for f in fakes]
    async with httpx.AsyncClient(timeout=10) as http:
        for served in range(FILL + QUEUED):  # free one slot at a time
            oldest = arrived()[served]
            holder = next(d for d in a.decodes if oldest in d.app.records.requests)
            await http.post(holder.url + "/fake/release", json={"request_id": oldest["request_id"]})
            rid, fake, want = oldest["request_id"], holder.app, min(FILL + QUEUED, served + 1 + N_DECODE)
            await eventually(lambda rid=rid, fake=fake, want=want: (
                rid not in fake.records.active and len(arrived()) >= want), 10.0,
                f"{rid} to end and {want} clients at the decode servers", interval=0.001)
    texts = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for client in clients:
        await client.close()
    assert texts == ["".join(f"t{k} " for k in range(TOKENS))] * (FILL + QUEUED)  # none lost, all complete
    order = [r["request_id"] for r in arrived()]
    assert order[:FILL] == [f"c{i:03d}" for i in range(FILL)]
    for router, ids in by_router.items():  # each router's requests in its own arrival order
        assert [rid for rid in order if rid in ids] == ids, router
    assert sorted(order[FILL:]) == [f"c{i:03d}" for i in range(FILL, FILL + QUEUED)]
    # while served, per slot handed on (whatever the number of servers): at most a swap and a
    # standing request sent again per router (a grant that came for a request served
    # elsewhere), and the standing request for the next one
    calls = slot_calls() - before - queued_calls
    assert calls <= (2 * len(routers) + 1) * (FILL + QUEUED), (queued_calls, calls)
    assert sum(len(f.records.swaps) for f in fakes) >= 1, "no stale grant was swapped: the test missed that path"
    assert sum(len(f.records.queued_claims) for f in fakes) >= QUEUED
    assert all(f.records.max_active == 1 and not f.records.errors for f in fakes)
    # answered busy: a decode request taking a slot its router's count said was free, refused at
    # once (its prefill never ran: it goes out on the 200); then one more at another server that
    # count says is free, then the queues, where nothing
    # is answered busy: twice at most per request, and only for the second router's first try
    # (above) or one of the first requests, the first router's first queued one included (a
    # probe's count that came after the router's own take said a slot was free: the probe's answer
    # was made before the take's grant; seen under a loaded machine); never a request that queued
    # behind another at its router
    busy = [rid for f in fakes for rid in f.records.busy]
    assert all(busy.count(rid) <= 2 for rid in busy), busy
    assert set(busy) <= {f"c{i:03d}" for i in (*range(FILL), FILL, FILL + 1)}, busy
    prefilled = [req["request_id"] for rig in routers for p in rig.prefills for req in rig.records(p)["requests"]]
    assert sorted(prefilled) == [f"c{i:03d}" for i in range(FILL + QUEUED)]  # one prefill per request
    for r in routers:
        assert r.state.pool.queue_depth == 0
    await asyncio.to_thread(a.assert_no_leaks)
    await asyncio.to_thread(b.assert_no_leaks)
