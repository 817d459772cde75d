"""Every count or size a client gives is bounded before work proportional to it (issue 58):
the router process, under a 1 GiB address-space limit, in front of the fakes, gets every
field of chat, completions and responses set to wrong types and extreme values
(:mod:`tests.odd_values`), and each count far past its bound. Each request is answered (a
4xx in OpenAI's shape, or a 200) within seconds; the router is alive afterwards, its
resident set back near where it started, and nothing is left held (decode slots, queue,
requests in flight, at the router and at the fakes)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pd_deploy.commands import RouterSpec, router_argv
from pd_wire.errors import ErrorBody
from tests.fakes.fake_backends import FakeDecode, FakePrefill, ServerThread
from tests.odd_values import bodies, encode, huge_counts, problem
from tests.procs import REPO, free_port
from tests.router.conftest import MODEL
from tests.waits import wait_until

pytestmark = [pytest.mark.timeout(600), pytest.mark.integration]  # integration: the router as a process

ADDRESS_SPACE = 1 << 30  # the router's RLIMIT_AS: it starts in ~250 MiB
ANSWER_WITHIN_S = 5.0  # each request's answer, whole (the router answers a bound's 400 in milliseconds)
RSS_SLACK_MB = 64  # the router's resident set after all of it, over its size after the warm-up
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}
BASES: dict[str, dict[str, Any]] = {
    "chat": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "responses": {"model": MODEL, "input": "hi", "max_output_tokens": 2},
}


@dataclass
class RouterProcess:
    url: str
    proc: subprocess.Popen[bytes]
    prefill: ServerThread
    decode: ServerThread

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError(f"no VmRSS for pid {self.proc.pid}")

    def gauges(self) -> dict[str, float]:
        """The router's gauges of what it holds, from its /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            for name in ("pd_router_in_flight_requests", "pd_router_queue_depth", "pd_router_decode_free_slots"):
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    prefill = ServerThread(FakePrefill(model=MODEL), free_port()).start()
    decode = ServerThread(FakeDecode(model=MODEL, slots=16), free_port()).start()
    port = free_port()
    log = (tmp_path_factory.mktemp("bounds") / "router.log").open("wb")
    argv = router_argv(RouterSpec((prefill.url,), (decode.url,), port=port,
                                  extra_args=("--log-level", "warning", "--probe-interval", "0.5")))
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_limit_address_space,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    rig = RouterProcess(f"http://127.0.0.1:{port}", proc, prefill, decode)
    try:
        wait_until(lambda: _ready(rig.url) or proc.poll() is not None, 60, "router process ready")
        assert proc.poll() is None, "the router did not start under the address-space limit"
        yield rig
    finally:
        proc.kill()
        proc.wait(10)
        log.close()
        for s in (prefill, decode):
            s.server.should_exit = True
        for s in (prefill, decode):
            s.stop()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _send(client: httpx.Client, url: str, what: str, body: dict[str, Any]) -> tuple[str, int, float, bytes]:
    t0 = time.monotonic()
    try:
        resp = client.post(url, content=encode(body), headers={"content-type": "application/json"},
                           timeout=ANSWER_WITHIN_S * 4)
    except httpx.HTTPError as exc:
        return what, -1, time.monotonic() - t0, repr(exc).encode()
    return what, resp.status_code, time.monotonic() - t0, resp.content


def _run(router: RouterProcess, cases: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """Each case sent (4 at a time); the problems found."""
    problems = []
    with httpx.Client() as client, ThreadPoolExecutor(4) as pool:
        answers = pool.map(lambda c: _send(client, router.url + PATHS[c[0]], f"{c[0]} {c[1]}", c[2]), cases)
        for what, status, took, content in answers:
            wrong = problem(what, status, content)
            if wrong is not None:
                problems.append(wrong)
            if took > ANSWER_WITHIN_S:
                problems.append(f"{what}: answered after {took:.1f} s")
            if router.proc.poll() is not None:
                problems.append(f"{what}: the router died (exit {router.proc.returncode})")
                break
    return problems


def _assert_nothing_held(router: RouterProcess) -> None:
    def idle() -> bool:
        g = router.gauges()
        return (g.get("pd_router_in_flight_requests") == 0 and g.get("pd_router_queue_depth") == 0
                and g.get("pd_router_decode_free_slots") == 16)

    wait_until(idle, 10, f"the router holding nothing: {router.gauges()}")
    for fake in (router.prefill, router.decode):
        records = httpx.get(fake.url + "/fake/records", timeout=5).json()
        assert not records["active"], (fake.url, records["active"])


def _warm_up(router: RouterProcess) -> float:
    """A few of every kind of valid request (the router's lazy imports and caches); its RSS then."""
    with httpx.Client() as client:
        for _ in range(5):
            for endpoint, base in BASES.items():
                for stream in (False, True):
                    resp = client.post(router.url + PATHS[endpoint], json={**base, "stream": stream}, timeout=20)
                    assert resp.status_code == 200, resp.text
    return router.rss_mb()


@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
def test_every_field_with_odd_values_is_answered_4xx_or_200(router, endpoint):
    start = _warm_up(router)
    cases = [(endpoint, what, body) for what, body in bodies(endpoint, BASES[endpoint])]
    problems = _run(router, cases)
    assert not problems, f"{len(problems)} of {len(cases)}:\n" + "\n".join(problems[:40])
    _assert_nothing_held(router)
    assert router.rss_mb() < start + RSS_SLACK_MB, (start, router.rss_mb())


@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
def test_every_count_far_past_its_bound_is_a_400_naming_the_field(router, endpoint):
    start = _warm_up(router)
    cases = [(endpoint, what, body) for what, body in huge_counts(endpoint, BASES[endpoint])]
    problems = _run(router, cases)
    assert not problems, "\n".join(problems)
    with httpx.Client() as client:
        for what, body in huge_counts(endpoint, BASES[endpoint]):
            _, status, _, content = _send(client, router.url + PATHS[endpoint], what, body)
            assert status == 400, (what, status, content[:300])
            error = ErrorBody.model_validate_json(content).error
            assert error.param, (what, error)
    _assert_nothing_held(router)
    assert router.proc.poll() is None
    assert router.rss_mb() < start + RSS_SLACK_MB, (start, router.rss_mb())


def test_a_huge_n_is_refused_at_once_and_the_router_serves_on(router):
    """The issue's case: ``n`` 2**64 was never answered and grew the router until the kernel killed it."""
    body = {**BASES["chat"], "n": 2**64}
    t0 = time.monotonic()
    resp = httpx.post(router.url + PATHS["chat"], content=json.dumps(body), timeout=ANSWER_WITHIN_S * 4,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert time.monotonic() - t0 < ANSWER_WITHIN_S
    error = resp.json()["error"]
    assert error["param"] == "n" and "at most 64" in error["message"], error
    assert httpx.post(router.url + PATHS["chat"], json=BASES["chat"], timeout=20).status_code == 200
