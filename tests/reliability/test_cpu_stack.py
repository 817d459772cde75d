"""Issue 12's acceptance on the real CPU stack (vLLM prefill + TileRTConnector + two
reference decode servers + router, real NIXL): a decode server killed before its first
token costs the client nothing but latency, and a SIGTERM to the router during 8 live
streams loses none of them."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from decode_server.contract import CAPABILITIES_PATH
from pd_deploy.stack.launcher import Stack
from tests.e2e.conftest import make_stack_config, running_stack, vllm_kv_usage

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def stack2(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # probes every 30 s: the router learns of a dead decode server from the request it fails
    cfg = make_stack_config(tiny_model_dir, tmp_path_factory.mktemp("stack2-logs"), num_decode=2, decode_slots=8,
                            router_args=("--probe-interval", "30"))
    with running_stack(cfg) as stack:
        yield stack


def _proc(stack: Stack, name: str):
    return next(p for p in stack.processes if p.name == name)


def _completion(url: str, model: str, rid: str, stream: bool = False, max_tokens: int = 16) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                      "temperature": 0, "stream": stream},
                      headers={"X-Request-Id": rid}, timeout=120)


def _metric(url: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
               if line.startswith(prefix))


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_decode_server_killed_before_its_first_token_costs_only_latency(stack2):
    cfg = stack2.config
    url, model = cfg.router_url, cfg.model_name
    expected = _completion(url, model, "baseline").json()["choices"][0]["text"]
    decode0 = _proc(stack2, "decode-0")
    decode0.proc.send_signal(signal.SIGKILL)
    decode0.proc.wait(10)
    t0 = time.monotonic()
    for i in range(4):  # the router still counts decode-0 healthy: the first of these is leased there
        resp = _completion(url, model, f"after-kill-{i}")
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == expected
    elapsed = time.monotonic() - t0
    assert _metric(url, f'pd_router_decode_failovers_total{{backend="{cfg.decode_urls[0]}"') == 1
    ready = httpx.get(url + "/ready", timeout=5).json()
    assert [d["healthy"] for d in ready["decode"]] == [False, True]
    _wait(lambda: vllm_kv_usage(cfg.prefill_url) == 0, 30, "vLLM's KV blocks freed")
    assert _metric(url, "pd_router_in_flight_requests") == 0
    print(f"4 requests after kill -9 of decode-0: {elapsed:.1f}s, 1 failover")


def test_sigterm_to_the_router_during_8_live_streams_loses_none(stack2):
    cfg = stack2.config
    url, model = cfg.router_url, cfg.model_name
    router = _proc(stack2, "router")

    def busy() -> int:  # over the decode servers alive (decode-0 was killed by the previous test)
        total = 0
        for decode_url in cfg.decode_urls:
            try:
                total += httpx.get(decode_url + CAPABILITIES_PATH, timeout=5).json()["busy_slots"]
            except httpx.HTTPError:
                pass
        return total

    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(_completion, url, model, f"live-{i}", True, 48) for i in range(8)]
        _wait(lambda: busy() + sum(s.done() for s in streams) >= 8, 120, "8 live streams")
        router.proc.send_signal(signal.SIGTERM)
        _wait(lambda: httpx.get(url + "/ready", timeout=5).status_code == 503, 10, "/ready 503")
        refused = _completion(url, model, "late")
        assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
        answers = [s.result(300) for s in streams]
    for answer in answers:
        events = [e[6:] for e in answer.text.split("\n\n") if e.startswith("data: ")]
        assert answer.status_code == 200 and events[-1] == "[DONE]", answer.text[-300:]
        assert not [e for e in events[:-1] if "error" in json.loads(e)], events[-3:]
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert router.proc.wait(30) == 0
    _wait(lambda: vllm_kv_usage(cfg.prefill_url) == 0, 30, "vLLM's KV blocks freed")
    assert busy() == 0
