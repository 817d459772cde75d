"""Hostile and broken clients against the router (issue 12, findings 1-4, 6, 7): every
one is answered fast with a 4xx (or closed), and the others are served meanwhile."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import httpx
import pytest

from pd_router.slots.pool import Slot
from pd_wire.errors import ErrorBody
from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one answer; the connection then closes (the refusals say so)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
    return status, headers, body


def _error_type(body: bytes) -> str:
    return ErrorBody.model_validate_json(body).error.type


def test_an_endless_header_gets_431_after_the_limit_and_stalls_nobody(make_rig):
    rig = make_rig(max_header_bytes=16 * 1024)
    with closing(_connect(rig.url)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Junk: ")
        sent, refused = 0, False
        t0 = time.monotonic()
        while sent < 64 * 1024 * 1024 and not refused:  # 64 MiB unless the router stops us
            try:
                sock.sendall(b"a" * 65536)
            except (BrokenPipeError, ConnectionResetError):
                refused = True
            sent += 65536
            if sent == 256 * 1024:  # well past the limit: others are still served meanwhile
                assert httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=5).status_code == 200
        status, headers, body = _read_answer(sock)
        elapsed = time.monotonic() - t0
    assert status == 431 and headers["connection"] == "close", (status, headers)
    assert _error_type(body) == "invalid_request_error" and b"max_header_bytes" in body
    assert sent < 64 * 1024 * 1024, "the router read 64 MiB of header without refusing"
    assert elapsed < 10, elapsed
    rig.assert_no_leaks()


def test_too_many_header_lines_get_431(make_rig):
    rig = make_rig(max_headers=100, max_header_bytes=64 * 1024)
    with closing(_connect(rig.url)) as sock:
        lines = "".join(f"X-H{i}: v\r\n" for i in range(2000))
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{lines}\r\n".encode())
        status, _, body = _read_answer(sock)
    assert status == 431 and b"max_headers" in body
    # a request just under the limit passes
    headers = {f"x-h{i}": "v" for i in range(90)}
    assert httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers=headers, timeout=5).status_code == 200
    rig.assert_no_leaks()


def test_idle_and_slow_connections_are_closed(make_rig):
    rig = make_rig(header_timeout=0.5, body_timeout=0.5, keep_alive_timeout=1)
    idle, partial, trickle = (_connect(rig.url) for _ in range(3))
    with closing(idle), closing(partial), closing(trickle):
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        body = json.dumps(COMPLETION).encode()
        trickle.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:5]  # the rest never comes
        )
        assert idle.recv(1) == b""  # closed without an answer (nothing was asked)
        status, _, answer = _read_answer(partial)
        assert status == 408 and b"header_timeout" in answer
        status, _, answer = _read_answer(trickle)
        assert status == 408 and _error_type(answer) == "request_timeout" and b"--body-timeout" in answer
    rig.assert_no_leaks()


def test_connections_past_the_cap_get_503_with_retry_after(make_rig):
    rig = make_rig(max_connections=4, header_timeout=30)
    held = [_connect(rig.url) for _ in range(4)]
    try:
        # the router has the 4 (its accept loop may run after connect returns): the next is refused
        extra = _connect(rig.url)
        with closing(extra):
            status, headers, body = _read_answer(extra)
        assert status == 503 and headers["retry-after"] == "1" and b"max_connections" in body
    finally:
        for sock in held:
            sock.close()
    rig.wait(lambda: httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=5).status_code == 200,
             5, "a connection slot again")
    rig.assert_no_leaks()


def test_deeply_nested_json_is_a_400(make_rig):
    rig = make_rig()
    for depth in (2000, 100_000):
        raw = b'{"model": "tiny", "prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
        resp = httpx.post(rig.url + "/v1/completions", content=raw, timeout=10)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["type"] == "invalid_request_error"
    rig.assert_no_leaks()


def test_a_request_id_must_be_visible_ascii(make_rig):
    rig = make_rig()
    for rid in ("caf\xe9".encode("latin-1"), "caf\xe9".encode(), b"a b", b"tab\tid"):
        resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": rid}, timeout=5)
        assert resp.status_code == 400, (rid, resp.text)
        assert resp.json()["error"]["param"] == "X-Request-Id"
    assert not rig.records(rig.prefills[0])["requests"]  # refused before prefill
    rig.assert_no_leaks()


def test_the_cancel_goes_out_whatever_the_request_id(make_rig):
    """The abort path's cancel never dies on the id's encoding (it raised UnicodeEncodeError,
    which is no httpx.HTTPError, and the decode server was never told). The router refuses
    such ids at the door; this drives its abort path directly, on the router's loop."""
    rig = make_rig()
    state = rig.state

    async def abort_with_odd_id() -> None:
        slot = Slot(state.backends.decode[0], MODEL)
        state.backends.decode[0].in_use += 1  # (as the pool counts a slot it hands out)
        state.abort(slot, "caf\xe9")

    asyncio.run_coroutine_threadsafe(abort_with_odd_id(), rig.server.server.loop).result(5)
    rig.wait(lambda: rig.records(rig.decodes[0])["cancels"] == ["caf\xe9"], 5, "the cancel on the decode server")
    rig.assert_no_leaks()


def test_503_has_retry_after(make_rig):
    rig = make_rig()
    rig.config(rig.decodes[0], ready=False)
    rig.wait(lambda: rig.ready_status() == 503, 5, "decode unready")
    ready = httpx.get(rig.url + "/ready", timeout=5)
    assert ready.status_code == 503 and int(ready.headers["retry-after"]) >= 1
    resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=5)
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "no_healthy_backend"
    assert int(resp.headers["retry-after"]) >= 1
    rig.assert_no_leaks()


def test_the_api_key_is_checked_before_anything_about_the_request(make_rig):
    rig = make_rig(api_key="secret", decode={"hold": True})
    key = {"Authorization": "Bearer secret"}
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, rig.url + "/v1/completions", json={**COMPLETION, "stream": True},
                           headers={**key, "X-Request-Id": "live-1"}, timeout=10)
        rig.wait(lambda: rig.records(rig.decodes[0])["active"] == ["live-1"], 5, "the request held in decode")
        # without the key: 401, and nothing says the id is in flight
        for headers in ({"X-Request-Id": "live-1"}, {"X-Request-Id": "live-1", "Authorization": "Bearer secreT"}):
            resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, headers=headers, timeout=5)
            assert resp.status_code == 401 and "live-1" not in resp.text, resp.text
        # with it: the duplicate is named
        resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION,
                          headers={**key, "X-Request-Id": "live-1"}, timeout=5)
        assert resp.status_code == 400 and "already in flight" in resp.text
        httpx.post(rig.decodes[0].url + "/fake/release", json={"n": 1}, timeout=5)
        assert held.result(10).text.rstrip().endswith("data: [DONE]")
    rig.assert_no_leaks()
