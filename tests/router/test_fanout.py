"""n > 1 against fake backends: n PD requests (each its own prefill, decode slot and request
id, without ``n``, the seed + i), merged into one answer or one stream with ``index`` per
choice; usage counts the prompt once; n beyond what the router can run is refused; a
failing choice fails the request and every slot comes back."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PROMPT_TOKENS = 5  # the fake decode's usage


def _sse(resp: httpx.Response) -> list[dict]:
    events = [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events
    return [json.loads(e) for e in events[:-1]]


def test_n3_not_streaming(make_rig):
    rig = make_rig(decode={"slots": 2})
    resp = httpx.post(rig.url + "/v1/chat/completions", json={**CHAT, "n": 3, "seed": 10},
                      headers={"x-request-id": "fan"}, timeout=10)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "t0 t1 t2 t3 " for c in out["choices"])
    assert out["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 12,
                            "total_tokens": PROMPT_TOKENS + 12}
    decoded = rig.records(rig.decodes[0])["requests"]
    assert sorted(r["request_id"] for r in decoded) == ["fan~n0", "fan~n1", "fan~n2"]
    assert sorted(r["body"]["seed"] for r in decoded) == [10, 11, 12]
    assert all("n" not in r["body"] for r in decoded)
    prefilled = rig.records(rig.prefills[0])["requests"]
    assert len(prefilled) == 3 and all("n" not in r["body"] for r in prefilled)
    rig.assert_no_leaks()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n3_streaming_with_usage(make_rig, path):
    rig = make_rig(decode={"slots": 4})
    body = {**CHAT, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    if path == "/v1/completions":
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "n": 3, "stream": True,
                "stream_options": {"include_usage": True}}
    resp = httpx.post(rig.url + path, json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    chunks = _sse(resp)
    assert len({c["id"] for c in chunks}) == 1  # one stream, one id
    by_index: dict[int, str] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index[choice["index"]] = by_index.get(choice["index"], "") + (
            choice["delta"]["content"] if "delta" in choice else choice["text"])
    assert by_index == {i: "t0 t1 t2 t3 " for i in range(3)}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": PROMPT_TOKENS, "completion_tokens": 12, "total_tokens": PROMPT_TOKENS + 12}
    rig.assert_no_leaks()


def test_n_beyond_slots_and_queue_is_refused(make_rig):
    rig = make_rig(decode={"slots": 2}, max_queue=3)
    resp = httpx.post(rig.url + "/v1/chat/completions", json={**CHAT, "n": 6}, timeout=10)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "n" and "decode slot" in err["message"]
    assert rig.records(rig.prefills[0])["requests"] == []
    ok = httpx.post(rig.url + "/v1/chat/completions", json={**CHAT, "n": 5}, timeout=10)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 5  # 2 at a time, 3 waiting
    rig.assert_no_leaks()


def test_a_failing_choice_fails_the_request_and_frees_every_slot(make_rig):
    rig = make_rig(decode={"slots": 3, "fail": "status", "fail_status": 500})
    resp = httpx.post(rig.url + "/v1/chat/completions", json={**CHAT, "n": 3}, timeout=10)
    assert resp.status_code == 502, resp.text
    rig.config(rig.decodes[0], fail=None)
    rig.assert_no_leaks()
