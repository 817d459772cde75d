"""Readiness follows backend health and compatibility; requests fail fast while down."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest

from pd_router.answers import ReadinessReport
from pd_wire.handoff import PROTOCOL_VERSION
from tests.fakes.fake_backends import FakeDecode, FakePrefill, ServerThread
from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
PROBE = 0.2


def _wait_status(rig, status: int) -> float:
    t0 = time.monotonic()
    rig.wait(lambda: rig.ready_status() == status, 3 * PROBE + 1.0, f"/ready {status}")
    return time.monotonic() - t0


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_backend_down_and_back(make_rig, role):
    rig = make_rig(probe_interval=PROBE)
    servers = rig.decodes if role == "decode" else rig.prefills
    port = servers[0].port
    servers.pop().stop()
    took = _wait_status(rig, 503)
    assert took <= PROBE + 1.0, took  # the probe interval, plus scheduling slack on a loaded machine
    report = ReadinessReport.model_validate(httpx.get(rig.url + "/ready").json())
    assert report.ready is False
    down = [b for b in getattr(report, role) if not b.healthy]
    assert down and "unreachable" in (down[0].reason or "") and down[0].url.endswith(f":{port}")
    assert any(down[0].url in p for p in report.problems)
    t0 = time.monotonic()
    resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=5)
    assert resp.status_code == 503 and time.monotonic() - t0 < 1.0
    assert resp.json()["error"]["type"] == "no_healthy_backend"
    app = FakeDecode(model=MODEL) if role == "decode" else FakePrefill(model=MODEL)
    servers.append(ServerThread(app, port).start())
    _wait_status(rig, 200)
    assert httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=5).status_code == 200
    rig.assert_no_leaks()


def test_queued_requests_fail_with_503_when_decode_goes_down(make_rig):
    rig = make_rig(probe_interval=PROBE, decode={"hold": True}, queue_timeout=30)
    results: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=20).status_code
            )
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    rig.wait(lambda: rig.state.pool.queue_depth == 2, what="two queued")
    rig.config(rig.decodes[0], ready=False)
    rig.wait(lambda: sorted(results) == [503, 503], 3, "queued requests answered 503")
    httpx.post(rig.decodes[0].url + "/fake/release", json={"n": 1})
    for t in threads:
        t.join(10)
    assert sorted(results) == [200, 503, 503]
    rig.assert_no_leaks()


@pytest.mark.parametrize(
    "decode,needle",
    [
        (
            {
                "peers": [
                    {
                        "peer": "prefill-a",
                        "state": "rejected",
                        "reason": "layout fingerprint tiny-mla-3L-x != y",
                    }
                ]
            },
            "prefill-a: layout fingerprint tiny-mla-3L-x != y",
        ),
        ({"peers": []}, "no prefill connector has completed the KV handshake"),
        ({"protocol_version": 99}, "protocol_version 99"),
        ({"model": "other-model"}, "serves ['other-model']"),
        ({"ready": False}, "/ready answered 503"),
    ],
)
def test_incompatible_decode_is_not_ready(make_rig, decode, needle):
    rig = make_rig(decode=decode, wait_ready=False, probe_interval=PROBE)
    _wait_status(rig, 503)
    body = httpx.get(rig.url + "/ready").json()
    reason = body["decode"][0]["reason"]
    assert needle in reason, body
    assert any(needle in p and rig.decodes[0].url in p for p in body["problems"]), body
    rig.config(
        rig.decodes[0],
        peers=[{"peer": "prefill-a", "state": "ok"}],
        protocol_version=PROTOCOL_VERSION,
        model=MODEL,
        ready=True,
    )
    _wait_status(rig, 200)
    rig.assert_no_leaks()


def test_handshake_not_required(make_rig):
    rig = make_rig(decode={"peers": []}, require_handshake=False)
    assert rig.ready_status() == 200
    assert httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=5).status_code == 200
    rig.assert_no_leaks()


def test_health_is_liveness_only(make_rig):
    rig = make_rig(wait_ready=False, probe_interval=PROBE)
    rig.decodes.pop().stop()
    _wait_status(rig, 503)
    assert httpx.get(rig.url + "/health").json() == {"status": "ok"}
    metrics = httpx.get(rig.url + "/metrics").text
    assert (
        f'pd_router_backend_healthy{{backend="{rig.state.backends.decode[0].url}",role="decode"}} 0.0'
        in metrics
    )


def test_rejection_is_reported_even_without_a_healthy_prefill(make_rig):
    reason = "layout fingerprint mismatch: 2 layers vs 3"
    rig = make_rig(
        decode={"peers": [{"peer": "p", "state": "rejected", "reason": reason}]},
        wait_ready=False,
        probe_interval=PROBE,
    )
    rig.prefills.pop().stop()
    rig.wait(lambda: not rig.state.backends.prefill[0].healthy, 3, "prefill down")
    body = httpx.get(rig.url + "/ready").json()
    assert any(reason in p and rig.decodes[0].url in p for p in body["problems"]), body


def _health_log(rig, after: list[str]) -> None:
    """Wait until the prefill fake's /health log, from its start, ends with ``after``."""
    rig.wait(lambda: rig.records(rig.prefills[0])["health"][-len(after):] == after, 10, f"/health: ... {after}")


def test_one_probe_without_an_answer_does_not_mark_a_backend_down(make_rig, caplog):
    """A starved machine answers one probe late: the backend stays healthy (every client is
    still served); only ``--probe-misses`` probes in a row without an answer mark it down,
    and the first answer after them brings it back."""
    rig = make_rig(probe_interval=PROBE)  # probe timeout 0.5 s; --probe-misses 2
    prefill = rig.prefills[0]
    with caplog.at_level(logging.INFO, logger="pd_router.probes"):
        rig.config(prefill, hold_health=1)
        _health_log(rig, ["held", "answered"])  # probes are sequential: the miss was taken
        assert httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=5).status_code == 200
        assert [r.getMessage() for r in caplog.records if "unhealthy" in r.getMessage()] == []
        assert any("probe timed out (1 of 2" in r.getMessage() for r in caplog.records), caplog.text

        rig.config(prefill, hold_health=2)
        _health_log(rig, ["held", "held", "answered"])
        down = [r.getMessage() for r in caplog.records if "unhealthy" in r.getMessage()]
        assert len(down) == 1 and "2 probe(s) in a row timed out" in down[0], caplog.text
        _wait_status(rig, 200)
    assert httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=5).status_code == 200
    rig.assert_no_leaks()


async def test_a_kept_alive_connection_closed_as_the_probe_reuses_it_marks_nothing_down():
    """A server closing an idle kept-alive connection just as a probe sends on it (its idle
    timeout, met when probes come late on a starved machine): the probe asks again on a new
    connection; a server that drops every request is still marked down."""
    import asyncio as aio

    from pd_router.fleet.backends import Backends
    from pd_router.fleet.probes import Prober

    answered = {"n": 0}

    async def serve(reader: aio.StreamReader, writer: aio.StreamWriter, drop_all: bool) -> None:
        served_here = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if drop_all or served_here == 1:  # the second request on a connection: closed unanswered
                writer.close()
                return
            path = head.split(b" ", 2)[1]
            body = b'{"data": [{"id": "m"}]}' if path == b"/v1/models" else b"{}"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
            served_here += 1
            answered["n"] += 1

    servers = [await aio.start_server(lambda r, w, d=d: serve(r, w, d), "127.0.0.1", 0) for d in (False, True)]
    urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
    backends = Backends.from_urls(tuple(urls), (), None, True)
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        prober = Prober(backends, client, 1.0, lambda: None)
        for _ in range(3):  # each probe: /health, then /v1/models on the same kept-alive connection
            await prober.probe_all()
    flaky, dead = backends.prefill
    assert flaky.healthy and flaky.models == frozenset({"m"}), flaky.reason
    assert answered["n"] == 6
    assert not dead.healthy and "RemoteProtocolError" in dead.reason, dead.reason
    for s in servers:
        s.close()
