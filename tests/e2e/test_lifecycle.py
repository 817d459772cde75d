"""Queueing, disconnects and readiness through the whole PD stack (issue 5)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pd_wire.decode import CAPABILITIES_PATH
from tests.e2e.conftest import vllm_kv_usage
from tests.waits import wait_until

pytestmark = pytest.mark.slow


def _busy_slots(decode_url: str) -> int:
    return httpx.get(decode_url + CAPABILITIES_PATH, timeout=5).json()["busy_slots"]


def _assert_idle(stack, within_s: float = 1.0) -> None:
    seen: list[tuple[list[int], float]] = []

    def idle() -> bool:
        seen.append(([_busy_slots(u) for u in stack.config.decode_urls], vllm_kv_usage(stack.config.prefill_url)))
        return not any(seen[-1][0]) and seen[-1][1] == 0.0

    try:
        wait_until(idle, within_s, "decode slots and vLLM's KV free", 0.05)
    except AssertionError:
        raise AssertionError(f"not idle after {within_s}s: decode busy slots {seen[-1][0]}, "
                             f"vLLM KV usage {seen[-1][1]}") from None


async def _queue_depth(http: httpx.AsyncClient, router_url: str) -> int:
    text = (await http.get(f"{router_url}/metrics")).text
    return int(float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("pd_router_queue_depth "))))


def _decode_aborts(router_url: str) -> float:
    """pd_router_client_aborts_total{stage="decode"}: clients that left during the decode leg."""
    text = httpx.get(f"{router_url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pd_router_client_aborts_total{") and 'stage="decode"' in line)


def _assert_decode_aborts(router_url: str, expected: float, within_s: float) -> None:
    wait_until(lambda: _decode_aborts(router_url) == expected, within_s,
               f"{expected} client aborts at the decode stage", 0.02)


async def test_16_concurrent_clients_one_slot_first_come_first_served(pd_stack, model_name):
    """Request 0 holds the only slot while 1..15 arrive one after the other: each is sent once
    the router has queued the one before (its queue depth, the observable state), so the arrival
    order is known; then request 0's client leaves (its generation could end before the last
    arrival on a slow machine) and the first tokens of 1..15 must come in arrival order."""
    assert pd_stack.config.decode_slots == 1 and pd_stack.config.num_decode == 1
    router = pd_stack.config.router_url
    url = f"{router}/v1/completions"
    first_token_at: dict[int, float] = {}
    queued: list[asyncio.Event] = [asyncio.Event() for _ in range(16)]

    async def client(i: int, http: httpx.AsyncClient) -> int:
        if i:
            await queued[i - 1].wait()  # arrival order 0, 1, 2, ...
        body = {"model": model_name, "prompt": f"Request number {i}:", "max_tokens": 4000 if i == 0 else 8,
                "temperature": 0, "stream": True, "ignore_eos": True}
        n = 0
        async with http.stream("POST", url, json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    first_token_at.setdefault(i, time.monotonic())
                    n += len(json.loads(line[6:])["choices"])
                if i == 0 and queued[15].is_set():
                    break  # request 0 leaves: its slot goes to the queue's head
            else:
                assert i, "request 0's 4000 tokens ended before the 15 others were queued"
        return n

    async def arrivals(http: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + 60
        for i in range(16):  # request i is queued once the depth is i (0: it holds the slot instead)
            while not (first_token_at.get(0) if i == 0 else await _queue_depth(http, router) >= i):
                assert time.monotonic() < deadline, f"request {i} never queued behind request 0"
                await asyncio.sleep(0.005)
            queued[i].set()

    async with httpx.AsyncClient(timeout=300) as http:
        *counts, _ = await asyncio.gather(*(client(i, http) for i in range(16)), arrivals(http))
    assert all(c >= 1 for c in counts), counts
    order = sorted(first_token_at, key=first_token_at.get)
    assert order == list(range(16)), f"served out of arrival order: {order}"
    _assert_idle(pd_stack)


async def test_client_disconnect_mid_stream_frees_slot_and_prefill_kv(pd_stack, model_name):
    """The only decode slot is held while the client reads (2000 tokens take far longer than
    the test); once the client leaves, the router counts the abort at the decode stage and the
    slot and vLLM's KV are free within a second, long before the generation would end."""
    router, decode = pd_stack.config.router_url, pd_stack.config.decode_urls[0]
    aborts_before = _decode_aborts(router)
    body = {"model": model_name, "prompt": "Errors should never pass silently.", "max_tokens": 2000,
            "temperature": 0, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", f"{router}/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break  # leave mid-stream: closing the stream drops the connection
            assert _busy_slots(decode) == 1, "the slot must be held while the client still reads"
    _assert_idle(pd_stack, within_s=1.0)
    _assert_decode_aborts(router, aborts_before + 1, within_s=1.0)  # counted as the router's handler ends
