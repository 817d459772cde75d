"""The handshake keeper: a decode receiver that starts after vLLM, or restarts, is handshaken
again without any request (else the router, which waits for an ok handshake, would never
route one)."""

from __future__ import annotations

import asyncio

import pytest

from connector.keeper import HandshakeKeeper
from connector.kv_errors import ControlChannelError, HandshakeRejected
from tests.procs import free_port
from tests.waits import eventually

pytestmark = pytest.mark.timeout(60)


async def test_control_client_sees_the_endpoint_close_the_connection(kv):
    sender = kv.make_sender()
    try:
        async with kv.running_receiver() as receiver:
            await asyncio.to_thread(sender.connect, receiver.endpoint, 5)
            client = sender._peers[receiver.endpoint].client
            assert not client.broken  # idle and open
        # the receiver stopped: its end of the connection is closed
        await eventually(lambda: client.broken, timeout=5)
    finally:
        sender.close()


async def test_keeper_handshakes_a_receiver_started_later_and_again_after_a_restart(kv):
    port = free_port()
    sender = kv.make_sender()
    keeper = HandshakeKeeper(sender, (f"127.0.0.1:{port}",), interval_s=0.1, timeout_s=2)
    keeper.start()
    try:
        endpoint = f"127.0.0.1:{port}"
        await eventually(lambda: keeper.state().get(endpoint, "").startswith("unreachable"),
                         what="the keeper to record the endpoint unreachable")
        for _ in range(2):  # first start, then a restart on the same port
            async with kv.running_receiver(port=port) as receiver:
                await eventually(lambda: [p.state for p in receiver.peers()] == ["ok"], timeout=5)
                assert keeper.state()[receiver.endpoint] == "ok"
    finally:
        keeper.stop()
        sender.close()


class _Scripted:
    def __init__(self, outcomes: list[BaseException | None]) -> None:
        self.outcomes = outcomes
        self.calls = 0

    def connect(self, endpoint: str, timeout: float) -> None:
        outcome = self.outcomes[min(self.calls, len(self.outcomes) - 1)]
        self.calls += 1
        if outcome is not None:
            raise outcome


def test_keeper_records_each_outcome_and_never_raises():
    rejected = HandshakeRejected("num_layers", "3", "2", "decode server h:1: layer count 3 != 2")
    sender = _Scripted([ControlChannelError("refused"), rejected, None])
    keeper = HandshakeKeeper(sender, ("h:1",), interval_s=1, timeout_s=1)
    keeper.check_once()
    assert keeper.state()["h:1"].startswith("unreachable")
    keeper.check_once()
    assert keeper.state()["h:1"].startswith("rejected") and "layer count" in keeper.state()["h:1"]
    keeper.check_once()
    assert keeper.state() == {"h:1": "ok"}


def test_keeper_off_with_zero_interval_or_no_endpoints():
    sender = _Scripted([None])
    for keeper in (HandshakeKeeper(sender, ("h:1",), 0, 1), HandshakeKeeper(sender, (), 1, 1)):
        keeper.start()
        keeper.stop()
    assert sender.calls == 0
