"""Errors, busy, cancel, KV timeout and client disconnects on a real loopback socket;
a leak check (no slot, engine session or KV handoff held) after every test."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest

from pd_wire.decode import CANCEL_PATH
from tests.decode_server.helpers import client, handoff, script_for
from tests.fakes.fake_engine import FakeEngineConfig
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(60)

LONG = FakeEngineConfig(script=[], filler_token=5, step_delay=0.05)  # 500 tokens: 25 s unless stopped


def _assert_openai_error(resp: httpx.Response, status: int, error_type: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if error_type:
        assert err["type"] == error_type
    return err


def _body(first: int = 5, **kw) -> dict:
    return {"prompt": "x", "max_tokens": 500, "kv_transfer_params": handoff(first), **kw}


def _once_waiting_for_kv(srv, act, *args) -> None:
    """``act(*args)``, from another thread, once the server waits for the KV: then it comes
    while the request waits, however slow the server is to get there."""

    def run() -> None:
        wait_until(lambda: srv.receiver.waits, 15, "the server to wait for the KV")
        act(*args)

    threading.Thread(target=run, daemon=True).start()



@pytest.mark.parametrize("kv", [
    {"handoff_id": "h", "kv_endpoint": "x:1", "num_prompt_tokens": 3, "last_prompt_token_id": 1, "status": "sent"},
    {"handoff_id": "h", "kv_endpoint": "x:1", "num_prompt_tokens": 0, "first_token_id": 1,
     "last_prompt_token_id": 1, "status": "sent"},
    {"handoff_id": "h", "kv_endpoint": "x:1", "num_prompt_tokens": 3, "first_token_id": "abc",
     "last_prompt_token_id": 1, "status": "sent"},
    {"handoff_id": "h", "kv_endpoint": "x:1", "num_prompt_tokens": 3, "first_token_id": 1,
     "last_prompt_token_id": 1, "status": "maybe"},
    "not-an-object",
    None,
])
def test_malformed_kv_transfer_params_400(make_server, kv):
    srv = make_server()
    resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": kv})
    err = _assert_openai_error(resp, 400, "invalid_request_error")
    assert "kv_transfer_params" in (err["param"] or "") + err["message"]
    srv.wait_idle()
    assert srv.receiver.waits == []


def test_bad_bodies_400(make_server):
    srv = make_server()
    assert httpx.post(srv.url + "/v1/completions", content=b"{not json").status_code == 400
    err = _assert_openai_error(httpx.post(srv.url + "/v1/chat/completions", json=_body(n=2)), 400)
    assert err["param"] == "n" and "n > 1" in err["message"]
    err = _assert_openai_error(httpx.post(srv.url + "/v1/completions", json=_body(max_tokens=0)), 400)
    assert err["param"] == "max_tokens"
    err = _assert_openai_error(httpx.post(srv.url + "/v1/completions", json=_body(max_tokens=5000)), 400)
    assert "maximum context length" in err["message"]
    err = _assert_openai_error(httpx.post(srv.url + "/v1/completions", json=_body(frequency_penalty=0.5)), 400)
    assert err["param"] == "frequency_penalty"
    err = _assert_openai_error(httpx.post(srv.url + "/v1/chat/completions", json=_body(top_logprobs=2)), 400)
    assert err["param"] == "top_logprobs"
    err = _assert_openai_error(httpx.post(srv.url + "/v1/chat/completions", json=_body(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})), 400)
    # the fake engine cannot constrain decoding: refused without looking further
    assert err["param"] == "response_format" and "constrained decoding is not supported" in err["message"]
    err = _assert_openai_error(httpx.post(srv.url + "/v1/completions", json=_body(prompt_logprobs=1)), 400)
    assert err["param"] == "prompt_logprobs"
    ok = httpx.post(srv.url + "/v1/chat/completions", json=_body(max_tokens=2, response_format={"type": "text"}))
    assert ok.status_code == 200
    srv.wait_idle()


def test_prefill_failed_handoff_502(make_server):
    srv = make_server()
    kv = handoff(5, status="failed", error="busy")
    resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": kv})
    err = _assert_openai_error(resp, 502)
    assert "busy" in err["message"]
    srv.wait_idle()


def test_sender_failure_while_waiting_502(make_server):
    srv = make_server(auto_complete=False)
    kv = handoff(5)
    _once_waiting_for_kv(srv, srv.receiver.fail, kv["handoff_id"], "sender vanished")
    resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": kv})
    assert "sender vanished" in _assert_openai_error(resp, 502, "kv_handoff_failed")["message"]
    srv.wait_idle()


def test_kv_wait_timeout_504_frees_the_slot(make_server):
    srv = make_server(slots=1, auto_complete=False, kv_timeout=0.3)
    t0 = time.monotonic()
    resp = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [], "kv_transfer_params": handoff(5),
                                                              "stream": True})
    _assert_openai_error(resp, 504, "kv_timeout")
    assert 0.25 < time.monotonic() - t0 < 15
    srv.wait_idle()
    # the one slot is usable again
    kv = handoff(5)
    srv.receiver.complete(kv["handoff_id"])
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                         "kv_transfer_params": kv}).status_code == 200
    srv.wait_idle()


def test_late_kv_arrival_is_served(make_server, tokenizer):
    first, rest = script_for(tokenizer, "hello world")
    srv = make_server(FakeEngineConfig(script=rest), auto_complete=False)
    kv = handoff(first)
    _once_waiting_for_kv(srv, srv.receiver.complete, kv["handoff_id"])
    out = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": kv}).json()
    assert out["choices"][0]["text"] == "hello world"
    srv.wait_idle()


def test_busy_429_when_all_slots_are_taken(make_server):
    srv = make_server(LONG, slots=1)
    holder = threading.Thread(target=lambda: httpx.post(srv.url + "/v1/completions",
                                                        json=_body(max_tokens=40), timeout=30))
    holder.start()
    wait_until(lambda: srv.state.slots.busy == 1, 15, "srv.state.slots.busy == 1")
    with pytest.raises(openai.RateLimitError) as exc:
        client(srv.url).completions.create(model="m", prompt="x", extra_body={"kv_transfer_params": handoff(5)})
    assert exc.value.body["type"] == "rate_limit_error"
    holder.join(30)
    srv.wait_idle()


@pytest.mark.parametrize("stream", [True, False])
def test_cancel_endpoint_stops_generation_and_frees_slot(make_server, stream):
    srv = make_server(LONG, slots=1)
    result: dict = {}

    def run() -> None:
        r = httpx.post(srv.url + "/v1/completions", json=_body(stream=stream), headers={"X-Request-Id": "victim"},
                       timeout=30)
        result["status"], result["body"] = r.status_code, r.text

    t = threading.Thread(target=run)
    t.start()
    wait_until(lambda: srv.engine.steps >= 3, 15, "srv.engine.steps >= 3")
    resp = httpx.post(srv.url + CANCEL_PATH, json={"request_id": "victim"}).json()
    assert resp == {"request_id": "victim", "cancelled": True}
    t.join(10)
    srv.wait_idle(10.0)
    if stream:
        assert result["status"] == 200 and '"cancelled"' in result["body"] and "[DONE]" in result["body"]
    else:
        assert result["status"] == 499 and '"cancelled"' in result["body"]
    # the worker has closed the session and returned the slot: no step can follow
    assert srv.engine.steps < _body()["max_tokens"] // 2, "the generation ran to its end"
    again = httpx.post(srv.url + CANCEL_PATH, json={"request_id": "victim"}).json()
    assert again["cancelled"] is False


def test_cancel_while_waiting_for_kv(make_server):
    srv = make_server(slots=1, auto_complete=False, kv_timeout=30)
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        srv.url + "/v1/completions", json=_body(), headers={"X-Request-Id": "w"}, timeout=30)))
    t.start()
    wait_until(lambda: srv.receiver.waits, 15, "srv.receiver.waits")
    assert httpx.post(srv.url + CANCEL_PATH, json={"request_id": "w"}).json()["cancelled"] is True
    t.join(10)
    assert result["r"].status_code == 499
    srv.wait_idle()


def _raw_request(url: str, body: bytes, path: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_during_decode_frees_slot(make_server, stream):
    import json

    srv = make_server(LONG, slots=1)
    sock = _raw_request(srv.url, json.dumps(_body(stream=stream)).encode(), "/v1/completions")
    if stream:
        assert b"200 OK" in sock.recv(4096)
    wait_until(lambda: srv.engine.steps >= 3, 15, "srv.engine.steps >= 3")
    sock.close()
    srv.wait_idle(10.0)
    # the worker has closed the session and returned the slot: no step can follow
    assert srv.engine.steps < _body()["max_tokens"] // 2, "generation continued after the client left"
    assert "decode_server_cancelled_total{reason=\"client_disconnected\"} 1.0" in httpx.get(srv.url + "/metrics").text


def test_client_disconnect_while_waiting_for_kv_frees_slot(make_server):
    import json

    srv = make_server(slots=1, auto_complete=False, kv_timeout=30)
    sock = _raw_request(srv.url, json.dumps(_body()).encode(), "/v1/chat/completions")
    wait_until(lambda: srv.receiver.waits, 15, "srv.receiver.waits")
    sock.close()
    srv.wait_idle(10.0)
    assert srv.engine.started == []


def test_engine_errors_map_to_openai_errors(make_server):
    srv = make_server(FakeEngineConfig(fail_start="bad KV for layer 3"))
    err = _assert_openai_error(httpx.post(srv.url + "/v1/completions", json=_body()), 500, "engine_error")
    assert "bad KV for layer 3" in err["message"]
    srv.wait_idle()


def test_engine_error_mid_stream_ends_with_error_event(make_server):
    srv = make_server(FakeEngineConfig(script=[], filler_token=5, fail_at_step=3))
    text = httpx.post(srv.url + "/v1/completions", json=_body(stream=True)).text
    assert '"engine_error"' in text and text.rstrip().endswith("data: [DONE]")
    resp = httpx.post(srv.url + "/v1/completions", json=_body())
    _assert_openai_error(resp, 500, "engine_error")
    srv.wait_idle()


def test_logprobs_rejected_when_engine_has_none(make_server):
    srv = make_server(FakeEngineConfig(supports_logprobs=False))
    err = _assert_openai_error(httpx.post(srv.url + "/v1/completions", json=_body(logprobs=1)), 400)
    assert err["param"] == "logprobs"
    srv.wait_idle()


def test_many_concurrent_requests_no_leak(make_server, tokenizer):
    first, rest = script_for(tokenizer, "the quick brown fox")
    srv = make_server(FakeEngineConfig(script=rest, step_delay=0.002), slots=4)
    statuses: list[int] = []

    def one() -> None:
        statuses.append(httpx.post(srv.url + "/v1/completions", json=_body(first, stream=True), timeout=30)
                        .status_code)

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(set(statuses)) <= [200, 429] and 200 in statuses
    srv.wait_idle()
    assert srv.engine.closed == len(srv.engine.started)


def test_duplicate_in_flight_request_id_409(make_server):
    srv = make_server(LONG, slots=2)
    t = threading.Thread(target=lambda: httpx.post(srv.url + "/v1/completions", json=_body(max_tokens=30),
                                                   headers={"X-Request-Id": "dup"}, timeout=30))
    t.start()
    wait_until(lambda: srv.state.slots.busy == 1, 15, "srv.state.slots.busy == 1")
    resp = httpx.post(srv.url + "/v1/completions", json=_body(), headers={"X-Request-Id": "dup"})
    _assert_openai_error(resp, 409, "conflict_error")
    t.join(30)
    srv.wait_idle()


def test_cancel_while_the_engine_injects_kv(make_server):
    """The cancel comes while engine.start() injects the KV (held until the server has taken
    the cancel); the request ends 499 without a single step and the session is closed."""
    srv = make_server(FakeEngineConfig(script=[], filler_token=5, hold_start=True), slots=1)
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        srv.url + "/v1/completions", json=_body(stream=True), headers={"X-Request-Id": "inj"}, timeout=30)))
    t.start()
    assert srv.engine.in_start.wait(15), "the engine never started injecting"
    cancel = threading.Thread(target=lambda: result.setdefault("cancel", httpx.post(
        srv.url + CANCEL_PATH, json={"request_id": "inj"}, timeout=30)))
    cancel.start()
    wait_until(lambda: (job := srv.state.slots.job_of_request("inj")) is not None
               and job.abort_reason == "cancelled", 15, "the injecting job cancelled")
    srv.engine.release_start.set()  # start() returns into a cancelled request
    cancel.join(15)
    t.join(15)
    assert result["cancel"].json()["cancelled"] is True
    assert result["r"].status_code == 499
    srv.wait_idle(10.0)  # the slot comes back once start() returned and the session closed
    assert srv.engine.steps == 0 and srv.engine.closed == 1


def test_unexpected_receiver_error_is_an_openai_error(make_server, monkeypatch):
    srv = make_server()

    async def broken(handoff_id: str, timeout: float, with_result: bool = False):
        raise RuntimeError("receive buffer exploded")

    monkeypatch.setattr(srv.receiver, "wait_for", broken)
    err = _assert_openai_error(httpx.post(srv.url + "/v1/completions", json=_body()), 500, "engine_error")
    assert "receive buffer exploded" in err["message"]
    srv.wait_idle()
