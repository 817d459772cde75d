"""The decode server's drain (issue 12, finding 11): on SIGTERM /ready turns 503, new
requests get 503 + Retry-After (the router runs them on another decode server), the
generations in flight finish, and past --drain-timeout they end with an error event."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.decode_server.conftest import start_server
from tests.decode_server.helpers import handoff
from tests.fakes.fake_engine import FakeEngineConfig
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(60)


def _body(max_tokens: int) -> dict:
    return {"prompt": "x", "max_tokens": max_tokens, "stream": True, "kv_transfer_params": handoff(5)}


def _events(text: str) -> list[str]:
    return [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]


@pytest.mark.parametrize("drain_timeout", [30.0, 0.3])
def test_the_decode_server_drains(model_dir, drain_timeout):
    cfg = FakeEngineConfig(script=[], filler_token=5, step_delay=0.02)
    srv, server, thread = start_server(model_dir, cfg, slots=4, drain_timeout=drain_timeout)
    try:
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(httpx.post, srv.url + "/v1/completions", json=_body(40),
                                   headers={"X-Request-Id": f"d{i}"}, timeout=30) for i in range(4)]
            wait_until(lambda: srv.state.slots.busy == 4, 15, "4 generations running")
            server.loop.call_soon_threadsafe(server.begin_drain)
            wait_until(lambda: srv.state.draining, 15, "the drain to begin")
            ready = httpx.get(srv.url + "/ready", timeout=5)
            assert ready.status_code == 503 and "draining" in ready.text and ready.headers["retry-after"] == "1"
            new = httpx.post(srv.url + "/v1/completions", json=_body(4), timeout=5)
            assert new.status_code == 503 and new.headers["retry-after"] == "1", new.text
            answers = [s.result(30) for s in streams]
        for answer in answers:
            events = _events(answer.text)
            assert answer.status_code == 200 and events[-1] == "[DONE]"
            errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
            if drain_timeout > 1:  # 40 tokens x 20 ms: all finish
                assert not errors, errors
            else:
                assert len(errors) == 1, events[-3:]
        thread.join(10)
        assert not thread.is_alive()  # it stopped by itself after the drain
        assert srv.state.slots.busy == 0 and not srv.receiver.held()
    finally:
        server.should_exit = True
        thread.join(10)
