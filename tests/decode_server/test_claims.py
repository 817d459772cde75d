"""A decode request that names only its handoff (``HandoffClaim``): it holds its slot (200 at
the take, refusals after it in the body), the prefill's result (the first token) comes with the
KV over the KV channel, not through the router. The request waits for both, answers as with the
result in its body, and every way it ends gives its slot and KV back before the answer."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx
import pytest

from pd_wire.decode import DecodeRefusal
from pd_wire.handoff import HandoffResult
from tests.decode_server.helpers import handoff, script_for, sse_events
from tests.fakes.fake_engine import FakeEngineConfig
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(60)


def _claim() -> dict[str, Any]:
    return {"handoff_id": f"h-{uuid.uuid4().hex[:12]}", "result": "with_kv"}


def _result(claim: dict[str, Any], first: int, prompt_tokens: int = 7) -> HandoffResult:
    return HandoffResult.model_validate(handoff(first, num_prompt_tokens=prompt_tokens,
                                                handoff_id=claim["handoff_id"]))


def _free(srv) -> None:
    assert srv.receiver.held() == set(), f"KV receive slot still held: {srv.receiver.held()}"
    assert srv.state.slots.busy == 0, "decode slot still busy"


@pytest.mark.parametrize("stream", [False, True])
def test_a_claim_decodes_once_the_result_came_with_the_kv(make_server, tokenizer, stream):
    first, rest = script_for(tokenizer, " and then some")
    srv = make_server(FakeEngineConfig(script=rest), slots=1)
    claim = _claim()
    answer: dict[str, httpx.Response] = {}

    def ask() -> None:
        answer["r"] = httpx.post(srv.url + "/v1/completions", timeout=30, json={
            "prompt": "x", "max_tokens": 20, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None, "kv_transfer_params": claim})

    client = threading.Thread(target=ask)
    client.start()
    wait_until(lambda: claim["handoff_id"] in srv.receiver.waits, 15, "the claim waits for its KV")
    assert "r" not in answer  # the KV is there (auto_complete), the result is not: it waits
    srv.receiver.prefilled(_result(claim, first, prompt_tokens=11))
    client.join(30)
    resp = answer["r"]
    assert resp.status_code == 200, resp.text
    if stream:
        events = sse_events(resp)
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices"))
        usage = events[-2]["usage"]
    else:
        text, usage = resp.json()["choices"][0]["text"], resp.json()["usage"]
    assert text == " and then some"
    assert usage["prompt_tokens"] == 11  # from the result that came with the KV
    srv.wait_idle()
    _free(srv)


def test_a_claim_checks_the_prompts_length_when_the_result_comes(make_server):
    srv = make_server(slots=1, max_seq_len=64)
    claim = _claim()
    srv.receiver.prefilled(_result(claim, 5, prompt_tokens=60))
    resp = httpx.post(srv.url + "/v1/completions", timeout=30,
                      json={"prompt": "x", "max_tokens": 10, "kv_transfer_params": claim})
    refusal = DecodeRefusal.of_event(resp.content)  # after its 200: the body's pd-error event
    assert resp.status_code == 200 and refusal is not None, resp.text
    assert refusal.status == 400 and refusal.error.param == "max_tokens", refusal
    assert "60 in the prompt" in refusal.error.message
    _free(srv)


def test_logprobs_need_the_prefills_answer_and_are_refused_for_a_claim(make_server):
    """(The first token's logprobs are in vLLM's answer only; so are the prompt's token ids
    that repetition_penalty needs, refused the same way by an engine that has it.)"""
    srv = make_server(slots=1)
    resp = httpx.post(srv.url + "/v1/completions", timeout=30,
                      json={"prompt": "x", "kv_transfer_params": _claim(), "logprobs": 2})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "logprobs" and "claim" in resp.json()["error"]["message"]
    _free(srv)


def test_a_malformed_claim_is_a_400(make_server):
    srv = make_server(slots=1)
    resp = httpx.post(srv.url + "/v1/completions", timeout=30,
                      json={"prompt": "x", "kv_transfer_params": {**_claim(), "result": "later"}})
    assert resp.status_code == 400 and "kv_transfer_params" in resp.json()["error"]["param"], resp.text
    _free(srv)


# ---- a claim holds its slot: 200 at the take, refusals in the body ----
@pytest.mark.parametrize("stream", [False, True])
def test_a_claim_holding_its_slot_is_answered_200_before_its_kv_lands(make_server, tokenizer, stream):
    """The 200 (the grant) comes while the claim still waits for its result; the body follows
    once it came, as for any claim."""
    first, rest = script_for(tokenizer, " and then some")
    srv = make_server(FakeEngineConfig(script=rest), slots=1)
    claim = _claim()
    with httpx.Client(timeout=30) as client, client.stream("POST", srv.url + "/v1/completions", json={
            "prompt": "x", "max_tokens": 20, "stream": stream, "kv_transfer_params": claim}) as resp:
        assert resp.status_code == 200  # the headers came: the result has not been sent yet
        assert srv.state.slots.busy == 1  # (taken before the 200; the wait for the KV begins after it)
        wait_until(lambda: claim["handoff_id"] in srv.receiver.waits, 15, "the claim waits for its KV")
        srv.receiver.prefilled(_result(claim, first))
        body = resp.read()
    if stream:
        events = sse_events(httpx.Response(200, content=body))
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices"))
    else:
        text = httpx.Response(200, content=body).json()["choices"][0]["text"]
    assert text == " and then some"
    srv.wait_idle()
    _free(srv)


@pytest.mark.parametrize("stream", [False, True])
def test_a_refusal_after_the_grant_is_the_bodys_one_pd_error_event(make_server, stream):
    """No KV within the KV timeout: the 504 the server would have answered, as the body's
    ``pd-error`` event (status and OpenAI error), slot and KV given back first."""
    srv = make_server(slots=1, kv_timeout=0.5)
    resp = httpx.post(srv.url + "/v1/completions", timeout=30,
                      json={"prompt": "x", "stream": stream, "kv_transfer_params": _claim()})
    assert resp.status_code == 200, resp.text
    refusal = DecodeRefusal.of_event(resp.content)
    assert refusal is not None, resp.content
    assert refusal.status == 504 and refusal.error.type == "kv_timeout", refusal
    _free(srv)


def test_a_claim_holding_its_slot_finds_none_free_is_a_429_at_once(make_server):
    """(None free and nobody queued: the status itself, no 200 first.)"""
    srv = make_server(slots=1)
    held = _claim()
    with httpx.Client(timeout=30) as client, client.stream("POST", srv.url + "/v1/completions", json={
            "prompt": "x", "kv_transfer_params": held}) as first:
        assert first.status_code == 200
        second = httpx.post(srv.url + "/v1/completions", timeout=30,
                            json={"prompt": "x", "kv_transfer_params": _claim()})
        assert second.status_code == 429, second.text
    wait_until(lambda: srv.state.slots.busy == 0, 15, "the first claim's slot freed as its client left")
    _free(srv)
