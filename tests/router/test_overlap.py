"""Prefill and decode at once, the first token with the KV (issue 34), against the fake
servers (the real stack: tests/e2e): the decode request goes out with the prefill and names
only its handoff; the client's first token does not wait for vLLM's answer; what needs that
answer keeps the order of before."""

from __future__ import annotations

import httpx
import pytest

from pd_wire.handoff import PROTOCOL_VERSION
from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def _kv_params(rig, backend) -> list[dict]:
    return [r["body"]["kv_transfer_params"] for r in rig.records(backend)["requests"]]


@pytest.mark.parametrize("stream", [True, False])
def test_the_first_token_does_not_wait_for_the_prefills_answer(make_rig, stream):
    """The prefill server holds its HTTP answer after the result went to the decode server:
    the client gets its answer (streamed: the first token; else whole) while vLLM's answer
    is still held; released, it is read and nothing leaks."""
    rig = make_rig(prefill={"hold_answer": True})
    with httpx.Client(timeout=20) as client, client.stream(
            "POST", rig.url + "/v1/completions", json={**COMPLETION, "stream": stream},
            headers={"X-Request-Id": "early"}) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_bytes()
        first = next(chunks)
        assert first  # (streamed: its first event; else the whole body)
        assert rig.records(rig.prefills[0])["active"] == ["early"]  # vLLM's answer not sent yet
        httpx.post(rig.prefills[0].url + "/fake/release")
        rest = first + b"".join(chunks)
    assert (b"data: [DONE]" in rest) if stream else b'"choices"' in rest
    assert _kv_params(rig, rig.prefills[0]) == [{"handoff_id": "early", "kv_endpoint": _kv_endpoint(rig),
                                                 "result_with_kv": True}]
    [claim] = _kv_params(rig, rig.decodes[0])
    assert claim == {"protocol_version": PROTOCOL_VERSION, "handoff_id": "early", "result": "with_kv",
                     "progress": True, "created": claim["created"]}
    rig.wait(lambda: rig.records(rig.prefills[0])["active"] == [], what="the prefill's answer read")
    rig.assert_no_leaks()


def _kv_endpoint(rig) -> str:
    return rig.state.backends.decode[0].capabilities.kv_endpoint


@pytest.mark.parametrize("extra", [{"logprobs": 1}, {"repetition_penalty": 1.1}])
def test_what_needs_the_prefills_answer_is_posted_to_the_decode_request_holding_its_slot(make_rig, extra):
    """The first token's logprobs and the prompt's token ids are in vLLM's answer only: the
    decode request still goes first and holds the slot (a claim whose result is posted), the
    prefill on its 200, and the whole result read from vLLM's answer is posted to it."""
    rig = make_rig()
    resp = httpx.post(rig.url + "/v1/completions", json={**COMPLETION, **extra}, headers={"X-Request-Id": "seq"},
                      timeout=20)
    assert resp.status_code == 200, resp.text
    assert "result_with_kv" not in _kv_params(rig, rig.prefills[0])[0]
    [claim] = _kv_params(rig, rig.decodes[0])
    assert claim == {"protocol_version": PROTOCOL_VERSION, "handoff_id": "seq", "result": "posted",
                     "progress": True, "created": claim["created"]}
    decode = rig.records(rig.decodes[0])
    assert decode["requests"][0]["t"] < rig.records(rig.prefills[0])["requests"][0]["t"]
    [posted] = decode["posted"]
    assert posted["handoff_id"] == "seq" and posted["first_token_id"] == 7
    if "logprobs" in extra:
        assert posted["prefill_logprobs"], posted
    else:  # (the prompt's ids asked of vLLM for the penalty: they travel in the posted result)
        assert rig.records(rig.prefills[0])["requests"][0]["body"]["return_token_ids"] is True
    rig.assert_no_leaks()


def test_a_decode_refusal_wins_over_the_prefills_cancelled_handoff(make_rig):
    """The decode server refuses the request itself (a 400: it gave slot and KV back, so the
    KV's admission is refused as cancelled and vLLM answers the handoff failed): the client
    gets the decode server's 400 at once, not a retry under a new handoff id."""
    rig = make_rig(decode={"fail": "status", "fail_status": 400},
                   prefill={"fail": "handoff_failed", "handoff_reason": "cancelled", "delay": 0.2})
    resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "refused"}, timeout=20)
    assert resp.status_code == 400, resp.text
    # no second attempt (the prefill goes out on the decode server's 200, and the refusal may
    # close it before the prefill server read it)
    assert [p["handoff_id"] for p in _kv_params(rig, rig.prefills[0])] in ([], ["refused"])
    rig.assert_no_leaks()
