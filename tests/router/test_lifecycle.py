"""Client disconnects at every stage cancel the upstream work and free the slot."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from tests.router.conftest import MODEL, raw_completion

pytestmark = pytest.mark.timeout(60)


def _open_request(port: int, rid: str, stream: bool = True) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(raw_completion(rid, stream))
    return sock


def _aborts(rig, stage: str) -> float:
    for line in httpx.get(rig.url + "/metrics").text.splitlines():
        if line.startswith(f'pd_router_client_aborts_total{{stage="{stage}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_disconnect_while_queued(make_rig):
    rig = make_rig(decode={"hold": True})
    busy = _open_request(rig.server.port, "busy")
    rig.wait(lambda: rig.records(rig.decodes[0])["active"] == ["busy"], what="slot taken")
    queued = _open_request(rig.server.port, "queued")
    rig.wait(lambda: rig.state.pool.queue_depth == 1, what="second request queued")
    queued.close()
    rig.wait(lambda: rig.state.pool.queue_depth == 0, what="queue emptied")
    rig.wait(lambda: _aborts(rig, "queued") == 1, what="abort counted")
    assert [r["request_id"] for r in rig.records(rig.prefills[0])["requests"]] == ["busy"]  # never prefilled
    assert rig.state.pool.held() == 1  # only the busy request's slot
    busy.close()
    rig.wait(lambda: rig.records(rig.decodes[0])["cancels"] == ["busy"], what="cancel of the busy request")
    rig.assert_no_leaks()


def _prefills_answered(rig) -> float:
    for line in httpx.get(rig.url + "/metrics").text.splitlines():
        if line.startswith("pd_router_prefill_latency_seconds_count"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_disconnect_during_prefill(make_rig):
    rig = make_rig(prefill={"delay": 5.0})
    sock = _open_request(rig.server.port, "in-prefill")
    rig.wait(lambda: rig.records(rig.prefills[0])["active"] == ["in-prefill"], what="prefill running")
    assert rig.state.pool.held() == 1
    sock.close()
    rig.wait(lambda: rig.records(rig.prefills[0])["disconnects"] == ["in-prefill"], what="prefill closed")
    rig.wait(lambda: rig.records(rig.decodes[0])["cancels"] == ["in-prefill"], what="decode cancel")
    # its decode request went out with the prefill, and was closed before any result came
    rig.wait(lambda: rig.records(rig.decodes[0])["closed_claims"] == ["in-prefill"], what="decode request closed")
    rig.wait(lambda: _aborts(rig, "prefill") == 1, what="abort counted")
    rig.assert_no_leaks()


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_during_decode(make_rig, stream):
    rig = make_rig(decode={"token_delay": 0.05})
    sock = _open_request(rig.server.port, "in-decode", stream)
    if stream:
        seen = b""
        while b"data: " not in seen:  # the first token arrived
            seen += sock.recv(4096)
    else:  # decoding: the prefill answered (its round trip observed), the decode server is at work
        rig.wait(lambda: _prefills_answered(rig) == 1 and rig.records(rig.decodes[0])["active"] == ["in-decode"],
                 what="decode running")
    sock.close()
    rig.wait(lambda: rig.records(rig.decodes[0])["cancels"] == ["in-decode"], what="decode cancel")
    rig.wait(lambda: _aborts(rig, "decode") == 1, what="abort counted")
    rig.assert_no_leaks()
    # the slot really is free: the next request is served at once
    out = httpx.post(
        rig.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}, timeout=5
    )
    assert out.status_code == 200
    rig.assert_no_leaks()


def test_slot_released_after_every_outcome(make_rig):
    rig = make_rig(decode={"slots": 1})
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
    for knobs in ({}, {"fail": "status"}, {"fail": "mid_stream", "fail_after": 1}, {}):
        rig.config(rig.decodes[0], **{"fail": None, **knobs})
        for stream in (False, True):
            httpx.post(rig.url + "/v1/completions", json={**body, "stream": stream}, timeout=5)
            rig.assert_no_leaks()
    assert rig.records(rig.decodes[0])["max_active"] == 1


@pytest.mark.parametrize("counted", [True, False], ids=["counted", "ours"])
async def test_decode_slot_freed_late_is_retried_not_failed(make_rig, counted):
    """A decode server frees a slot a little after the last byte (its engine thread hands it
    back). A server the router counts (a plain vLLM): the router, which already counts the slot
    free, gets a 429 and waits for a slot again instead of failing; a server of ours: the next
    request's decode request waits in the server's queue until the slot is really free: no 429."""
    rig = make_rig(decode={"slots": 1, "release_lag": 0.05, "plain": counted}, decode_slots=1 if counted else None)
    async with httpx.AsyncClient(timeout=20) as client:
        answers = await asyncio.gather(
            *(
                client.post(
                    rig.url + "/v1/completions",
                    json={"model": MODEL, "prompt": "a", "max_tokens": 3, "stream": i % 2 == 0},
                )
                for i in range(6)
            )
        )
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    busy = rig.decodes[0].app.records.busy
    assert busy if counted else not busy  # counted here, the race really happened
    assert rig.decodes[0].app.records.max_active == 1
    await asyncio.to_thread(rig.assert_no_leaks)
