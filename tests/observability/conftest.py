"""Fixtures of the observability tests: an in-process OTLP collector, and the rig of the
router tests (a real router on loopback in front of fake prefill servers) with, behind it,
the real decode server (fake engine and receiver) instead of a fake one."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvicorn

from pd_http.tracing import Tracing
from tests.decode_server.conftest import RunningServer, build_model_dir, start_server
from tests.fakes.fake_engine import FakeEngineConfig
from tests.fakes.otlp_collector import OtlpCollector
from tests.router.conftest import Rig, rig_factory

MODEL = "fake-model"  # the decode server's served model name (tests.decode_server.conftest)
__all__ = ["MODEL", "Rig", "RunningServer"]


@pytest.fixture
def collector() -> Iterator[OtlpCollector]:
    c = OtlpCollector().start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("decode_model") / MODEL)


@pytest.fixture
def make_decode(model_dir: Path) -> Iterator[Callable[..., RunningServer]]:
    """``make(tracing=...)``: a real decode server (fake engine, KV arriving at once)."""
    running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def make(tracing: Tracing | None = None, script: tuple[int, ...] = (8, 9, 10), slots: int = 2) -> RunningServer:
        srv, server, thread = start_server(model_dir, FakeEngineConfig(script=list(script)), tracing=tracing,
                                           slots=slots)
        running.append((server, thread))
        return srv

    yield make
    for server, thread in running:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Rig]]:
    with rig_factory() as make:
        yield make
