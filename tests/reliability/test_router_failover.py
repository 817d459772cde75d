"""Failover before the first byte and failing servers marked down at once (issue 12,
findings 5 and 12), against fake decode servers."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def _served_by(rig, i: int) -> list[str]:
    return [r["request_id"] for r in rig.records(rig.decodes[i])["requests"]]


def _metrics(rig) -> str:
    return httpx.get(rig.url + "/metrics", timeout=5).text


def _failovers(rig) -> str:
    lines = _metrics(rig).splitlines()
    return "\n".join(line for line in lines if line.startswith("pd_router_decode_failovers_total{"))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("how", ["status_500", "refused", "lost_before_first_chunk", "handoff_failed"])
def test_a_decode_server_failing_before_the_first_byte_costs_only_latency(make_rig, how, stream):
    # the probes are slow: the router learns of the failure only from the request itself
    rig = make_rig(n_decode=2, probe_interval=60, decode={"slots": 2})
    bad, good = rig.decodes
    if how == "status_500":
        rig.config(bad, fail="status", fail_status=500)
    elif how == "lost_before_first_chunk":
        rig.config(bad, fail="mid_stream", fail_after=0)
    elif how == "handoff_failed":  # prefill's KV push to it failed; the next one goes through
        rig.config(rig.prefills[0], fail="handoff_failed", handoff_reason="transfer", fail_times=1)
    else:
        bad.stop()
    # the router picks the server with more free slots: the bad one; it must fail over to the other
    rig.state.backends.decode[1].in_use += 1
    try:
        resp = httpx.post(rig.url + "/v1/completions", json={**COMPLETION, "stream": stream},
                          headers={"X-Request-Id": "r1"}, timeout=20)
    finally:
        rig.state.backends.decode[1].in_use -= 1
    assert resp.status_code == 200, resp.text
    if stream:
        events = [e[6:] for e in resp.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), events
    else:
        assert resp.json()["choices"][0]["text"] == "t0 t1 t2 t3 "
    assert _served_by(rig, 1) == ["r1"]  # the retry's handoff id is r1#1, its request id r1
    assert not rig.state.backends.decode[0].healthy  # marked down at once
    if how == "refused":  # its decode request could not connect: marked down before any prefill, no failover
        slot_lines = [line for line in _metrics(rig).splitlines() if line.startswith("pd_router_slot_requests_total{")]
        assert any(line.startswith(f'pd_router_slot_requests_total{{backend="{bad.url}",result="error"}}')
                   for line in slot_lines), slot_lines
        assert not _failovers(rig)
        rig.decodes.pop(0)
    else:
        assert f'backend="{bad.url}"' in _failovers(rig)
    rig.assert_no_leaks()


def test_no_other_decode_server_means_the_original_error(make_rig):
    rig = make_rig(probe_interval=60)
    rig.config(rig.decodes[0], fail="status", fail_status=500)
    resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert resp.status_code == 502 and "answered 500" in resp.json()["error"]["message"]
    assert not _failovers(rig)
    rig.assert_no_leaks()


def test_a_decode_server_failing_mid_stream_is_marked_down_at_once(make_rig):
    """Its answer moves to the other server (tests/router/test_migration.py), and queued requests
    no longer run a full prefill on a server that just failed."""
    rig = make_rig(n_decode=2, probe_interval=60, decode={"slots": 2})
    rig.config(rig.decodes[0], fail="mid_stream", fail_after=2)
    rig.state.backends.decode[1].in_use += 1  # the first pick is decode 0
    try:
        resp = httpx.post(rig.url + "/v1/completions", json={**COMPLETION, "stream": True},
                          headers={"X-Request-Id": "dies"}, timeout=20)
    finally:
        rig.state.backends.decode[1].in_use -= 1
    assert resp.status_code == 200 and '"error"' not in resp.text  # after the first byte: moved, not failed
    assert not rig.state.backends.decode[0].healthy
    for i in range(3):
        rid = f"next-{i}"
        resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": rid}, timeout=10)
        assert resp.status_code == 200, resp.text
    assert _served_by(rig, 0) == ["dies"] and _served_by(rig, 1) == ["dies", "next-0", "next-1", "next-2"]
    prefills = [r["path"] for r in rig.records(rig.prefills[0])["requests"]]
    assert prefills.count("/v1/completions") == 5  # no prefill wasted on the dead server (one for the move)
    rig.assert_no_leaks()
