"""The connector's decode KV endpoints from the router's sources: the servers file and DNS
names (a resolver injected). The keeper handshakes a receiver added to the file within a
round and drops one removed from it; the scheduler side allows only listed endpoints."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from connector.config import ConnectorConfigError, ConnectorSettings, load_settings
from connector.endpoints import DecodeEndpoints
from connector.keeper import HandshakeKeeper
from tests.fakes.fake_resolver import FakeResolver
from tests.waits import eventually, wait_until

pytestmark = pytest.mark.timeout(60)


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def servers(*kv: str) -> str:
    return "decode:\n" + "".join(f"  - {{url: 'http://h{i}:8200', kv_endpoint: '{e}'}}\n" for i, e in enumerate(kv))


def test_endpoints_from_file_dns_and_static(tmp_path: Path) -> None:
    path = tmp_path / "servers.yaml"
    write(path, servers("10.0.0.1:8300") + "  - http://plain:8000\n")  # a plain decode server: no KV endpoint
    resolver = FakeResolver({"decode.svc": ["10.0.1.2", "10.0.1.1"]})
    settings = ConnectorSettings(decode_endpoints=("static:1",), servers_file=str(path),
                                 decode_kv_dns=("decode.svc:8300",))
    eps = DecodeEndpoints(settings, resolver)
    assert eps.dynamic and eps.current() == ("static:1",)  # nothing read yet
    assert eps.refresh() == ("static:1", "10.0.0.1:8300", "10.0.1.1:8300", "10.0.1.2:8300")
    write(path, servers("10.0.0.9:8300"))
    resolver.names["decode.svc"] = OSError("SERVFAIL")  # a failed lookup keeps the last answer
    assert eps.refresh() == ("static:1", "10.0.0.9:8300", "10.0.1.1:8300", "10.0.1.2:8300")


def test_allowed_looks_again_for_an_endpoint_it_does_not_know(tmp_path: Path) -> None:
    path = tmp_path / "servers.yaml"
    write(path, servers("10.0.0.1:8300"))
    eps = DecodeEndpoints(ConnectorSettings(servers_file=str(path)))
    assert eps.allowed("10.0.0.1:8300")  # first miss: reads the file
    write(path, servers("10.0.0.1:8300", "10.0.0.2:8300"))  # the router routes to the new one at once
    eps._last = 0.0  # as if the last look was long ago
    assert eps.allowed("10.0.0.2:8300")
    assert not eps.allowed("127.0.0.1:9")  # loopback is not implied once sources are configured
    # without any source: loopback only (as before)
    plain = DecodeEndpoints(ConnectorSettings())
    assert not plain.dynamic and plain.allowed("127.0.0.1:9") and not plain.allowed("10.0.0.1:8300")


def test_the_scheduler_sides_thread_resolves_dns_and_allowed_never_does(tmp_path: Path) -> None:
    resolver = FakeResolver({"decode.svc": ["10.0.1.1"]})
    eps = DecodeEndpoints(ConnectorSettings(decode_kv_dns=("decode.svc:8300",)), resolver)
    eps._last = 0.0
    assert not eps.allowed("10.0.1.1:8300") and resolver.lookups == []  # vLLM's thread: no lookup
    eps.start(0.05)
    try:
        wait_until(lambda: eps.allowed("10.0.1.1:8300"), 5, "the refresher thread's first lookup")
        resolver.names["decode.svc"] = ["10.0.1.2"]
        wait_until(lambda: eps.current() == ("10.0.1.2:8300",), 5, "the next lookup")
    finally:
        eps.stop()


def test_settings_check_the_file_and_dns_names(tmp_path: Path) -> None:
    with pytest.raises(ConnectorConfigError, match="servers_file.*cannot read"):
        load_settings({"servers_file": str(tmp_path / "none.yaml")})
    with pytest.raises(ConnectorConfigError, match="decode_kv_dns.*NAME:PORT"):
        load_settings({"decode_kv_dns": "decode.svc"})
    assert load_settings({"decode_kv_dns": "a:1,b:2"}).decode_kv_dns == ("a:1", "b:2")


async def test_keeper_handshakes_an_added_receiver_and_drops_a_removed_one(kv, tmp_path: Path) -> None:
    path = tmp_path / "servers.yaml"
    write(path, "decode: []\n")
    eps = DecodeEndpoints(ConnectorSettings(servers_file=str(path)))
    sender = kv.make_sender()
    keeper = HandshakeKeeper(sender, eps.refresh, interval_s=0.05, timeout_s=2)
    keeper.start()
    try:
        async with kv.running_receiver() as first, kv.running_receiver() as second:
            write(path, servers(first.endpoint))
            # the receiver says ok before the sender's connect returns and the keeper records it
            await eventually(lambda: [p.state for p in first.peers()] == ["ok"], timeout=5)
            await eventually(lambda: keeper.state() == {first.endpoint: "ok"}, timeout=5)
            assert not second.peers()
            write(path, servers(second.endpoint))
            await eventually(lambda: [p.state for p in second.peers()] == ["ok"], timeout=5)
            await eventually(lambda: first.endpoint not in sender._peers, timeout=5)
            await eventually(lambda: keeper.state() == {second.endpoint: "ok"}, timeout=5)
            await asyncio.to_thread(sender.connect, second.endpoint, 2)  # still connected: a no-op
    finally:
        keeper.stop()
        sender.close()


class _Pending:
    """A sender with a handoff still pending to the endpoint: it must not be dropped yet."""

    def __init__(self) -> None:
        self.pending = True
        self.dropped: list[str] = []

    def connect(self, endpoint: str, timeout: float) -> None:
        pass

    def disconnect(self, endpoint: str) -> bool:
        if self.pending:
            return False
        self.dropped.append(endpoint)
        return True


def test_keeper_keeps_an_endpoint_while_a_handoff_to_it_is_pending() -> None:
    listed = ["a:1", "b:1"]
    sender = _Pending()
    keeper = HandshakeKeeper(sender, lambda: listed, interval_s=1, timeout_s=1)
    keeper.check_once()
    listed.remove("a:1")
    keeper.check_once()
    assert set(keeper.state()) == {"a:1", "b:1"} and not sender.dropped
    sender.pending = False
    keeper.check_once()
    assert keeper.state() == {"b:1": "ok"} and sender.dropped == ["a:1"]
