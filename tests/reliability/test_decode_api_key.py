"""Finding 8 of issue 12: the decode server's HTTP API (generation, cancel, capabilities,
models) requires the optional API key; /health, /ready and /metrics stay open; a non-loopback
--host without a key does not start; the router sends the key on every call it makes."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from decode_server.server.auth import RequireApiKey
from decode_server.settings import SettingsError, load_settings
from pd_router.settings import validate_settings
from pd_wire.decode import CANCEL_PATH, CAPABILITIES_PATH
from tests.decode_server.helpers import handoff
from tests.fakes.fake_backends import FakeDecode, FakePrefill, ServerThread
from tests.procs import free_port
from tests.router.conftest import raw_completion
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(60)

KEY = "k3y-" + "0123456789abcdef" * 2


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_api_route_needs_the_key_and_the_probes_stay_open(make_server):
    srv = make_server(api_key=KEY, slots=1)
    protected = [("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "kv_transfer_params": handoff(5)}),
                 ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                   "kv_transfer_params": handoff(5)}),
                 ("POST", CANCEL_PATH, {"request_id": "someone-elses"}),
                 ("GET", CAPABILITIES_PATH, None), ("GET", "/v1/models", None)]
    for method, path, body in protected:
        for headers in ({}, _auth("wrong-" + KEY), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
            resp = httpx.request(method, srv.url + path, json=body, headers=headers, timeout=10)
            assert resp.status_code == 401, (path, headers, resp.status_code)
            assert resp.json()["error"]["type"] == "authentication_error"
            assert KEY not in resp.text and "wrong" not in resp.text  # echoes nothing
            assert resp.headers["www-authenticate"].startswith("Bearer")
    assert srv.receiver.release_calls == [], "an unauthenticated cancel reached the receiver"
    for path in ("/health", "/ready", "/metrics"):
        resp = httpx.get(srv.url + path, timeout=10)
        assert resp.status_code == 200, path
        assert KEY not in resp.text
    assert httpx.get(srv.url + CAPABILITIES_PATH, headers=_auth(KEY), timeout=10).status_code == 200
    kv = handoff(5)
    srv.receiver.arrive(kv["handoff_id"])
    resp = httpx.post(srv.url + "/v1/completions", headers=_auth(KEY), timeout=10,
                      json={"prompt": "x", "max_tokens": 2, "kv_transfer_params": kv})
    assert resp.status_code == 200, resp.text
    resp = httpx.post(srv.url + CANCEL_PATH, headers=_auth(KEY), json={"request_id": "r", "handoff_id": "h"})
    assert resp.status_code == 200 and "h" in srv.receiver.release_calls
    srv.wait_idle()


def _settings(model_dir, *argv: str, env: dict[str, str] | None = None):
    return load_settings(["--engine", "reference", "--model", str(model_dir), *argv], env=env or {})


def test_exposed_host_without_a_key_is_a_start_up_error(model_dir, tmp_path, monkeypatch):
    with pytest.raises(SettingsError) as err:
        _settings(model_dir, "--host", "0.0.0.0")
    assert "--api-key-file" in str(err.value) and "--host 0.0.0.0" in str(err.value)
    for loopback in ("127.0.0.1", "localhost", "::1"):
        assert _settings(model_dir, "--host", loopback).api_key() is None
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    assert _settings(model_dir, "--host", "0.0.0.0", "--api-key-file", str(key_file)).api_key() == KEY
    monkeypatch.setenv("MY_DECODE_KEY", KEY)
    assert _settings(model_dir, "--host", "10.1.2.3", env={"PD_DECODE_API_KEY_ENV": "MY_DECODE_KEY"}).api_key() == KEY
    short = tmp_path / "short"
    short.write_text("hunter2")
    with pytest.raises(SettingsError) as err:
        _settings(model_dir, "--api-key-file", str(short))
    assert "at least 16" in str(err.value) and "hunter2" not in str(err.value)
    with pytest.raises(SettingsError, match="is not set"):
        _settings(model_dir, env={"PD_DECODE_API_KEY_ENV": "NO_SUCH_VARIABLE_12"})


def test_router_sends_the_decode_key_on_every_call(tmp_path):
    """A real router in front of a fake prefill and a fake decode server behind the decode
    server's own key check: probes, the generation and the cancel all get through."""
    key_file = tmp_path / "decode.key"
    key_file.write_text(KEY)
    decode_fake = FakeDecode(model="tiny", tokens=3, hold=True)
    decode = ServerThread(RequireApiKey(decode_fake, KEY), free_port()).start()
    prefill = ServerThread(FakePrefill(model="tiny"), free_port()).start()
    from pd_router import create_app

    port = free_port()
    settings = validate_settings({"prefill": (prefill.url,), "decode": (decode.url,), "port": port,
                                  "probe_interval": 0.2, "log_level": "warning",
                                  "decode_api_key_file": str(key_file)})
    app = create_app(settings)
    router = ServerThread(app, port, loop="uvloop").start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(url + "/ready", timeout=5).status_code == 200, 10.0,
                   "router ready (probes authorized)")
        assert KEY not in httpx.get(url + "/ready", timeout=5).text
        # a request held by the fake, then dropped by its client: the router must cancel it
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(raw_completion("gone"))
            wait_until(lambda: "gone" in _records(decode)["active"], 10.0, "the decode request arrived")
        wait_until(lambda: "gone" in _records(decode)["cancels"], 10.0, "the cancel arrived with the key")
        httpx.post(decode.url + "/fake/config", headers=_auth(KEY), json={"hold": False}, timeout=5)
        resp = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=10)
        assert resp.status_code == 200, resp.text
        assert not _records(decode)["errors"]
    finally:
        for s in (router, decode, prefill):
            s.server.should_exit = True
        for s in (router, decode, prefill):
            s.stop()


def _records(server: ServerThread) -> dict:
    return json.loads(httpx.get(server.url + "/fake/records", headers=_auth(KEY), timeout=5).content)

