"""A decode server busy although its slot was the request's (issue 17): prefill's KV refused at
admission (``HandoffResult.reason == "busy"``), or decode 429 from a server the router counts (a
plain vLLM, ``--decode-slots``: its slot free in the router's count). Not a client error while
``--queue-timeout`` allows waiting: the request waits for a slot (this server after a back-off,
or another) and runs prefill again."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
BUSY = {"fail": "handoff_failed", "handoff_reason": "busy"}
COUNTED = {"plain": True}  # decode servers whose slots the router counts (with --decode-slots)


def _requeues(rig, reason: str) -> float:
    total = 0.0
    for line in httpx.get(rig.url + "/metrics").text.splitlines():
        if line.startswith("pd_router_busy_requeues_total{") and f'reason="{reason}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _handoff_ids(rig, backend) -> list[str]:
    return [r["body"]["kv_transfer_params"]["handoff_id"] for r in rig.records(backend)["requests"]]


def _decoded(rig, backend) -> list[str]:
    """The handoffs a decode server decoded: its requests less those the router closed
    unanswered (a failed prefill closes the decode request holding its slot)."""
    closed = rig.records(backend)["closed_claims"]
    return [h for h in _handoff_ids(rig, backend) if h not in closed]


def test_kv_receive_slot_busy_waits_and_prefills_again(make_rig):
    rig = make_rig(prefill={**BUSY, "fail_times": 2})
    resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "r1"}, timeout=20)
    assert resp.status_code == 200, resp.text
    assert _handoff_ids(rig, rig.prefills[0]) == ["r1", "r1#1", "r1#2"]  # a new handoff per attempt
    assert _requeues(rig, "kv_receive_slot") == 2
    rig.wait(lambda: rig.records(rig.decodes[0])["cancel_handoffs"] == ["r1", "r1#1"], what="cancels")
    rig.wait(lambda: rig.records(rig.decodes[0])["closed_claims"] == ["r1", "r1#1"], what="closed decode requests")
    assert _decoded(rig, rig.decodes[0]) == ["r1#2"]
    rig.assert_no_leaks()


def test_busy_until_the_queue_timeout_is_a_429_not_a_502(make_rig):
    rig = make_rig(prefill=BUSY, queue_timeout=0.6)
    t0 = time.monotonic()
    resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=20)
    elapsed = time.monotonic() - t0
    assert resp.status_code == 429, resp.text
    err = resp.json()["error"]
    assert err["type"] == "overloaded_error" and "queue-timeout" in err["message"] and "busy" in err["message"]
    assert int(resp.headers["retry-after"]) >= 1
    assert 0.5 < elapsed < 5, elapsed
    assert _requeues(rig, "kv_receive_slot") >= 2
    rig.assert_no_leaks()


def _served(rig, backend) -> list[str]:
    """The requests a plain decode server answered (not with its 429)."""
    return [r["request_id"] for r in rig.records(backend)["requests"] if not r.get("busy")]


def test_busy_server_is_held_back_and_another_one_serves(make_rig):
    rig = make_rig(n_decode=2, decode=COUNTED, decode_slots=1)
    rig.config(rig.decodes[0], busy=True)  # its slot taken outside this router's count
    resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "r2"}, timeout=20)
    assert resp.status_code == 200, resp.text
    assert rig.records(rig.decodes[0])["busy"] == ["r2"] and _served(rig, rig.decodes[1]) == ["r2"]
    assert _requeues(rig, "engine_slot") == 1
    rig.assert_no_leaks()


def test_decode_429_waits_and_prefills_again(make_rig):
    rig = make_rig(decode={**COUNTED, "busy": True}, decode_slots=1)
    result: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "r3"}, timeout=30)))
    t.start()
    rig.wait(lambda: _requeues(rig, "engine_slot") >= 1, timeout=10, what="a requeue after decode 429s")
    rig.config(rig.decodes[0], busy=False)
    t.join(20)
    assert result["r"].status_code == 200, result["r"].text
    assert len(rig.records(rig.prefills[0])["requests"]) >= 2  # prefilled again for the next attempt
    assert _served(rig, rig.decodes[0]) == ["r3"]
    rig.assert_no_leaks()


def test_a_requeued_request_keeps_its_place_in_the_queue(make_rig):
    """FIFO: a request sent back by a busy server waits ahead of the ones that came after it."""
    rig = make_rig(decode={**COUNTED, "busy": True}, decode_slots=1)
    results: dict[str, httpx.Response] = {}

    def post(rid: str) -> None:
        results[rid] = httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": rid},
                                  timeout=30)

    first = threading.Thread(target=post, args=("first",))
    first.start()
    rig.wait(lambda: _requeues(rig, "engine_slot") >= 1, what="first sent back by the busy server")
    second = threading.Thread(target=post, args=("second",))
    second.start()
    rig.wait(lambda: rig.state.pool.queue_depth == 2, what="second queued behind first")
    rig.config(rig.decodes[0], busy=False)
    first.join(20)
    second.join(20)
    assert results["first"].status_code == 200 and results["second"].status_code == 200
    assert _served(rig, rig.decodes[0]) == ["first", "second"]
    rig.assert_no_leaks()


def test_prompt_too_long_for_the_decode_server_is_413(make_rig):
    rig = make_rig(prefill={"fail": "handoff_failed", "handoff_reason": "too_long"})
    resp = httpx.post(rig.url + "/v1/chat/completions", timeout=20,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert resp.status_code == 413, resp.text
    err = resp.json()["error"]
    assert err["type"] == "request_too_large" and err["param"] == "messages"
    rig.wait(lambda: len(rig.records(rig.decodes[0])["closed_claims"]) == 1, what="the decode request closed")
    assert _decoded(rig, rig.decodes[0]) == []
    assert _requeues(rig, "kv_receive_slot") == 0
    rig.assert_no_leaks()


def test_a_stale_handoff_id_is_retried_under_a_new_one_at_once(make_rig):
    """A client reusing an X-Request-Id whose earlier request was abandoned mid-prefill: the
    decode server still refuses that handoff id ("cancelled", or "duplicate" while its KV
    waits); the router takes the next attempt's id instead of failing."""
    rig = make_rig(prefill={"fail": "handoff_failed", "handoff_reason": "cancelled", "fail_times": 1})
    resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "again"}, timeout=20)
    assert resp.status_code == 200, resp.text
    assert _handoff_ids(rig, rig.prefills[0]) == ["again", "again#1"]
    assert _requeues(rig, "kv_receive_slot") == 0 and _requeues(rig, "stale_handoff_id") == 0  # not busy
    rig.wait(lambda: rig.records(rig.decodes[0])["cancel_handoffs"] == ["again"], what="the stale id released")
    rig.assert_no_leaks()


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_refusal_frees_the_slot_before_the_client_sees_it(make_rig, stream):
    """The decode server gave its slot and the KV back before its 4xx (decode_server
    contract): the router frees the slot at once, with no cancel round trip, so the
    client's next request finds the slot free."""
    rig = make_rig(decode={"fail": "status", "fail_status": 400})
    resp = httpx.post(rig.url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=20)
    assert resp.status_code == 400, resp.text
    assert rig.state.pool.held() == 0, "slot still held when the client got the refusal"
    assert rig.records(rig.decodes[0])["cancels"] == []
    rig.assert_no_leaks()
