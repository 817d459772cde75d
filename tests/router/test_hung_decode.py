"""A decode server that hangs (a SIGSTOPped process: connections accepted, data
acknowledged, nothing answered) costs one request a bounded wait, not every request a
timeout: its first unanswered call marks it down (a decode request holding its slot is
answered 200 at once: it is given 2 s), and the
requests after it go to the other server without trying it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pd_router.request.legs import IMMEDIATE_ANSWER_S
from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(120)
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def _unanswered_calls(rig, backend_url: str) -> float:
    """Decode requests left unanswered before their 200, and those failed over (a 200 that did not come)."""
    text = httpx.get(rig.url + "/metrics", timeout=5).text
    lines = (f'pd_router_slot_requests_total{{backend="{backend_url}",result="error"}}',
             f'pd_router_decode_failovers_total{{backend="{backend_url}",')
    return sum(float(row.rsplit(" ", 1)[1]) for row in text.splitlines() if row.startswith(lines))


def test_after_the_first_sign_of_a_hung_decode_server_no_request_waits_on_it(make_rig):
    # probes far apart: what finds the hung server here is the decode request, not a probe
    rig = make_rig(n_decode=2, decode={"slots": 1}, probe_interval=30.0)
    for _ in range(4):  # both servers have served (and so have a serving loop the fake can stop)
        assert httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=20).status_code == 200
    hung, healthy = rig.decodes
    released = threading.Event()
    hung.app.hang(released)
    latencies: list[float] = []
    statuses: list[int] = []

    def client() -> None:
        for _ in range(4):
            t0 = time.monotonic()
            statuses.append(httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=60).status_code)
            latencies.append(time.monotonic() - t0)

    clients = [threading.Thread(target=client) for _ in range(4)]
    try:
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(60)
        assert statuses == [200] * 16, statuses
        # the calls left unanswered: the one out when it hung, none after it was marked down
        assert _unanswered_calls(rig, hung.url) <= 1, "requests kept going to the hung server"
        ordered = sorted(latencies)
        print(f"\n16 requests, one decode server hung: p50 {ordered[7]:.2f}s p90 {ordered[14]:.2f}s "
              f"max {ordered[-1]:.2f}s (an answer at once is given {IMMEDIATE_ANSWER_S:g}s)")
    finally:
        released.set()
    rig.wait(lambda: rig.ready_status() == 200, 40, "the hung server back after its loop resumed")
    rig.assert_no_leaks()


def test_a_decode_server_silent_when_its_result_is_posted_is_failed_over(make_rig):
    """A decode server that granted the slot, then says nothing when the prefill's result is
    posted (its link went down meanwhile) is lost, not slow: after the call's timeout the
    request runs on the other decode server and the client gets its whole answer; the silent
    one is marked down and nothing is left held."""
    rig = make_rig(n_decode=2, decode={"slots": 1}, probe_interval=30.0)
    silent, _ = rig.decodes
    rig.config(silent, result_silent=True)
    body = {**COMPLETION, "logprobs": 1}  # the first token's logprobs: the result is posted, not sent with the KV
    for _ in range(4):  # until one lands on the silent server (the router's choice among two idle ones)
        resp = httpx.post(rig.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4, resp.json()
        if rig.records(silent)["posted"]:
            break
    assert rig.records(silent)["posted"], "no request went to the silent decode server"
    assert _unanswered_calls(rig, silent.url) == 1
    assert httpx.get(rig.url + "/ready", timeout=5).json()["decode"][0]["healthy"] is False
    rig.assert_no_leaks()
