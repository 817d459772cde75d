"""A request takes its slot with its decode request, against the fake servers: the decode
request goes first, its server answers 200 at the slot's take (at once, or after a wait in its
queue), and the prefill goes out on that 200. A refusal after the 200 is the status it stands
for."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.router.conftest import MODEL
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(60)
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def _decode_params(rig) -> list[dict]:
    return [r["body"]["kv_transfer_params"] for r in rig.records(rig.decodes[0])["requests"]]


@pytest.mark.parametrize("stream", [True, False])
def test_a_free_slot_is_taken_by_the_decode_request_without_a_lease(make_rig, stream):
    rig = make_rig()
    for i in range(3):
        resp = httpx.post(rig.url + "/v1/completions", json={**COMPLETION, "stream": stream},
                          headers={"X-Request-Id": f"held-{i}"}, timeout=20)
        assert resp.status_code == 200, resp.text
        assert (b"data: [DONE]" in resp.content) if stream else "choices" in resp.json()
    decode = rig.records(rig.decodes[0])
    assert decode["granted_first"] == ["held-0", "held-1", "held-2"]
    assert all(p["result"] == "with_kv" for p in _decode_params(rig))
    prefills = rig.records(rig.prefills[0])["requests"]
    for sent, prefilled in zip(decode["requests"], prefills, strict=True):  # the prefill on the decode's 200
        assert sent["request_id"] == prefilled["request_id"] and sent["t"] < prefilled["t"]
    rig.assert_no_leaks()


@pytest.mark.parametrize("stream", [True, False])
def test_a_refusal_after_the_200_is_the_status_it_stands_for(make_rig, stream):
    """The decode server refuses after its 200 (a 400 in the body's pd-error event): the client
    gets that 400 with the decode server's error, and no prefill ran for it."""
    rig = make_rig(decode={"fail": "status", "fail_status": 400})
    resp = httpx.post(rig.url + "/v1/completions", json={**COMPLETION, "stream": stream},
                      headers={"X-Request-Id": "refused"}, timeout=20)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == "fake decode failure"
    assert rig.records(rig.decodes[0])["granted_first"] == ["refused"]
    rig.assert_no_leaks()


def test_a_server_failing_after_its_200_is_failed_over_before_the_first_byte(make_rig):
    """A 500 after the 200 (the engine failed before the first token): the request runs again
    on the other decode server, as for a 500 status."""
    rig = make_rig(n_decode=2, decode={"slots": 1})
    broken, _ = rig.decodes
    broken.app.knobs.fail, broken.app.knobs.fail_status = "status", 500
    for i in range(4):
        resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": f"f{i}"},
                          timeout=20)
        assert resp.status_code == 200, resp.text
    assert len(rig.records(broken)["granted_first"]) == 1  # tried once, then marked down
    rig.assert_no_leaks()


def test_a_queued_request_waits_with_its_decode_request_and_is_prefilled_on_its_grant(make_rig):
    """No slot free: the request's decode request waits in the decode server's queue
    (``HandoffClaim.wait``); its prefill goes out only once the slot came to it."""
    rig = make_rig(decode={"hold": True, "slots": 1})
    decode, answers = rig.decodes[0], {}

    def ask(rid: str) -> None:
        answers[rid] = httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": rid},
                                  timeout=30)

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    wait_until(lambda: rig.records(decode)["granted_first"] == ["first"], 15, "the first request holds the slot")
    second = threading.Thread(target=ask, args=("second",))
    second.start()
    wait_until(lambda: rig.records(decode)["queued_claims"] == ["second"], 15, "the second one waits there")
    assert [p["request_id"] for p in rig.records(rig.prefills[0])["requests"]] == ["first"]  # not prefilled yet
    for rid in ("first", "second"):
        httpx.post(decode.url + "/fake/release", json={"request_id": rid}, timeout=10)
    first.join(30)
    second.join(30)
    assert [answers[rid].status_code for rid in ("first", "second")] == [200, 200], answers
    records = rig.records(decode)
    assert records["granted_first"] == ["first", "second"]
    assert [p["request_id"] for p in rig.records(rig.prefills[0])["requests"]] == ["first", "second"]
    rig.assert_no_leaks()


def test_a_queued_decode_request_the_server_refuses_is_the_clients_answer_and_blocks_nobody(make_rig):
    """Queued, the request's decode request is refused by the decode server for what it asks
    (a 400 before any slot): the client gets that 400 at once, and the request queued behind it
    is served when the slot frees (before: the router took the 400 for a slot refusal and sent
    it again after a back-off, for ever, holding the head of its queue)."""
    rig = make_rig(decode={"hold": True, "slots": 1, "max_tokens": 8})
    decode, answers = rig.decodes[0], {}

    def ask(rid: str, max_tokens: int) -> None:
        answers[rid] = httpx.post(rig.url + "/v1/completions", json={**COMPLETION, "max_tokens": max_tokens},
                                  headers={"X-Request-Id": rid}, timeout=30)

    threads = [threading.Thread(target=ask, args=("holder", 4))]
    threads[0].start()
    wait_until(lambda: rig.records(decode)["granted_first"] == ["holder"], 15, "the first request holds the slot")
    for rid, max_tokens in (("too-long", 64), ("behind", 4)):
        threads.append(threading.Thread(target=ask, args=(rid, max_tokens)))
        threads[-1].start()
        wait_until(lambda rid=rid: rid in answers or rig.state.pool.queue_depth >= 1, 15, f"{rid} queued")
    threads[1].join(15)
    assert answers["too-long"].status_code == 400, answers["too-long"].text
    assert "over this decode server's 8" in answers["too-long"].json()["error"]["message"]
    for rid in ("holder", "behind"):
        httpx.post(decode.url + "/fake/release", json={"request_id": rid}, timeout=10)
    for t in threads:
        t.join(30)
    assert answers["holder"].status_code == 200 and answers["behind"].status_code == 200, answers
    assert [p["request_id"] for p in rig.records(rig.prefills[0])["requests"]] == ["holder", "behind"]
    rig.assert_no_leaks()
