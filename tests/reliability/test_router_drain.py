"""Graceful drain (issue 12, finding 11): on SIGTERM the router turns /ready 503 and
refuses new requests at once (503 + Retry-After), lets the streams in flight finish, and
ends what is left at --drain-timeout with an error event."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.procs import free_port
from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(90)
STREAM = {"model": MODEL, "prompt": "hi", "max_tokens": 20, "stream": True}


def _events(text: str) -> list[str]:
    return [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]


def _complete(text: str) -> bool:
    events = _events(text)
    return events[-1:] == ["[DONE]"] and len(events) == 21 and all("error" not in json.loads(e) for e in events[:-1])


def _check_draining(url: str) -> None:
    ready = httpx.get(url + "/ready", timeout=5)
    assert ready.status_code == 503 and "draining" in ready.text and int(ready.headers["retry-after"]) >= 1
    new = httpx.post(url + "/v1/completions", json=STREAM, timeout=5)
    assert new.status_code == 503 and new.json()["error"]["type"] == "service_unavailable", new.text
    assert int(new.headers["retry-after"]) >= 1


def _start_streams(pool: ThreadPoolExecutor, url: str, n: int):
    return [pool.submit(httpx.post, url + "/v1/completions", json=STREAM, headers={"X-Request-Id": f"s{i}"},
                        timeout=30) for i in range(n)]


def test_a_drain_lets_8_live_streams_finish(make_rig):
    rig = make_rig(decode={"slots": 8, "token_delay": 0.05})
    server = rig.server.server
    with ThreadPoolExecutor(8) as pool:
        streams = _start_streams(pool, rig.url, 8)
        rig.wait(lambda: len(rig.records(rig.decodes[0])["active"]) == 8, 10, "8 streams in decode")
        server.loop.call_soon_threadsafe(server.begin_drain)
        rig.wait(lambda: rig.state.draining, 5, "the drain to begin")
        _check_draining(rig.url)
        answers = [s.result(30) for s in streams]
    assert all(a.status_code == 200 and _complete(a.text) for a in answers), [a.text[-300:] for a in answers]
    rig.server.thread.join(10)
    assert not rig.server.thread.is_alive()  # then the server stopped by itself
    assert not rig.state.leaks()


def test_what_outlives_the_drain_timeout_ends_with_an_error_event(make_rig):
    rig = make_rig(drain_timeout=0.5, decode={"slots": 2, "token_delay": 0.5})
    server = rig.server.server
    with ThreadPoolExecutor(2) as pool:
        streams = _start_streams(pool, rig.url, 2)
        rig.wait(lambda: len(rig.records(rig.decodes[0])["active"]) == 2, 10, "2 streams in decode")
        server.loop.call_soon_threadsafe(server.begin_drain)
        answers = [s.result(30) for s in streams]
    for answer in answers:
        events = _events(answer.text)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "service_unavailable", events
    rig.server.thread.join(10)
    assert not rig.server.thread.is_alive()
    # the decode server was told (its slots came back): the cancels went out before the router stopped
    assert sorted(rig.records(rig.decodes[0])["cancels"]) == ["s0", "s1"]
    rig.wait(lambda: not rig.records(rig.decodes[0])["active"], 5, "the decode slots back")
    assert not rig.state.leaks()


def test_sigterm_drains_the_router_process(make_rig):
    """The same through the signal, on ``python -m pd_router`` itself."""
    rig = make_rig(decode={"slots": 8, "token_delay": 0.05})  # only its fakes are used
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pd_router", "--prefill", rig.prefills[0].url, "--decode", rig.decodes[0].url,
         "--port", str(port), "--probe-interval", "0.2", "--log-level", "warning"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        rig.wait(lambda: _ready(url), 30, "router process ready")
        with ThreadPoolExecutor(8) as pool:
            streams = _start_streams(pool, url, 8)
            rig.wait(lambda: len(rig.records(rig.decodes[0])["active"]) == 8, 10, "8 streams in decode")
            proc.send_signal(signal.SIGTERM)
            rig.wait(lambda: httpx.get(url + "/ready", timeout=5).status_code == 503, 5, "/ready 503")
            _check_draining(url)
            answers = [s.result(30) for s in streams]
        assert all(a.status_code == 200 and _complete(a.text) for a in answers), [a.text[-300:] for a in answers]
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
