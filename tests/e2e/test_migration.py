"""A decode server lost mid-answer on the real CPU stack (issue 49): vLLM prefill with
TileRTConnector, two reference decode servers of one slot each, the router; real NIXL. The
answer goes on on the other decode server, as one answer: greedy as the uninterrupted request
and as vLLM alone, seeded sampling as the uninterrupted request; and nothing is left held once
the lost server is back. (The fakes: tests/router/test_migration.py; every cut point of one
answer: tests/decode_server/test_real_reference.py; hosts apart:
tests/multinode/test_stack_across_nodes.py.)"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from pd_deploy.stack.launcher import Stack
from pd_wire.decode import CAPABILITIES_PATH
from tests.e2e.agents.test_tools import CALL_WEATHER, WEATHER
from tests.e2e.conftest import make_stack_config, running_stack, vllm_kv_usage
from tests.held_slot import held_slot
from tests.stream_choices import choices_of, each_choice_streams
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]
STALL_S = 1.5
PROMPT = "Count: one, two, three,"


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = make_stack_config(tiny_model_dir, tmp_path_factory.mktemp("migration-logs"), num_decode=2,
                            reasoning_parser="glm45",
                            router_args=("--stall-timeout", str(STALL_S), "--probe-interval", "0.5"))
    with running_stack(cfg) as stack:
        yield stack


def _metric(url: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
               if line.startswith(prefix))


def _proc(stack: Stack, url: str) -> Any:
    i = stack.config.decode_urls.index(url)
    return next(p for p in stack.processes if p.name == f"decode-{i}")


def _busy(stack: Stack) -> list[str]:
    return [u for u in stack.config.decode_urls if httpx.get(u + CAPABILITIES_PATH, timeout=5).json()["busy_slots"]]


def _stream(url: str, path: str, body: dict[str, Any], events: list[dict[str, Any]], rid: str) -> float:
    """The streamed answer's SSE events (appended as they come); the time of its end."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, headers={"X-Request-Id": rid},
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
    return time.monotonic()


def _all_free(stack: Stack) -> None:
    cfg = stack.config

    def free() -> bool:
        caps = [httpx.get(u + CAPABILITIES_PATH, timeout=5).json() for u in cfg.decode_urls]
        in_flight = _metric(cfg.router_url, "pd_router_in_flight_requests")
        return not any(c["busy_slots"] or c["kv_busy_slots"] for c in caps) and not in_flight \
            and vllm_kv_usage(cfg.prefill_url) == 0

    wait_until(free, 30, "every decode slot, KV slot, vLLM KV block and router request free")


def _healthy(stack: Stack) -> None:
    """Every backend usable at the router again (after a cut; after vLLM alone, decoding on this
    host's 2 cores, starved the prefill's probes)."""
    def usable() -> bool:
        report = httpx.get(stack.config.router_url + "/ready", timeout=5).json()
        return all(p["healthy"] for p in report["prefill"]) and all(
            d["healthy"] and d["compatible"] for d in report["decode"])

    wait_until(usable, 60, "the prefill and both decode servers usable")


def _cut(stack: Stack, path: str, body: dict[str, Any], sig: signal.Signals, rid: str,
         after_events: int = 8) -> tuple[list[dict[str, Any]], str]:
    """The stream of ``body``, its decode server sent ``sig`` once ``after_events`` events reached
    the client; its events and that server. A stopped server is continued after the answer ended
    (a killed one restarted); both are healthy again and everything is free on return."""
    events: list[dict[str, Any]] = []
    cfg = stack.config
    with ThreadPoolExecutor(1) as pool:
        ended = pool.submit(_stream, cfg.router_url, path, body, events, rid)
        wait_until(lambda: len(events) >= after_events and each_choice_streams(events, body.get("n", 1))
                   or ended.done(), 60, "the first events of each choice")
        assert not ended.done(), f"the answer ended before the cut: {events[-3:]}"
        busy = _busy(stack)  # (n = 2: a choice on each; the first one's is cut)
        assert busy, "no decode server busy"
        lost = busy[0]
        proc = _proc(stack, lost)
        os.killpg(proc.pid, sig)
        try:
            ended.result(120)
        finally:
            if sig == signal.SIGSTOP:
                os.killpg(proc.pid, signal.SIGCONT)
            elif sig == signal.SIGKILL:
                proc.proc.wait(10)
                stack.restart(proc.name).wait_http(lost + "/ready", 120)
    assert len(events) > after_events + 2, "the cut came at the answer's end"
    _healthy(stack)
    _all_free(stack)
    return events, lost


def _served(stack: Stack, url: str) -> float:
    return _metric(url, 'decode_server_requests_total{endpoint="completions",status="200"}') + _metric(
        url, 'decode_server_requests_total{endpoint="chat",status="200"}')


def _first_met_at(text: str, share: float) -> str:
    """The shortest piece of ``text`` from ``share`` of its length on that the text meets there first."""
    at = int(len(text) * share)
    for size in range(3, len(text) - at):
        if text.find(text[at:at + size]) == at:
            return text[at:at + size]
    raise AssertionError(f"no piece of the text first met at {at}: {text!r}")


def _token_id(model_dir: Path, token: str) -> int:
    from tokenizers import Tokenizer

    got = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(token)
    assert got is not None, token
    return got


COMPLETION = {"prompt": PROMPT, "max_tokens": 600, "ignore_eos": True, "temperature": 0}


def test_a_decode_server_killed_mid_stream(stack, vllm_alone):
    """SIGKILL: the stream goes on on the other server, greedy as the uninterrupted request and
    as vLLM alone; the move is counted and logged with both servers."""
    cfg = stack.config
    body = {"model": cfg.model_name, **COMPLETION}
    whole: list[dict[str, Any]] = []
    _stream(cfg.router_url, "/v1/completions", body, whole, "kill-baseline")
    alone = httpx.post(vllm_alone + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    _healthy(stack)
    before = _metric(cfg.router_url, 'pd_router_migrations_total{outcome="resumed",reason="connection_lost"}')
    events, lost = _cut(stack, "/v1/completions", body, signal.SIGKILL, "kill")
    got = choices_of(events)
    assert -1 not in got, got[-1]
    assert got[0]["text"] == choices_of(whole)[0]["text"] == alone
    assert got[0]["finish"] == "length" and len({e["id"] for e in events if "id" in e}) == 1
    assert _metric(cfg.router_url, 'pd_router_migrations_total{outcome="resumed",reason="connection_lost"}') \
        == before + 1
    survivor = next(u for u in cfg.decode_urls if u != lost)
    router_log = (cfg.log_dir / "router.log").read_text()
    assert f"decode server {lost} lost after" in router_log and f"goes on on {survivor}" in router_log


CHAT = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 600,
        "ignore_eos": True, "temperature": 0}
CASES = {
    "completion, seeded sampling and a stop string": (
        "/v1/completions", {**COMPLETION, "temperature": 0.9, "seed": 5, "presence_penalty": 0.3}),
    "chat, reasoning, logprobs": ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}),
    "chat, structured output and a tool call": ("/v1/chat/completions", {
        **CHAT, "tools": [WEATHER], "ignore_eos": False,
        "structured_outputs": {"regex": "([a-z]{1,8} ){50,60}" + CALL_WEATHER}}),
    "chat, n = 2": ("/v1/chat/completions", {**CHAT, "n": 2}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_decode_server_stopped_mid_stream(stack, case):
    """SIGSTOP (the stall deadline): the answer goes on on the other server, as the
    uninterrupted request gives it, whatever the request carries; with n = 2 (one choice per
    server) only the lost choice moves, and waits for the other's slot."""
    cfg = stack.config
    path, extra = CASES[case]
    body = {"model": cfg.model_name, **extra}
    if "reasoning" in case:  # the answer reasons throughout, whatever this host's model would choose
        body["logit_bias"] = {str(_token_id(cfg.model_dir, "</think>")): -100}
    whole: list[dict[str, Any]] = []
    _stream(cfg.router_url, path, body, whole, f"stop-baseline-{len(case)}")
    expected = choices_of(whole)
    if "stop string" in case:  # a stop string past the cut: the answer ends there, both ways
        body["stop"] = [_first_met_at(expected[0]["text"], 2 / 3)]
        whole = []
        _stream(cfg.router_url, path, body, whole, "stop-baseline-stop")
        expected = choices_of(whole)
        assert expected[0]["finish"] == "stop"
    before = _metric(cfg.router_url, 'pd_router_migrations_total{outcome="resumed",reason="stalled"}')
    events, _ = _cut(stack, path, body, signal.SIGSTOP, f"stop-{len(case)}")
    got = choices_of(events)
    assert got == expected
    if "tool call" in case:
        assert got[0]["calls"].startswith("get_weather") and got[0]["finish"] == "tool_calls"
    if "reasoning" in case:
        assert got[0]["reasoning"] and got[0]["lp"]
    moved = _metric(cfg.router_url, 'pd_router_migrations_total{outcome="resumed",reason="stalled"}') - before
    assert moved == 1


def test_a_moved_answer_is_served_before_what_came_after_it(stack):
    """Every other slot busy: the moved answer waits at the head of the queues (its arrival) and
    is served before a request that arrived after it."""
    cfg = stack.config
    url = cfg.router_url
    body = {"model": cfg.model_name, **COMPLETION}
    events: list[dict[str, Any]] = []
    later: list[dict[str, Any]] = []
    first, other = cfg.decode_urls
    with ThreadPoolExecutor(2) as pool:
        with held_slot(other):  # the victim is the first server's
            victim: Future[float] = pool.submit(_stream, url, "/v1/completions", body, events, "head")
            wait_until(lambda: len(events) >= 8 or victim.done(), 60, "the victim's first events")
            waiting = _metric(url, "pd_router_queue_depth")
            after: Future[float] = pool.submit(_stream, url, "/v1/completions", {**body, "max_tokens": 8}, later,
                                               "after")
            wait_until(lambda: _metric(url, "pd_router_queue_depth") > waiting, 30, "the later request queued")
            proc = _proc(stack, first)
            os.killpg(proc.pid, signal.SIGSTOP)
            # found lost after the stall deadline, the victim waits again, ahead of the later request
            wait_until(lambda: _metric(url, "pd_router_queue_depth") >= waiting + 2 or victim.done(), 30,
                       "the victim queued again")
        # the held slot goes back: the victim, queued first, takes it
        try:
            victim_end = victim.result(120)
            later_end = after.result(120)
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
    got = choices_of(events)
    assert -1 not in got and got[0]["finish"] == "length", got.get(-1)
    assert later_end > victim_end, "the request that came later was served first"
    assert choices_of(later)[0]["finish"] == "length"
    _healthy(stack)
    _all_free(stack)


def test_both_decode_servers_lost_ends_the_stream_with_its_reason(stack):
    cfg = stack.config
    body = {"model": cfg.model_name, **COMPLETION}
    events: list[dict[str, Any]] = []
    procs = [_proc(stack, u) for u in cfg.decode_urls]
    with ThreadPoolExecutor(1) as pool:
        ended = pool.submit(_stream, cfg.router_url, "/v1/completions", body, events, "both")
        wait_until(lambda: len(events) >= 8 or ended.done(), 60, "the first events")
        t0 = time.monotonic()
        for p in procs:
            os.killpg(p.pid, signal.SIGSTOP)
        try:
            took = ended.result(120) - t0
        finally:
            for p in procs:
                os.killpg(p.pid, signal.SIGCONT)
    error = choices_of(events)[-1]
    assert error["type"] == "upstream_timeout" and "moving the answer to another decode server failed" in \
        error["message"], error
    assert took < 30, f"the error event came {took:.1f}s after both servers stopped"
    print(f"\nboth decode servers lost: error event after {took:.1f}s: {error['message']}")
    _healthy(stack)
    _all_free(stack)


def test_an_answer_not_streamed_goes_on_on_another_server(stack):
    cfg = stack.config
    body = {"model": cfg.model_name, **COMPLETION, "max_tokens": 600}
    expected = httpx.post(cfg.router_url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    answer: list[httpx.Response] = []
    client = threading.Thread(target=lambda: answer.append(
        httpx.post(cfg.router_url + "/v1/completions", json=body, timeout=120)))
    tokens = sum(_metric(u, "decode_server_generation_tokens_total") for u in cfg.decode_urls)
    client.start()
    wait_until(lambda: sum(_metric(u, "decode_server_generation_tokens_total") for u in cfg.decode_urls)
               > tokens + 20, 60, "the first tokens")
    [lost] = _busy(stack)
    proc = _proc(stack, lost)
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        client.join(120)
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    assert answer and answer[0].status_code == 200, answer[0].text if answer else "no answer"
    assert answer[0].json()["choices"][0]["text"] == expected
    assert answer[0].json()["usage"]["completion_tokens"] == 600
    _healthy(stack)
    _all_free(stack)
