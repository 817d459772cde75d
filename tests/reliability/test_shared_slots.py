"""Issue 13's acceptance for decode slots shared by routers on the real CPU stack (vLLM prefill +
TileRTConnector + two reference decode servers with one slot each + two routers, real
NIXL): 64 clients spread over both routers are served as by one router (no request
refused or retried as busy, the slots held whenever a request waits, FIFO across the
routers, the answers equal vLLM's own), and a router killed with -9 leaks nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pd_deploy.commands import router_argv
from pd_deploy.stack.launcher import Stack
from pd_deploy.stack.process import ManagedProcess
from tests.e2e.conftest import MODEL_NAME, make_stack_config, running_stack
from tests.metrics import metric_sum
from tests.procs import free_port
from tests.queue_log import replay
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]
PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning", "A long way from home"]
FREED_WITHIN_S = 12.0  # a dead router's slots: its connections close, the decode server frees them at once
CLIENTS = 64
TOKENS = 6


@dataclasses.dataclass
class TwoRouters:
    stack: Stack
    routers: list[str]
    second: ManagedProcess


@pytest.fixture(scope="module")
def shared(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoRouters]:
    logs = tmp_path_factory.mktemp("shared-slots-logs")
    cfg = make_stack_config(tiny_model_dir, logs, num_decode=2, decode_slots=1,
                            router_args=("--queue-timeout", "120", "--max-queue", "256"))
    with running_stack(cfg) as stack:
        port = free_port()
        spec = dataclasses.replace(cfg.router_spec(), port=port)
        second = stack._spawn("router-2", router_argv(spec))
        url = f"http://{cfg.host}:{port}"
        second.wait_http(url + "/ready", 60.0)
        yield TwoRouters(stack, [cfg.router_url, url], second)


# a router's access line: when it ended, how long after the request's arrival, when it got its decode slot
ACCESS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO pd_router\.requests: request_id=(\S+) .* "
                    r"([\d.]+)ms slot=([\d.]+)ms ttft=[\d.]+ms$")


def _slot_ids(log: Path) -> set[str]:
    """The request ids a router's access log shows served with a decode slot."""
    return {m[2] for line in log.read_text().splitlines() if (m := ACCESS.match(line))}


class Sampler(threading.Thread):
    """Every decode server's held slots and slot queue, sampled until stopped."""

    def __init__(self, decode_urls: list[str]) -> None:
        super().__init__(daemon=True)
        self.urls = decode_urls
        self.samples: list[tuple[float, float]] = []  # (held slots, queued) over all servers
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self.stop.is_set():
                held = queued = 0.0
                for url in self.urls:
                    text = http.get(url + "/metrics").text
                    for line in text.splitlines():
                        if line.startswith("decode_server_busy_slots "):
                            held += float(line.split()[1])
                        elif line.startswith("decode_server_slot_queue "):
                            queued += float(line.split()[1])
                self.samples.append((held, queued))
                self.stop.wait(0.02)


async def _client(http: httpx.AsyncClient, url: str, i: int, start: float) -> dict:
    await asyncio.sleep(start)  # spread arrivals over the run (the schedule, not synchronisation)
    body = {"model": MODEL_NAME, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text = ""
    async with http.stream("POST", url + "/v1/completions", json=body, headers={"X-Request-Id": f"c{i:03d}"}) as resp:
        status = resp.status_code
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c.get("text", "") for c in chunk.get("choices", []))
    return {"i": i, "status": status, "text": text}


def test_two_routers_serve_64_clients_as_one_queue(shared: TwoRouters) -> None:
    stack = shared.stack
    decode_urls = stack.config.decode_urls
    sampler = Sampler(decode_urls)
    sampler.start()

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=CLIENTS + 8)
        async with httpx.AsyncClient(timeout=180, limits=limits) as http:
            # warm up first (each server's first requests pay one-off costs of seconds: lazy
            # kernels, caches): both routers, both decode servers, then the measured run
            warm = await asyncio.gather(*(_client(http, shared.routers[i % 2], 900 + i, 0.0) for i in range(4)))
            assert [w["status"] for w in warm] == [200] * 4
            return await asyncio.gather(*(_client(http, shared.routers[i % 2], i, 0.03 * i) for i in range(CLIENTS)))

    try:
        results = asyncio.run(run())
    finally:
        sampler.stop.set()
        sampler.join(10)
    assert [r["status"] for r in results] == [200] * CLIENTS
    for url in shared.routers:
        assert metric_sum(url, "pd_router_busy_requeues_total") == 0, url
        assert metric_sum(url, "pd_router_requests_total", status="429") == 0, url
    # FIFO across the routers, where it is decided: each decode server's queue, replayed from its
    # log, granted in its arrival order (the routers' arrival stamps put on the server's clock).
    # No bound on time: a request whose decode request reaches a server after a grant was made
    # could not be granted before it (a router's loop behind on a loaded machine: measured 0.11 s)
    grants = 0
    for proc in (p for p in stack.processes if p.name.startswith("decode")):
        granted, overtaken = replay(proc.log_path.read_text().splitlines())
        assert not overtaken, (proc.name, overtaken[:5])  # (granted, [earlier waiters still queued])
        grants += granted
    assert grants >= 1, "no request waited in a decode server's queue: FIFO was not exercised"
    logs = [next(p for p in stack.processes if p.name == "router").log_path, shared.second.log_path]
    seen = {rid for log in logs for rid in _slot_ids(log) if rid.startswith("c0")}
    assert len(seen) == CLIENTS, sorted(seen)
    # the slots are held whenever a request waits for one
    waiting = [held for held, queued in sampler.samples if queued > 0]
    assert len(waiting) >= 10, f"the queue was never non-empty: {sampler.samples[:20]}"
    utilisation = sum(waiting) / (len(waiting) * len(decode_urls))
    assert utilisation >= 0.95, utilisation
    # the same answers as vLLM alone (the prefill server asked directly), greedy
    for prompt in PROMPTS:
        alone = httpx.post(stack.config.prefill_url + "/v1/completions", timeout=60,
                           json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
                                 "ignore_eos": True}).json()["choices"][0]["text"]
        got = {r["text"] for r in results if PROMPTS[r["i"] % len(PROMPTS)] == prompt}
        assert got == {alone}, (prompt, got, alone)
    for url in decode_urls:
        assert metric_sum(url, "decode_server_slot_grants_total") > 0


def test_a_router_killed_with_sigkill_leaks_no_slot(shared: TwoRouters) -> None:
    first, second = shared.routers
    decode_urls = shared.stack.config.decode_urls
    done: dict[str, list[int]] = {"first": [], "second": []}

    def load(url: str, key: str, n: int, tokens: int) -> None:
        with httpx.Client(timeout=120) as http:
            for i in range(n):
                try:
                    resp = http.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPTS[i % 4],
                                                                    "max_tokens": tokens, "ignore_eos": True})
                    done[key].append(resp.status_code)
                except httpx.HTTPError:
                    done[key].append(0)

    doomed = [threading.Thread(target=load, args=(second, "second", 50, 64)) for _ in range(4)]
    for t in doomed:
        t.start()
    wait_until(lambda: sum(metric_sum(u, "decode_server_busy_slots") for u in decode_urls) == 2, 60,
               "both slots held through the second router")
    os.kill(shared.second.pid, signal.SIGKILL)
    survivor = threading.Thread(target=load, args=(first, "first", 6, 4))
    survivor.start()
    survivor.join(120)
    assert done["first"] == [200] * 6, done["first"]  # the other router serves on
    for t in doomed:
        t.join(30)
    # the dead router's slots, queued requests and generations are gone at once (its connections
    # closed: the decode server frees what they held), within a bound
    wait_until(lambda: all(metric_sum(u, "decode_server_free_slots") == 1 and
                           metric_sum(u, "decode_server_slot_queue") == 0 for u in decode_urls),
               FREED_WITHIN_S, "every slot free again")
