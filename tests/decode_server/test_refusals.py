"""Every way a request ends gives its KV receive slot and its decode slot back before the
answer leaves the server (issue 17): prefill pushed the KV before this server saw the
request, so a refusal that kept it would block the receive slot until the unclaimed-
handoff reaper. Checked right after the answer, without waiting: the server runs in
another thread, so whatever is still held then was held when the answer was sent."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import httpx
import pytest

from pd_wire.decode import CANCEL_PATH
from tests.decode_server.helpers import handoff, sse_events
from tests.fakes.fake_engine import FakeEngineConfig
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(60)

LONG = FakeEngineConfig(script=[], filler_token=5, step_delay=0.05)


def _pushed(srv) -> dict[str, Any]:
    """kv_transfer_params of a handoff whose KV already sits in a receive slot."""
    kv = handoff(5)
    srv.receiver.arrive(kv["handoff_id"])
    return kv


def _assert_all_free(srv) -> None:
    assert srv.receiver.held() == set(), f"KV receive slot still held: {srv.receiver.held()}"
    assert srv.state.slots.busy == 0, "decode slot still busy"


def _next_request_served(srv) -> None:
    kv = _pushed(srv)
    resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "kv_transfer_params": kv})
    assert resp.status_code == 200, resp.text
    srv.wait_idle()



REFUSED_BODIES = {
    "unsupported_field_400": (lambda kv: {"prompt": "x", "max_tokens": 4, "kv_transfer_params": kv,
                                          "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "p", "schema": {}}}}, 400),
    "invalid_value_400": (lambda kv: {"prompt": "x", "temperature": "hot", "kv_transfer_params": kv}, 400),
    "invalid_kv_params_400": (lambda kv: {"prompt": "x", "kv_transfer_params": {**kv, "first_token_id": -1}}, 400),
    "too_long_400": (lambda kv: {"prompt": "x", "max_tokens": 5000, "kv_transfer_params": kv}, 400),
    "handoff_failed_502": (lambda kv: {"prompt": "x", "kv_transfer_params": {**kv, "status": "failed",
                                                                             "error": "transfer"}}, 502),
}


@pytest.mark.parametrize("case", sorted(REFUSED_BODIES))
def test_refused_request_gives_its_kv_back_before_answering(make_server, case):
    srv = make_server(slots=1)
    build, status = REFUSED_BODIES[case]
    resp = httpx.post(srv.url + "/v1/completions", json=build(_pushed(srv)))
    assert resp.status_code == status, resp.text
    _assert_all_free(srv)
    _next_request_served(srv)


def test_engine_error_at_start_gives_everything_back_before_answering(make_server):
    srv = make_server(FakeEngineConfig(fail_start="bad KV", close_delay=0.3), slots=1)
    resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": _pushed(srv)})
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "engine_error", resp.text
    _assert_all_free(srv)
    srv.engine.config.fail_start = None
    _next_request_served(srv)


@pytest.mark.parametrize("stream", [True, False])
def test_engine_error_mid_decode_gives_everything_back_before_the_last_byte(make_server, stream):
    srv = make_server(FakeEngineConfig(script=[], filler_token=5, fail_at_step=3, close_delay=0.3), slots=1)
    resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": stream,
                                                        "kv_transfer_params": _pushed(srv)})
    if stream:
        assert resp.status_code == 200 and sse_events(resp)[-2]["error"]["type"] == "engine_error"
    else:
        assert resp.status_code == 500, resp.text
    _assert_all_free(srv)
    srv.engine.config.fail_at_step = None
    _next_request_served(srv)


def test_busy_429_gives_the_kv_back_like_every_refusal(make_server):
    """No slot free: 429, and the KV goes back at once (no router retries with it: a router's
    decode request holds its slot before the prefill)."""
    srv = make_server(LONG, slots=1)
    holder = threading.Thread(target=lambda: httpx.post(
        srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 30, "kv_transfer_params": _pushed(srv)},
        headers={"X-Request-Id": "holder"}, timeout=30))
    holder.start()
    wait_until(lambda: srv.state.slots.busy == 1, 15, "srv.state.slots.busy == 1")
    kv = _pushed(srv)
    resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": kv},
                      headers={"X-Request-Id": "second"})
    assert resp.status_code == 429 and "decode slots are busy" in resp.json()["error"]["message"], resp.text
    assert kv["handoff_id"] not in srv.receiver.held(), "a 429 must give the KV back before answering"
    httpx.post(srv.url + CANCEL_PATH, json={"request_id": "holder"})
    holder.join(30)
    srv.wait_idle()


def test_cancel_without_a_generation_frees_the_unclaimed_handoff(make_server):
    srv = make_server(slots=1)
    kv = _pushed(srv)
    answer = httpx.post(srv.url + CANCEL_PATH, json={"request_id": kv["handoff_id"]}).json()
    assert answer == {"request_id": kv["handoff_id"], "cancelled": False}
    _assert_all_free(srv)
    # never-arrived handoffs are released too (the real receiver then refuses their Admit)
    httpx.post(srv.url + CANCEL_PATH, json={"request_id": "r", "handoff_id": "not-yet-admitted"})
    assert "not-yet-admitted" in srv.receiver.release_calls
    _next_request_served(srv)


def test_cancel_answers_once_the_slot_and_kv_are_free(make_server):
    """The router frees its slot when the cancel answers: the decode slot must be free then."""
    srv = make_server(FakeEngineConfig(script=[], filler_token=5, step_delay=0.05, close_delay=0.3), slots=1)
    result: dict[str, httpx.Response] = {}
    body = {"prompt": "x", "max_tokens": 400, "stream": True, "kv_transfer_params": _pushed(srv)}
    t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        srv.url + "/v1/completions", json=body, headers={"X-Request-Id": "victim"}, timeout=30)))
    t.start()
    wait_until(lambda: srv.engine.steps >= 3, 15, "srv.engine.steps >= 3")
    assert httpx.post(srv.url + CANCEL_PATH, json={"request_id": "victim"}).json()["cancelled"] is True
    _assert_all_free(srv)
    t.join(10)
    _next_request_served(srv)


def test_cancel_of_another_attempts_handoff_leaves_the_generation_alone(make_server):
    srv = make_server(LONG, slots=1)
    kv = _pushed(srv)
    result: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 10, "kv_transfer_params": kv},
        headers={"X-Request-Id": "same"}, timeout=30)))
    t.start()
    wait_until(lambda: srv.engine.steps >= 2, 15, "srv.engine.steps >= 2")
    answer = httpx.post(srv.url + CANCEL_PATH, json={"request_id": "same", "handoff_id": "same#1"}).json()
    assert answer["cancelled"] is False
    t.join(10)
    assert result["r"].status_code == 200, result["r"].text
    srv.wait_idle()


def test_duplicate_request_id_409_frees_its_own_kv_not_the_running_ones(make_server):
    srv = make_server(LONG, slots=2)
    running = _pushed(srv)
    t = threading.Thread(target=lambda: httpx.post(
        srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 10, "kv_transfer_params": running},
        headers={"X-Request-Id": "dup"}, timeout=30))
    t.start()
    wait_until(lambda: srv.engine.steps >= 1, 15, "srv.engine.steps >= 1")
    other = _pushed(srv)
    for kv in (other, running):  # another handoff under the same id, then the running one's own
        resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": kv},
                          headers={"X-Request-Id": "dup"})
        assert resp.status_code == 409, resp.text
    assert other["handoff_id"] not in srv.receiver.held()
    assert srv.receiver.release_calls.count(running["handoff_id"]) == 1  # only by its own generation
    t.join(30)
    srv.wait_idle()


def test_client_gone_during_decode_frees_everything(make_server):
    srv = make_server(FakeEngineConfig(script=[], filler_token=5, step_delay=0.05, close_delay=0.3), slots=1)
    body = json.dumps({"prompt": "x", "max_tokens": 400, "stream": True, "kv_transfer_params": _pushed(srv)})
    host, port = srv.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"X-Request-Id: gone\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    wait_until(lambda: srv.engine.steps >= 3, 15, "srv.engine.steps >= 3")
    sock.close()
    # what the router does when its client left: cancel, then count the slot free
    httpx.post(srv.url + CANCEL_PATH, json={"request_id": "gone"})
    _assert_all_free(srv)
    _next_request_served(srv)
