"""Who waits for a decode slot ahead of whom (issue 51): two routers in front of the same two
single-slot decode servers (the real slot table behind the fakes), clients of the OpenAI SDK
with named keys. Tenants alternate instead of queueing one behind the other, priority classes
go first across both routers, a low class is served within the aging bound, a tenant's bound on
queued requests is a 429 that loses nothing; each server's queue log, replayed, shows the order
decided there."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.queue_log import replay
from tests.router.conftest import MODEL, Rig
from tests.waits import eventually, wait_until

pytestmark = pytest.mark.timeout(120)
KEYS = {"team-a": "key-of-team-a-0123456789", "team-b": "key-of-team-b-0123456789",
        "capped": "key-of-capped-0123456789", "ops": "key-of-ops-team-0123456789"}
TOKENS = 2


def _keys_file(path: Path, extra: str = "") -> Path:
    lines = []
    for name, key in KEYS.items():
        lines += ["[[key]]", f'name = "{name}"', f'sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"']
        if name == "capped":
            lines.append("max_queued = 3")
        if name == "ops":
            lines.append("min_priority = -10")
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


class Pool:
    """Two routers x two single-slot decode servers that hold each request until released."""

    def __init__(self, make_rig: Callable[..., Rig], keys: Path, **settings: Any) -> None:
        common = {"max_queue": 64, "queue_timeout": 60, "api_keys_file": str(keys), **settings}
        self.a = make_rig(n_decode=2, decode={"hold": True, "slots": 1}, **common)
        self.b = make_rig(n_decode=0, decode_urls=tuple(d.url for d in self.a.decodes), **common)
        self.routers = [self.a, self.b]
        self.fakes = [d.app for d in self.a.decodes]
        self.clients: dict[tuple[str, int], AsyncOpenAI] = {}
        self.tasks: dict[str, asyncio.Task[str]] = {}

    def client(self, tenant: str, router: int) -> AsyncOpenAI:
        key = (tenant, router)
        if key not in self.clients:
            self.clients[key] = AsyncOpenAI(base_url=self.routers[router].url + "/v1", api_key=KEYS[tenant],
                                            timeout=60, max_retries=0)
        return self.clients[key]

    def served(self) -> list[str]:
        """Request ids in the order they reached a decode server with their slot."""
        got = [r for f in self.fakes for r in f.records.requests if not r.get("busy")]
        return [r["request_id"] for r in sorted(got, key=lambda r: r["t"])]

    async def send(self, rid: str, tenant: str, router: int, **extra: Any) -> None:
        """A streamed completion, through the OpenAI SDK, once it is at a decode server or queued."""
        depth = self.routers[router].state.pool.queue_depth
        before = len(self.served())

        async def one() -> str:
            stream = await self.client(tenant, router).completions.create(
                model=MODEL, prompt=f"request {rid}", max_tokens=TOKENS, stream=True,
                extra_headers={"X-Request-Id": rid}, extra_body=extra or None)
            return "".join([chunk.choices[0].text async for chunk in stream])

        self.tasks[rid] = asyncio.create_task(one())
        await eventually(lambda: len(self.served()) > before or self.routers[router].state.pool.queue_depth > depth,
                         10.0, f"{rid} served or queued", interval=0.001)

    async def fill(self) -> None:
        """Both slots taken (by team-a, one through each router)."""
        for i in range(2):
            await self.send(f"fill{i}", "team-a", i)

    async def release_next(self) -> str:
        """End the oldest request holding a slot; the request granted that slot."""
        served = self.served()
        held = [rid for rid in served if any(rid in f.records.active for f in self.fakes)]
        oldest = held[0]
        holder = next(f for f in self.fakes if oldest in f.records.active)
        url = self.a.decodes[self.fakes.index(holder)].url
        async with httpx.AsyncClient(timeout=10) as http:
            await http.post(url + "/fake/release", json={"request_id": oldest})
        await eventually(lambda: len(self.served()) > len(served) or not any(
            r.state.pool.queue_depth for r in self.routers), 10.0, f"the slot of {oldest} granted", interval=0.001)
        after = self.served()
        return after[len(served)] if len(after) > len(served) else ""

    async def drain(self) -> list[str]:
        """Release until every request ended; the grants in order."""
        grants = []
        while any(not t.done() for t in self.tasks.values()):
            if not any(f.records.active for f in self.fakes):
                await asyncio.sleep(0.001)  # (a request between its grant and its hold)
                continue
            got = await self.release_next()
            if got:
                grants.append(got)
        return grants

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
        await asyncio.to_thread(self.a.assert_no_leaks)
        await asyncio.to_thread(self.b.assert_no_leaks)


def assert_replayed(pool: Pool, caplog: pytest.LogCaptureFixture) -> None:
    total = 0
    for d in pool.a.decodes:
        grants, overtaken = replay(r.getMessage() for r in caplog.records if r.threadName == d.thread.name)
        assert not overtaken, (d.url, overtaken[:5])
        total += grants
    assert total >= 1, "no request waited in a decode server's queue"


@pytest.fixture
def queue_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="decode_server.server.slots")
    return caplog


async def test_a_tenant_with_2_requests_is_served_between_another_tenants_20(make_rig, tmp_path, queue_log):
    pool = Pool(make_rig, _keys_file(tmp_path / "keys.toml"))
    a_ids = [f"A{i:02d}" for i in range(22)]
    for i, rid in enumerate(a_ids):  # 2 take the slots, 20 queue, alternately at each router
        await pool.send(rid, "team-a", i % 2)
    assert sum(r.state.pool.queue_depth for r in pool.routers) == 20
    await pool.send("B0", "team-b", 0)
    await pool.send("B1", "team-b", 1)
    grants = await pool.drain()
    texts = await asyncio.wait_for(asyncio.gather(*pool.tasks.values()), 30)
    assert all(t == "".join(f"t{k} " for k in range(TOKENS)) for t in texts)
    # B's two are granted within the next two grants, not after A's 20; A's in their arrival order
    assert sorted(grants[:2]) == ["B0", "B1"], grants
    assert [g for g in grants if g.startswith("A")] == a_ids[2:], grants
    assert_replayed(pool, queue_log)
    await pool.close()


async def test_priority_0_before_10_across_both_routers(make_rig, tmp_path, queue_log):
    pool = Pool(make_rig, _keys_file(tmp_path / "keys.toml"))
    await pool.fill()
    low = [f"low{i}" for i in range(4)]
    high = [f"high{i}" for i in range(4)]
    for i, rid in enumerate(low):
        await pool.send(rid, "team-a", i % 2, priority=10)
    for i, rid in enumerate(high):
        await pool.send(rid, "team-a", (i + 1) % 2)  # priority 0, the default
    grants = await pool.drain()
    await asyncio.wait_for(asyncio.gather(*pool.tasks.values()), 30)
    assert grants == high + low, grants
    assert_replayed(pool, queue_log)
    # the router's metrics by tenant and priority
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(pool.a.url + "/metrics")).text
    assert 'pd_router_tenant_queue_wait_seconds_count{priority="10",tenant="team-a"}' in text
    await pool.close()


async def test_a_low_priority_request_is_served_within_the_aging_bound(make_rig, tmp_path, queue_log):
    aging = 1.5
    pool = Pool(make_rig, _keys_file(tmp_path / "keys.toml"), priority_aging=aging)
    await pool.fill()
    await pool.send("low", "team-b", 0, priority=10)
    t_low = time.monotonic()
    await pool.send("high0", "team-a", 1)
    await pool.send("high1", "team-a", 0)
    grants: list[tuple[str, float]] = []
    k = 2
    while "low" not in [g for g, _ in grants]:  # a higher-priority request always waits beside it
        assert time.monotonic() - t_low < 60, grants
        await asyncio.sleep(0.25)  # (the pace of the releases: a schedule)
        got = await pool.release_next()
        grants.append((got, time.monotonic() - t_low))
        await pool.send(f"high{k}", "team-a", k % 2)
        k += 1
    passed = [g for g, t in grants if t < aging]
    assert passed and all(g.startswith("high") for g in passed), grants  # passed while it was young
    # granted at the first or second grant after its wait passed the bound (the aged request's
    # standing decode request reaches the servers' queues a round trip after the bound)
    after = [g for g, t in grants if t >= aging]
    assert "low" in after[:2], grants
    await pool.drain()  # the rest
    await asyncio.wait_for(asyncio.gather(*pool.tasks.values()), 30)
    assert_replayed(pool, queue_log)
    await pool.close()


async def test_a_tenants_bound_on_queued_requests_is_a_429_that_loses_nothing(make_rig, tmp_path, queue_log):
    pool = Pool(make_rig, _keys_file(tmp_path / "keys.toml"))
    await pool.fill()
    for i in range(3):  # its bound: max_queued = 3 at each router
        await pool.send(f"capped{i}", "capped", 0)
    with pytest.raises(openai.RateLimitError) as refused:
        await pool.client("capped", 0).completions.create(model=MODEL, prompt="one more", max_tokens=TOKENS)
    err = refused.value
    assert err.response.headers["retry-after"] == "2"
    body = err.response.json()["error"]
    assert body["code"] == "tenant_queue_full" and "'capped' has 3 requests queued" in body["message"], body
    await pool.send("capped-b", "capped", 1)  # at the other router: its own count
    await pool.send("other", "team-b", 0)  # another tenant: not bound by it
    grants = await pool.drain()
    texts = await asyncio.wait_for(asyncio.gather(*pool.tasks.values()), 30)
    assert len(texts) == 7 and sorted(grants) == sorted(["capped0", "capped1", "capped2", "capped-b", "other"])
    await pool.close()


def test_keys_tenants_and_priority_floors(make_rig, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pd_router.tenants")
    keys = _keys_file(tmp_path / "keys.toml")
    rig = make_rig(api_keys_file=str(keys), discovery_interval=0.1)
    plain = make_rig(api_keys_file=str(keys), tenant_header="X-Tenant")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}

    def post(r: Rig, key: str | None, **extra: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(r.url + "/v1/completions", json={**body, **{k: v for k, v in extra.items()
                                                                       if k != "headers"}},
                          headers={**headers, **extra.get("headers", {})}, timeout=10)

    def tenants_seen(r: Rig) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in httpx.get(r.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith("pd_router_tenant_queue_wait_seconds_count{"):
                out[re.search(r'tenant="([^"]*)"', line)[1]] = float(line.rsplit(" ", 1)[1])
        return out

    assert post(rig, None).status_code == 401
    assert post(rig, "not-a-key-0123456789").status_code == 401
    assert httpx.get(rig.url + "/v1/models", timeout=5).status_code == 401
    assert httpx.get(rig.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['team-a']}"},
                     timeout=5).status_code == 200
    assert post(rig, KEYS["team-a"]).status_code == 200
    # a tenant header names nothing without --tenant-header
    assert post(rig, KEYS["team-a"], headers={"X-Tenant": "team-b"}).status_code == 200
    assert tenants_seen(rig) == {"team-a": 2.0}
    # with it, it names the tenant (unknown names share the label "other")
    assert post(plain, KEYS["team-a"], headers={"X-Tenant": "team-b"}).status_code == 200
    assert post(plain, KEYS["team-a"], headers={"X-Tenant": "someone"}).status_code == 200
    assert tenants_seen(plain) == {"team-b": 1.0, "other": 1.0}
    # priority: below --min-priority (0) only with a key that allows it
    low = post(rig, KEYS["team-a"], priority=-1)
    assert low.status_code == 400 and low.json()["error"]["param"] == "priority", low.text
    assert post(rig, KEYS["ops"], priority=-10).status_code == 200
    assert post(rig, KEYS["ops"], priority=-11).status_code == 400
    assert post(rig, KEYS["team-a"], priority=3).status_code == 200
    # forwarded to prefill as it came (vLLM orders its prefills by it with its priority policy)
    sent = [r["body"].get("priority") for p in rig.prefills for r in rig.records(p)["requests"]]
    assert sorted(p for p in sent if p is not None) == [-10, 3], sent
    # the keys file, changed, is read again: a new key works, a removed one no longer does
    new_key = "key-of-newcomer-0123456789"
    keys.write_text(keys.read_text().replace(hashlib.sha256(KEYS["team-b"].encode()).hexdigest(),
                                             hashlib.sha256(new_key.encode()).hexdigest()))
    wait_until(lambda: post(rig, new_key).status_code == 200, 10.0, "the new key accepted")
    assert post(rig, KEYS["team-b"]).status_code == 401
    # a file that no longer parses: the keys before stay
    keys.write_text("[[key]\nname = ")
    wait_until(lambda: any("keys file not reloaded" in r.getMessage() for r in caplog.records), 10.0,
               "the broken file reported")
    assert post(rig, new_key).status_code == 200
