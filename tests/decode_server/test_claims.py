"""A decode request that names only its handoff (``HandoffClaim``, issue 34): the prefill's
result (the first token) comes with the KV over the KV channel, not through the router. The
request waits for both, answers as with the result in its body, and every way it ends gives
its slot and KV back before the answer."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx
import pytest

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


def test_a_claim_whose_result_never_comes_times_out_and_frees_everything(make_server):
    srv = make_server(slots=1, kv_timeout=0.5)
    resp = httpx.post(srv.url + "/v1/completions", timeout=30,
                      json={"prompt": "x", "kv_transfer_params": _claim()})
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "kv_timeout", resp.text
    _free(srv)


def test_a_claim_checks_the_prompts_length_when_the_result_comes(make_server):
    srv = make_server(slots=1, max_seq_len=64)
    claim = _claim()
    srv.receiver.prefilled(_result(claim, 5, prompt_tokens=60))
    resp = httpx.post(srv.url + "/v1/completions", timeout=30,
                      json={"prompt": "x", "max_tokens": 10, "kv_transfer_params": claim})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", resp.text
    assert "60 in the prompt" in resp.json()["error"]["message"]
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
