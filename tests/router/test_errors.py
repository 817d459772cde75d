"""Every error status the router can answer, provoked against fake backends."""

from __future__ import annotations

import json

import httpx
import pytest

from pd_router.request import legs
from pd_wire.errors import ErrorBody
from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def _error(resp: httpx.Response, status: int, type_: str, completion: bool = True) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert ErrorBody.model_validate(body).error.type == type_, body
    if completion:
        assert resp.headers.get("x-request-id")
    return body["error"]


@pytest.mark.parametrize(
    "raw,param",
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (json.dumps({"prompt": "x"}).encode(), "model"),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
        (
            json.dumps({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}).encode(),
            "stream_options",
        ),
    ],
)
def test_400_invalid_body(make_rig, raw, param):
    rig = make_rig()
    err = _error(httpx.post(rig.url + "/v1/completions", content=raw), 400, "invalid_request_error")
    assert err["param"] == param
    chat = httpx.post(rig.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert _error(chat, 400, "invalid_request_error")["param"] == "messages"
    assert rig.records(rig.prefills[0])["requests"] == []
    rig.assert_no_leaks()


def test_404_unknown_model_and_route_405_method(make_rig):
    rig = make_rig()
    err = _error(
        httpx.post(rig.url + "/v1/chat/completions", json={**CHAT, "model": "other"}), 404, "model_not_found"
    )
    assert "other" in err["message"] and err["param"] == "model"
    _error(httpx.post(rig.url + "/v1/embeddings", json={}), 404, "not_found_error", completion=False)
    _error(httpx.get(rig.url + "/v1/completions"), 405, "method_not_allowed", completion=False)
    rig.assert_no_leaks()


def test_413_body_too_large(make_rig):
    rig = make_rig(max_body_bytes=2048)
    _error(
        httpx.post(rig.url + "/v1/completions", json={**COMPLETION, "prompt": "x" * 4096}),
        413,
        "request_too_large",
    )

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(8):
            yield b" " * 512
        yield json.dumps(COMPLETION).encode()

    _error(httpx.post(rig.url + "/v1/completions", content=chunked()), 413, "request_too_large")
    # the routes a prefill server answers (vLLM's /tokenize, Anthropic's token count) the same
    _error(httpx.post(rig.url + "/tokenize", json={"prompt": "x" * 4096}), 413, "request_too_large",
           completion=False)
    counted = httpx.post(rig.url + "/v1/messages/count_tokens", content=chunked())
    assert counted.status_code == 413 and counted.json()["error"]["type"] == "request_too_large", counted.text
    rig.assert_no_leaks()


def test_429_queue_full_and_queue_timeout(make_rig):
    rig = make_rig(decode={"hold": True}, max_queue=1, queue_timeout=0.5)
    with httpx.Client(timeout=10) as client:
        import threading

        results: dict[str, httpx.Response] = {}
        first = threading.Thread(
            target=lambda: results.__setitem__(
                "first", client.post(rig.url + "/v1/completions", json=COMPLETION)
            )
        )
        first.start()
        rig.wait(lambda: rig.records(rig.decodes[0])["active"], what="first request in decode")
        second = threading.Thread(
            target=lambda: results.__setitem__(
                "second", client.post(rig.url + "/v1/completions", json=COMPLETION)
            )
        )
        second.start()
        rig.wait(lambda: rig.state.pool.queue_depth == 1, what="second request queued")
        full = client.post(rig.url + "/v1/completions", json=COMPLETION)
        _error(full, 429, "overloaded_error")
        assert full.headers["retry-after"] == "1"
        second.join(5)
        timed_out = results["second"]
        assert "queue-timeout" in _error(timed_out, 429, "overloaded_error")["message"]
        assert int(timed_out.headers["retry-after"]) >= 1
        httpx.post(rig.decodes[0].url + "/fake/release", json={"n": 1})
        first.join(5)
        assert results["first"].status_code == 200
    rig.assert_no_leaks()


@pytest.mark.parametrize(
    "knobs,needle",
    [
        ({"fail": "status", "fail_status": 500, "fail_body": "boom"}, "answered 500: boom"),
        ({"fail": "handoff_failed"}, "fake handoff failure"),
        ({"fail": "bad_json"}, "invalid JSON"),
        ({"fail": "no_params"}, "no kv_transfer_params"),
    ],
)
def test_502_bad_prefill(make_rig, knobs, needle):
    rig = make_rig(prefill=knobs)
    err = _error(httpx.post(rig.url + "/v1/completions", json=COMPLETION), 502, "bad_upstream_response")
    assert needle in err["message"]
    # the decode request went out with the prefill and was closed before any result came
    rid = rig.records(rig.prefills[0])["requests"][0]["request_id"]
    rig.wait(lambda: rig.records(rig.decodes[0])["closed_claims"] == [rid], what="the decode request closed")
    if knobs["fail"] in ("handoff_failed", "bad_json", "no_params"):  # the KV may have reached decode
        rig.wait(lambda: rig.records(rig.decodes[0])["cancels"] == [rid], what="decode cancel")
    rig.assert_no_leaks()


def test_prefill_4xx_relayed_as_is(make_rig):
    rig = make_rig(prefill={"fail": "status", "fail_status": 400})
    resp = httpx.post(rig.url + "/v1/chat/completions", json=CHAT)
    assert resp.status_code == 400
    assert resp.json() == {
        "error": {"message": "prompt too long", "type": "BadRequestError", "param": None, "code": 400}
    }
    rig.assert_no_leaks()


def test_prefill_connection_failure_retried_on_another(make_rig):
    rig = make_rig(n_prefill=2, probe_interval=60)  # the router learns of the death only by trying
    rig.prefills[0].stop()
    resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert resp.status_code == 200, resp.text
    assert len(rig.records(rig.prefills[1])["requests"]) == 1
    assert not rig.state.backends.prefill[0].healthy  # marked down until the next probe says otherwise
    rig.prefills.pop(0)
    rig.prefills[0].stop()  # now none is left: 502, not a hang
    err = _error(
        httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=10), 502, "bad_upstream_response"
    )
    assert "unreachable" in err["message"]
    rig.prefills.clear()
    rig.assert_no_leaks()


def test_502_decode_error_status_and_mid_stream(make_rig):
    rig = make_rig(decode={"fail": "status", "fail_status": 500})
    err = _error(httpx.post(rig.url + "/v1/completions", json=COMPLETION), 502, "bad_upstream_response")
    assert "answered 500" in err["message"]
    # a failing decode server is marked down at once; the next probe (0.2 s) brings it back
    rig.wait(lambda: rig.ready_status() == 200, 5, "the decode server back after a probe")
    rig.config(rig.decodes[0], fail="status", fail_status=422)  # decode 4xx: relayed as is
    assert httpx.post(rig.url + "/v1/completions", json=COMPLETION).status_code == 422
    for mode in ("mid_stream", "no_done"):
        rig.config(rig.decodes[0], fail=mode, fail_after=2)
        rig.wait(lambda: rig.ready_status() == 200, 5, "the decode server back after a probe")
        resp = httpx.post(rig.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10)
        assert resp.status_code == 200
        events = [e[6:] for e in resp.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]", events
        error = json.loads(events[-2])["error"]
        assert error["type"] == "bad_upstream_response" and set(error) == {"message", "type", "param", "code"}
        content = [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-2]]
        assert content == (["t0 ", "t1 "] if mode == "mid_stream" else ["t0 ", "t1 ", "t2 ", "t3 "])
    metrics = httpx.get(rig.url + "/metrics").text
    assert (
        f'pd_router_upstream_errors_total{{backend="{rig.decodes[0].url}",error_type="bad_upstream_response",'
        'role="decode"}' in metrics
    )
    rig.assert_no_leaks()


def test_503_no_healthy_backend(make_rig):
    rig = make_rig()
    rig.config(rig.decodes[0], ready=False)
    rig.wait(lambda: rig.ready_status() == 503, 2, "decode unready")
    err = _error(
        httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=5), 503, "no_healthy_backend"
    )
    assert "decode" in err["message"]
    rig.config(rig.prefills[0], healthy=False)
    rig.wait(lambda: not rig.state.backends.prefill_models(), 2, "prefill unhealthy")
    err = _error(
        httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=5), 503, "no_healthy_backend"
    )
    assert "prefill" in err["message"]
    rig.assert_no_leaks()


def test_504_prefill_and_decode_timeouts(make_rig):
    rig = make_rig(prefill={"delay": 2.0}, prefill_timeout=0.3, decode_timeout=0.3)
    err = _error(
        httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=10), 504, "upstream_timeout"
    )
    assert "--prefill-timeout" in err["message"]
    rig.wait(lambda: rig.records(rig.prefills[0])["disconnects"], what="prefill sees the close")
    rig.config(rig.prefills[0], delay=0.0)
    rig.config(rig.decodes[0], token_delay=1.0)
    err = _error(
        httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=10), 504, "upstream_timeout"
    )
    # silent mid-answer (its first token came): the server is taken for lost, marked down until the next probe
    rig.wait(lambda: rig.ready_status() == 200, 5, "the decode server back after a probe")
    resp = httpx.post(rig.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=10)
    events = [e[6:] for e in resp.text.split("\n\n") if e.startswith("data: ")]
    assert resp.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "upstream_timeout"
    rig.assert_no_leaks()


def test_unexpected_failure_is_openai_shaped_and_frees_the_slot(make_rig, monkeypatch):
    rig = make_rig()

    def broken(*args, **kwargs):
        raise KeyError("simulated bug")

    monkeypatch.setattr(legs, "open_slot", broken)  # on the path before the first byte
    err = _error(httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=10), 500, "internal_error")
    assert "simulated bug" not in err["message"] and "request_id=" in err["message"]
    rig.assert_no_leaks()
