"""A request that finds a free slot takes it with its decode request (issue 34), against the
fake servers: no lease exchange; the decode request goes first, its server answers 200 at the
slot's take, and the prefill goes out on that 200. A refusal after the 200 is the status it
stands for; switched off (``--no-decode-request-holds-slot``) a lease comes first."""

from __future__ import annotations

import httpx
import pytest

from tests.router.conftest import MODEL

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
    assert decode["leases"] == []  # no lease asked: before, one per request
    assert decode["granted_first"] == ["held-0", "held-1", "held-2"]
    assert all(p["grant_first"] for p in _decode_params(rig))
    prefills = rig.records(rig.prefills[0])["requests"]
    for sent, prefilled in zip(decode["requests"], prefills, strict=True):  # the prefill on the decode's 200
        assert sent["request_id"] == prefilled["request_id"] and sent["t"] < prefilled["t"]
    rig.assert_no_leaks()


def test_switched_off_a_lease_comes_first(make_rig):
    rig = make_rig(decode_request_holds_slot=False)
    resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "leased"}, timeout=20)
    assert resp.status_code == 200, resp.text
    assert rig.records(rig.decodes[0])["leases"] == ["leased"]
    assert not _decode_params(rig)[0]["grant_first"] and rig.records(rig.decodes[0])["granted_first"] == []
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
