"""Fixtures of the reliability tests: the router rig (a real router on a loopback socket in
front of fake prefill/decode servers), the decode-server test model directory and, for the
KV channel, the transport testbed (in-memory fake or real NIXL on loopback)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.connector.transport.helpers import KVTestbed
from tests.decode_server.conftest import build_model_dir
from tests.router.conftest import make_rig  # noqa: F401  (fixture)

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("decode_model") / "fake-model")


@pytest.fixture
def kv() -> KVTestbed:
    return KVTestbed()


@pytest.fixture
def make_server(model_dir: Path) -> Iterator:
    from tests.decode_server.conftest import start_server
    from tests.fakes.fake_engine import FakeEngineConfig

    running = []

    def make(engine_cfg: FakeEngineConfig | None = None, **kw):
        srv, server, thread = start_server(model_dir, engine_cfg or FakeEngineConfig(), **kw)
        running.append((server, thread))
        return srv

    yield make
    for server, thread in running:
        server.should_exit = True
        thread.join(10)
