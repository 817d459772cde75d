"""/admin/backends: the API key guards it (403 on a non-loopback bind without one), bad
input is an OpenAI-shaped 400, and a removed decode server drains: no new requests, the
request in flight on it completes 200, then it is dropped; added again, it comes back."""

from __future__ import annotations

import threading

import httpx

from pd_router import create_app
from pd_router.answers import BackendEntry, BackendList
from pd_router.settings import validate_settings
from pd_wire.errors import ErrorBody
from tests.fakes.fake_backends import FakeDecode, FakePrefill, ServerThread
from tests.procs import free_port
from tests.router.conftest import MODEL

KEY = "admin-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


def admin(rig, method: str, body: object = None, headers: dict[str, str] | None = AUTH) -> httpx.Response:
    return httpx.request(method, rig.url + "/admin/backends", json=body, headers=headers, timeout=10)


def error_type(resp: httpx.Response) -> str:
    return ErrorBody.model_validate_json(resp.content).error.type


def complete(rig, rid: str, results: dict[str, int] | None = None) -> httpx.Response:
    resp = httpx.post(rig.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3},
                      headers={**AUTH, "X-Request-Id": rid}, timeout=20)
    if results is not None:
        results[rid] = resp.status_code
    return resp


def new_decode(rig, **knobs: object) -> ServerThread:
    server = ServerThread(FakeDecode(model=MODEL, **knobs), free_port()).start()
    rig.extra.append(server)
    return server


def test_admin_api_needs_the_key_and_answers_bad_input_with_400(make_rig) -> None:
    rig = make_rig(api_key=KEY)
    for headers in (None, {"Authorization": "Bearer wrong"}):
        for method, body in (("GET", None), ("POST", {"role": "nope"}), ("DELETE", {"role": "decode", "url": "x"})):
            resp = admin(rig, method, body, headers)
            assert resp.status_code == 401 and error_type(resp) == "authentication_error", resp.text
    listed = BackendList.model_validate_json(admin(rig, "GET").content)
    assert [(e.role, e.url, e.sources, e.state) for e in listed.backends] == [
        ("prefill", rig.prefills[0].url, ["static"], "ready"), ("decode", rig.decodes[0].url, ["static"], "ready")]
    for body in ({"role": "router", "url": "http://h:1"}, {"role": "decode", "url": "h:1"},
                 {"role": "decode", "url": "http://h:1?x=1"}, {"role": "decode"},
                 {"role": "decode", "url": "http://h:1", "extra": 1}, [1]):
        resp = admin(rig, "POST", body)
        assert resp.status_code == 400 and error_type(resp) == "invalid_request_error", (body, resp.text)
    resp = httpx.post(rig.url + "/admin/backends", content=b"{not json", headers=AUTH, timeout=5)
    assert resp.status_code == 400 and error_type(resp) == "invalid_request_error"
    resp = admin(rig, "DELETE", {"role": "decode", "url": rig.decodes[0].url})
    assert resp.status_code == 409 and error_type(resp) == "conflict_error" and "static" in resp.text
    resp = admin(rig, "DELETE", {"role": "decode", "url": "http://127.0.0.1:1"})
    assert resp.status_code == 404 and error_type(resp) == "not_found_error"
    assert rig.ready_status() == 200


async def test_admin_api_is_off_without_a_key_on_a_non_loopback_bind() -> None:
    settings = validate_settings({"prefill": ["http://127.0.0.1:1"], "decode": ["http://127.0.0.1:2"],
                                  "host": "0.0.0.0"})
    app = create_app(settings)  # not served: no socket bound; the route answers before anything else
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        resp = await client.get("/admin/backends")
        assert resp.status_code == 403 and error_type(resp) == "permission_error" and "--api-key" in resp.text
        resp = await client.post("/admin/backends", json={"role": "decode", "url": "http://127.0.0.1:3"})
        assert resp.status_code == 403
    assert [d.url for d in app.state.backends.decode] == ["http://127.0.0.1:2"]


def test_added_decode_server_takes_requests_and_removed_one_drains(make_rig) -> None:
    rig = make_rig(n_decode=0, wait_ready=False, api_key=KEY, discovery_interval=0.2)
    held = new_decode(rig, hold=True)
    resp = admin(rig, "POST", {"role": "decode", "url": held.url})
    assert resp.status_code == 201, resp.text
    assert BackendEntry.model_validate_json(resp.content).sources == ["admin"]
    assert admin(rig, "POST", {"role": "decode", "url": held.url}).status_code == 200  # had it already
    rig.wait(lambda: rig.ready_status() == 200, 5, "the added decode server ready")

    results: dict[str, int] = {}
    in_flight = threading.Thread(target=complete, args=(rig, "on-held", results))
    in_flight.start()
    backend = rig.state.backends.find("decode", held.url)
    rig.wait(lambda: backend.in_use == 1 and rig.records(held)["active"], 5, "the request held in decode")

    resp = admin(rig, "DELETE", {"role": "decode", "url": held.url})
    entry = BackendEntry.model_validate_json(resp.content)
    assert resp.status_code == 202 and (entry.state, entry.in_flight) == ("draining", 1)
    # no new request on it: with no other decode server, a new request is refused at once
    refused = complete(rig, "while-draining")
    assert refused.status_code == 503 and error_type(refused) == "no_healthy_backend"
    assert rig.state.backends.find("decode", held.url) is backend  # still there: draining

    other = new_decode(rig)
    assert admin(rig, "POST", {"role": "decode", "url": other.url}).status_code == 201
    rig.wait(lambda: rig.state.backends.decode_available(MODEL), 5, "the second decode server usable")
    assert complete(rig, "on-other").status_code == 200

    httpx.post(held.url + "/fake/release", json={"n": 1}, timeout=5)
    in_flight.join(20)
    assert results == {"on-held": 200}
    rig.wait(lambda: rig.state.backends.find("decode", held.url) is None, 5, "the drained server dropped")
    assert [r["request_id"] for r in rig.records(held)["requests"]] == ["on-held"]
    metrics = httpx.get(rig.url + "/metrics", timeout=5).text
    assert 'pd_router_backends{role="decode",state="ready"} 1.0' in metrics
    assert f'pd_router_decode_free_slots{{backend="{held.url}"}}' not in metrics

    # added again: it comes back and takes requests (the other one removed: nothing in flight, gone at once)
    assert admin(rig, "DELETE", {"role": "decode", "url": other.url}).content == b"null"
    rig.config(held, hold=False)
    assert admin(rig, "POST", {"role": "decode", "url": held.url}).status_code == 201
    rig.wait(lambda: (b := rig.state.backends.find("decode", held.url)) is not None and b.accepting, 5,
             "the re-added server usable")
    assert complete(rig, "again").status_code == 200
    assert [r["request_id"] for r in rig.records(held)["requests"]] == ["on-held", "again"]
    rig.assert_no_leaks()


def test_removed_prefill_server_drains(make_rig) -> None:
    role = "prefill"
    rig = make_rig(n_prefill=0, wait_ready=False, api_key=KEY)
    slow = ServerThread(FakePrefill(model=MODEL, delay=1.0), free_port()).start()
    rig.extra.append(slow)
    assert admin(rig, "POST", {"role": role, "url": slow.url}).status_code == 201
    rig.wait(lambda: rig.ready_status() == 200, 5, "router ready")
    results: dict[str, int] = {}
    t = threading.Thread(target=complete, args=(rig, "slow-prefill", results))
    t.start()
    p = rig.state.backends.find("prefill", slow.url)
    rig.wait(lambda: p.in_flight == 1, 5, "the prefill in flight")
    assert admin(rig, "DELETE", {"role": role, "url": slow.url}).status_code == 202
    assert rig.state.backends.pick_prefill(MODEL) is None
    t.join(20)
    assert results == {"slow-prefill": 200}
    rig.wait(lambda: rig.state.backends.find("prefill", slow.url) is None, 5, "the drained prefill server dropped")
