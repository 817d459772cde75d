"""Every retry of a request is bounded and counted, and a request's own failure never marks
a server down (issue 53), against fake backends:

* a KV handoff id the decode server still knows (``duplicate``, ``cancelled``) is retried once
  under a new id; refused again, the request fails (409) instead of looping until its queue
  timeout (a list of prompts split by vLLM under one id did so ~600 times in 20 s);
* a busy decode server sends the request back to the queues at most ``MAX_BUSY_RETRIES`` times;
* a decode server's 504 (the request's KV did not come) fails that request, frees its slot and
  leaves the server healthy for the next one;
* ``pd_router_retries_total`` counts each by reason."""

from __future__ import annotations

import httpx
import pytest

from pd_router.request.attempts import MAX_BUSY_RETRIES
from tests.metrics import metric_sum
from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def _handoff_ids(rig) -> list[str]:
    return [r["body"]["kv_transfer_params"]["handoff_id"] for r in rig.records(rig.prefills[0])["requests"]]


@pytest.mark.parametrize("reason", ["duplicate", "cancelled"])
def test_a_handoff_id_refused_again_under_a_new_one_is_not_retried(make_rig, reason):
    rig = make_rig(prefill={"fail": "handoff_failed", "handoff_reason": reason})
    resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "dup"}, timeout=20)
    assert resp.status_code == 409, resp.text
    err = resp.json()["error"]
    assert err["param"] == "X-Request-Id" and "not retried" in err["message"], err
    assert _handoff_ids(rig) == ["dup", "dup#1"]  # one retry, under a new id
    assert metric_sum(rig.url, "pd_router_retries_total", reason="stale_handoff_id") == 1
    assert rig.state.backends.decode[0].healthy
    ok = httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=20)
    assert ok.status_code == 409  # the fake refuses every handoff: the same answer, at once, for the next one
    rig.config(rig.prefills[0], fail=None)
    assert httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=20).status_code == 200
    rig.assert_no_leaks()


def test_a_busy_decode_server_is_retried_a_bounded_number_of_times(make_rig):
    rig = make_rig(prefill={"fail": "handoff_failed", "handoff_reason": "busy"}, queue_timeout=60)
    resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "busy"}, timeout=50)
    assert resp.status_code == 429, resp.text
    assert f"at most {MAX_BUSY_RETRIES} retries" in resp.json()["error"]["message"]
    assert len(_handoff_ids(rig)) == MAX_BUSY_RETRIES + 1
    assert metric_sum(rig.url, "pd_router_retries_total", reason="kv_receive_slot") == MAX_BUSY_RETRIES
    rig.assert_no_leaks()


@pytest.mark.parametrize("stream", [False, True])
def test_a_kv_timeout_fails_its_request_and_leaves_the_server_healthy(make_rig, stream):
    """The decode server's 504 says this request's KV did not come: evidence about the request's
    handoff, not about the server (one decode server here: marked down, the next request got a 503)."""
    rig = make_rig(decode={"fail": "status", "fail_status": 504})
    resp = httpx.post(rig.url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=20)
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["type"] == "upstream_timeout"
    assert rig.state.backends.decode[0].healthy and rig.ready_status() == 200
    assert metric_sum(rig.url, "pd_router_retries_total") == 0  # no failover either
    rig.config(rig.decodes[0], fail=None)
    assert httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=20).status_code == 200
    rig.assert_no_leaks()


def test_a_list_of_prompts_is_one_choice_per_prompt_and_sample(make_rig):
    """vLLM's indexing: prompt p's sample s is choice p * n + s; each choice its own prefill and
    decode with its one prompt; usage counts each prompt once."""
    rig = make_rig(decode={"slots": 4})
    body = {"model": MODEL, "prompt": ["a", "b b", "c"], "n": 2, "max_tokens": 4, "seed": 7}
    resp = httpx.post(rig.url + "/v1/completions", json=body, headers={"X-Request-Id": "list"}, timeout=20)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert [c["index"] for c in out["choices"]] == list(range(6))
    prefilled = {r["request_id"]: r["body"] for r in rig.records(rig.prefills[0])["requests"]}
    assert {rid: (b["prompt"], b["seed"]) for rid, b in prefilled.items()} == {
        "list~n0": ("a", 7), "list~n1": ("a", 8), "list~n2": ("b b", 7), "list~n3": ("b b", 8),
        "list~n4": ("c", 7), "list~n5": ("c", 8)}
    prompt_tokens = 5  # the fake decode's usage, per choice
    assert out["usage"]["prompt_tokens"] == 3 * prompt_tokens
    assert out["usage"]["completion_tokens"] == 6 * 4
    tokens = {"model": MODEL, "prompt": [[1, 2], [3]], "max_tokens": 2}
    assert len(httpx.post(rig.url + "/v1/completions", json=tokens, timeout=20).json()["choices"]) == 2
    one = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}  # token ids: one prompt
    assert len(httpx.post(rig.url + "/v1/completions", json=one, timeout=20).json()["choices"]) == 1
    rig.assert_no_leaks()


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": ["a", [1, 2]]}, "prompt", "list of strings"),
    ({"prompt": ["p"] * 5}, "prompt", "5 prompts x n=1 is 5 choices; this router serves at most 4"),
    ({"prompt": ["p", "q"], "n": 3}, "prompt", "2 prompts x n=3 is 6 choices"),
    ({"prompt": "p", "n": 5}, "n", "n=5 is 5 choices"),
], ids=["mixed", "too-many-prompts", "prompts-times-n", "n"])
def test_too_many_choices_or_a_mixed_list_is_a_400_before_any_prefill(make_rig, body, param, words):
    rig = make_rig(decode={"slots": 8}, max_choices=4)
    resp = httpx.post(rig.url + "/v1/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=20)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert rig.records(rig.prefills[0])["requests"] == []
    rig.assert_no_leaks()
