"""A router (in-process, real loopback socket) in front of fake prefill/decode servers."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from pd_router import RouterApp, create_app
from pd_router.server.serve import router_server
from pd_router.settings import validate_settings
from tests.fakes.fake_backends import FakeDecode, FakePrefill, ServerThread
from tests.procs import free_port
from tests.waits import wait_until

MODEL = "tiny"


def raw_completion(rid: str, stream: bool = True, max_tokens: int = 50) -> bytes:
    """A streaming (or not) /v1/completions request as raw HTTP/1.1 bytes, as curl sends it."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": stream}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


@dataclass
class Rig:
    router: RouterApp
    server: ServerThread
    prefills: list[ServerThread]
    decodes: list[ServerThread]
    extra: list[ServerThread] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def state(self):
        return self.router.state

    @staticmethod
    def config(backend: ServerThread, **knobs: Any) -> None:
        httpx.post(backend.url + "/fake/config", json=knobs, timeout=5).raise_for_status()

    @staticmethod
    def records(backend: ServerThread) -> dict[str, Any]:
        return httpx.get(backend.url + "/fake/records", timeout=5).json()

    def wait(self, predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
        wait_until(predicate, timeout, what)

    def ready_status(self) -> int:
        return httpx.get(self.url + "/ready", timeout=5).status_code

    def assert_no_leaks(self, timeout: float = 5.0) -> None:
        """Nothing queued, held or in flight, in the router and in every fake."""

        def clean() -> bool:
            fakes = all(not self.records(b)["active"] for b in self.prefills + self.decodes)
            return fakes and not self.state.leaks() and self.state.background_tasks() == 0  # besides the loops

        try:
            self.wait(clean, timeout, "no leaks")
        except AssertionError:
            active = {b.url: self.records(b)["active"] for b in self.prefills + self.decodes}
            raise AssertionError(
                f"leak: router {self.state.leaks()}, background tasks "
                f"{self.state.background_tasks()}, fakes active {active}"
            ) from None
        for b in self.prefills + self.decodes:
            assert not self.records(b)["errors"], self.records(b)["errors"]


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Rig]]:
    with rig_factory() as make:
        yield make


@contextmanager
def rig_factory() -> Iterator[Callable[..., Rig]]:
    """``make(...)`` builds rigs; all are stopped on exit (the ``make_rig`` fixture, or a
    wider-scoped one)."""
    rigs: list[Rig] = []

    def make(
        n_prefill: int = 1,
        n_decode: int = 1,
        prefill: dict[str, Any] | None = None,
        decode: dict[str, Any] | None = None,
        wait_ready: bool = True,
        prefill_urls: tuple[str, ...] = (),
        decode_urls: tuple[str, ...] = (),
        ready_timeout: float = 10.0,
        **settings: Any,
    ) -> Rig:
        """A router in front of ``n_prefill``/``n_decode`` new fakes plus any ``*_urls``."""
        prefills = [
            ServerThread(FakePrefill(**{"model": MODEL, **(prefill or {})}), free_port()).start()
            for _ in range(n_prefill)
        ]
        decodes = [
            ServerThread(FakeDecode(**{"model": MODEL, **(decode or {})}), free_port()).start()
            for _ in range(n_decode)
        ]
        values = {
            "prefill": tuple(p.url for p in prefills) + prefill_urls,
            "decode": tuple(d.url for d in decodes) + decode_urls,
            "port": free_port(),
            "probe_interval": 0.2,
            "log_level": "warning",
            **settings,
        }
        settings = validate_settings(values)
        app = create_app(settings)
        server = router_server(app, settings)  # the server python -m pd_router runs (limits, drain)
        rig = Rig(app, ServerThread(app, values["port"], server=server), prefills, decodes)
        rigs.append(rig)
        rig.server.start()
        if wait_ready:
            rig.wait(lambda: rig.ready_status() == 200, ready_timeout, "router /ready")
        return rig

    try:
        yield make
    finally:  # also when the body raised (a failed teardown check of a wider-scoped rig)
        servers = [s for rig in rigs for s in [rig.server, *rig.prefills, *rig.decodes, *rig.extra]]
        for s in servers:  # all at once, then wait for each
            s.server.should_exit = True
        for s in servers:
            s.stop()
