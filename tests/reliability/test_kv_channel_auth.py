"""Finding 9 of issue 12: hostile peers on the KV control port. With a shared secret the
receiver sends no Welcome (NIXL metadata, receive-buffer descriptors) to a connection that has
not proved it; wrong secrets and replayed challenges are refused; an authenticated but foreign
sender cannot Admit, Abort or complete another group's handoff, nor take a working sender out
of the peer list; refusals echo nothing the receiver expected nor other handoffs' state;
silent and surplus connections are closed; exposed binds need the secret; the connector dials
only configured decode endpoints. Every test ends with the receive slots free."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from connector import kv_auth
from connector.config import ConnectorConfigError, ConnectorSettings, load_settings
from connector.control import ControlClient, decode_body, encode_frame, parse_endpoint
from connector.kv_errors import ControlChannelError, HandoffTimeout
from connector.layout import layout_fingerprint
from connector.protocol import (
    Abort,
    Aborted,
    Admit,
    AuthChallenge,
    AuthFailed,
    AuthOk,
    AuthProof,
    AuthStart,
    Hello,
    LayersDone,
    Refused,
    Reject,
    Welcome,
)
from connector.receiver import ReceiverSettings
from connector.scheduler import ConnectorScheduler
from pd_wire.handoff import PROTOCOL_VERSION
from tests.connector.transport.helpers import SMALL, assert_no_leaks
from tests.connector.transport.synthetic import fill, layer_bytes, mismatches
from tests.fakes.fake_admissions import FakeAdmissions
from tests.fakes.fake_vllm import FakeRequest
from tests.fakes.memory_transport import MemoryTransport
from tests.waits import eventually

pytestmark = pytest.mark.timeout(60)

SECRET = b"0123456789abcdef-shared-kv-secret"
OTHER = b"fedcba9876543210-another-secret!"


class Raw:
    """A hand-driven control connection (what an attacker's script would do)."""

    def __init__(self, endpoint: str) -> None:
        self.sock = socket.create_connection(parse_endpoint(endpoint), timeout=10)

    def send(self, msg) -> None:
        self.sock.sendall(encode_frame(msg))

    def recv(self):
        head = self._exact(4)
        if head is None:
            return None
        body = self._exact(struct.unpack(">I", head)[0])
        return None if body is None else decode_body(body)

    def closed(self) -> bool:
        """True once the receiver closed the connection (EOF), after any pending frame."""
        return self.sock.recv(1 << 16) == b""

    def _exact(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()


def _hello(name: str, group: str = "", layout=SMALL) -> Hello:
    return Hello(protocol_version=PROTOCOL_VERSION, agent_name=name, fingerprint=layout_fingerprint(layout),
                 transport="memory", group=group)


def _send(sender, endpoint, hid, tokens, layers, seed=1):
    handoff = sender.begin(endpoint, hid, tokens, 5)
    for layer in layers:
        fill(handoff.staging(layer), layer_bytes(SMALL, layer, tokens, seed))
        handoff.post_layer(layer)
    return handoff


@pytest.mark.parametrize("transport", ["memory", "nixl"])
async def test_senders_with_the_secret_hand_off_as_before(kv, transport):
    async with kv.running_receiver(transport=transport, secret=SECRET) as receiver:
        sender = kv.make_sender(transport=transport, secret=SECRET)
        try:
            handoff = await asyncio.to_thread(_send, sender, receiver.endpoint, "ok", 20, range(3))
            assert await asyncio.to_thread(handoff.wait, 10) == "sent"
            got = await receiver.wait_for("ok", 10)
            assert mismatches(got.layers, SMALL, 20, 1) == []
            receiver.release("ok")
            assert_no_leaks(receiver, sender)
            assert [p.state for p in receiver.peers()] == ["ok"]
        finally:
            sender.close()


async def test_unauthenticated_hello_gets_no_metadata(kv):
    async with kv.running_receiver(secret=SECRET) as receiver:
        raw = await asyncio.to_thread(Raw, receiver.endpoint)
        try:
            raw.send(_hello("intruder"))
            reply = await asyncio.to_thread(raw.recv)
            assert isinstance(reply, AuthFailed) and "kv_secret_file" in reply.message
            assert await asyncio.to_thread(raw.closed)
        finally:
            raw.close()
        # Admit/Abort before authenticating: the same
        for msg in (Admit(handoff_id="x", num_tokens=4), Abort(handoff_id="x", reason="r")):
            raw = await asyncio.to_thread(Raw, receiver.endpoint)
            try:
                raw.send(msg)
                assert isinstance(await asyncio.to_thread(raw.recv), AuthFailed)
                assert await asyncio.to_thread(raw.closed)
            finally:
                raw.close()
        # a sender without the secret fails with a message saying what to configure
        sender = kv.make_sender()
        try:
            with pytest.raises(ControlChannelError, match="kv_secret_file"):
                await asyncio.to_thread(sender.connect, receiver.endpoint, 5)
        finally:
            sender.close()
        assert receiver.peers() == [] and receiver.busy_slots() == 0
        await eventually(lambda: receiver.refused_connections == 4)


async def test_wrong_secret_is_refused_both_ways(kv):
    async with kv.running_receiver(secret=SECRET) as receiver:
        sender = kv.make_sender(secret=OTHER)
        try:  # the receiver's proof does not check out under the sender's secret: it stops first
            with pytest.raises(ControlChannelError, match="did not prove the shared secret"):
                await asyncio.to_thread(sender.connect, receiver.endpoint, 5)
        finally:
            sender.close()
        raw = await asyncio.to_thread(Raw, receiver.endpoint)
        try:  # a client that ignores the receiver's proof and answers with a guess
            nonce = kv_auth.new_nonce()
            raw.send(AuthStart(nonce=nonce))
            challenge = await asyncio.to_thread(raw.recv)
            assert isinstance(challenge, AuthChallenge)
            raw.send(AuthProof(proof=kv_auth.proof(OTHER, "prefill", nonce, challenge.nonce)))
            reply = await asyncio.to_thread(raw.recv)
            assert isinstance(reply, AuthFailed) and SECRET.decode() not in reply.message
            assert await asyncio.to_thread(raw.closed)
        finally:
            raw.close()
        raw = await asyncio.to_thread(Raw, receiver.endpoint)
        try:  # reflecting the receiver's own proof back is not the sender's proof
            nonce = kv_auth.new_nonce()
            raw.send(AuthStart(nonce=nonce))
            challenge = await asyncio.to_thread(raw.recv)
            raw.send(AuthProof(proof=challenge.proof))
            assert isinstance(await asyncio.to_thread(raw.recv), AuthFailed)
        finally:
            raw.close()
        assert receiver.peers() == [] and receiver.busy_slots() == 0


async def test_a_receiver_without_the_secret_is_not_trusted_by_a_sender_with_one(kv):
    async with kv.running_receiver() as receiver:  # loopback, no secret
        sender = kv.make_sender(secret=SECRET)
        try:
            with pytest.raises(ControlChannelError, match="has no shared secret"):
                await asyncio.to_thread(sender.connect, receiver.endpoint, 5)
        finally:
            sender.close()
        assert receiver.peers() == []


async def test_replayed_challenge_and_proof_are_refused(kv):
    async with kv.running_receiver(secret=SECRET) as receiver:
        # an exchange an eavesdropper recorded
        raw = await asyncio.to_thread(Raw, receiver.endpoint)
        nonce = kv_auth.new_nonce()
        raw.send(AuthStart(nonce=nonce))
        challenge = await asyncio.to_thread(raw.recv)
        recorded = kv_auth.proof(SECRET, "prefill", nonce, challenge.nonce)
        raw.send(AuthProof(proof=recorded))
        assert isinstance(await asyncio.to_thread(raw.recv), AuthOk)
        raw.close()
        # replay of the same opening: refused at once
        raw = await asyncio.to_thread(Raw, receiver.endpoint)
        try:
            raw.send(AuthStart(nonce=nonce))
            reply = await asyncio.to_thread(raw.recv)
            assert isinstance(reply, AuthFailed) and "replayed" in reply.message
            assert await asyncio.to_thread(raw.closed)
        finally:
            raw.close()
        # a fresh opening with the recorded proof: the receiver's nonce is new, the proof fails
        raw = await asyncio.to_thread(Raw, receiver.endpoint)
        try:
            raw.send(AuthStart(nonce=kv_auth.new_nonce()))
            fresh = await asyncio.to_thread(raw.recv)
            assert isinstance(fresh, AuthChallenge) and fresh.nonce != challenge.nonce
            raw.send(AuthProof(proof=recorded))
            assert isinstance(await asyncio.to_thread(raw.recv), AuthFailed)
            assert await asyncio.to_thread(raw.closed)
        finally:
            raw.close()
        assert receiver.peers() == [] and receiver.busy_slots() == 0


async def test_silent_and_surplus_connections_are_closed(kv):
    async with kv.running_receiver(secret=SECRET, auth_timeout_s=0.5, max_connections=2) as receiver:
        silent = [await asyncio.to_thread(Raw, receiver.endpoint) for _ in range(2)]
        surplus = await asyncio.to_thread(Raw, receiver.endpoint)
        try:
            assert await asyncio.to_thread(surplus.closed)  # over the cap: closed unheard
            for raw in silent:  # never authenticated: closed after auth_timeout_s
                assert await asyncio.to_thread(raw.closed)
        finally:
            for raw in (*silent, surplus):
                raw.close()
        assert receiver.refused_connections == 3
        sender = kv.make_sender(secret=SECRET)  # room again
        try:
            await asyncio.to_thread(sender.connect, receiver.endpoint, 5)
        finally:
            sender.close()


async def test_no_secret_loopback_still_closes_connections_that_never_say_hello(kv):
    async with kv.running_receiver(auth_timeout_s=0.5) as receiver:
        raw = await asyncio.to_thread(Raw, receiver.endpoint)
        try:
            assert await asyncio.to_thread(raw.closed)
        finally:
            raw.close()


async def _foreign(endpoint: str, name: str) -> ControlClient:
    client = await asyncio.to_thread(ControlClient, endpoint, 5, SECRET)
    welcome = await asyncio.to_thread(client.request, _hello(name, group="elsewhere"), 5)
    assert isinstance(welcome, Welcome)
    return client


async def test_foreign_admit_abort_and_layers_done_are_refused(kv):
    async with kv.running_receiver(secret=SECRET) as receiver:
        owner = kv.make_sender(secret=SECRET)
        foreign = await _foreign(receiver.endpoint, "mallory")
        forger = MemoryTransport("mallory", kv.fabric)  # mallory's data agent
        try:
            handoff = await asyncio.to_thread(_send, owner, receiver.endpoint, "victim", 37, [0])
            await eventually(lambda: receiver._handoffs["victim"].arrived == {0}, timeout=30)  # the owner's layer 0
            # Admit of a live id: refused without its state or size
            refused = await asyncio.to_thread(foreign.request, Admit(handoff_id="victim", num_tokens=37), 5)
            assert isinstance(refused, Refused) and refused.reason == "duplicate"
            assert "37" not in refused.message and "admitted" not in refused.message
            # Abort of someone else's handoff: not theirs, nothing happens
            reply = await asyncio.to_thread(foreign.request, Abort(handoff_id="victim", reason="x"), 5)
            assert reply == Aborted(handoff_id="victim", known=False)
            assert receiver.busy_slots() == 1
            # LayersDone for layers the owner never wrote: ignored, the handoff stays incomplete
            forger.add_peer(receiver.agent_name.encode())
            forger.notify(receiver.agent_name, LayersDone(handoff_id="victim", layers=[0, 1, 2])
                          .model_dump_json().encode())
            with pytest.raises(HandoffTimeout, match="1/3 layers arrived"):
                await receiver.wait_for("victim", 1.0)
            await eventually(lambda: handoff.status() == "failed")
            assert_no_leaks(receiver, owner)
            # the owner's next handoff is untouched by the foreigner
            ok = await asyncio.to_thread(_send, owner, receiver.endpoint, "next", 12, range(3), 4)
            assert await asyncio.to_thread(ok.wait, 10) == "sent"
            got = await receiver.wait_for("next", 10)
            assert mismatches(got.layers, SMALL, 12, 4) == []
            receiver.release("next")
            assert_no_leaks(receiver, owner)
        finally:
            foreign.close()
            forger.close()
            owner.close()


async def test_a_bad_hello_under_a_working_senders_name_does_not_take_it_out(kv):
    async with kv.running_receiver(secret=SECRET) as receiver:
        owner = kv.make_sender(secret=SECRET)
        try:
            await asyncio.to_thread(owner.connect, receiver.endpoint, 5)
            client = await asyncio.to_thread(ControlClient, receiver.endpoint, 5, SECRET)
            try:
                bad = Hello(protocol_version=PROTOCOL_VERSION, agent_name=owner.agent_name,
                            fingerprint=layout_fingerprint(SMALL).model_copy(update={"num_layers": 99}),
                            transport="memory")
                reply = await asyncio.to_thread(client.request, bad, 5)
                assert isinstance(reply, Reject) and reply.received == "99"
                assert "expects" not in reply.message and str(SMALL.num_layers) not in reply.message.split("sent")[-1]
            finally:
                client.close()
            assert [(p.peer, p.state) for p in receiver.peers()] == [(owner.agent_name, "ok")]
        finally:
            owner.close()


async def test_exposed_receiver_needs_a_secret():
    with pytest.raises(ValueError, match="--kv-secret-file"):
        ReceiverSettings(layout=SMALL, max_tokens=8, host="0.0.0.0")
    assert ReceiverSettings(layout=SMALL, max_tokens=8, host="0.0.0.0", secret=SECRET).secret == SECRET
    assert SECRET.decode() not in repr(ReceiverSettings(layout=SMALL, max_tokens=8, secret=SECRET))


def test_decode_server_exposed_kv_host_without_a_secret_does_not_start(tmp_path):
    from decode_server.settings import SettingsError
    from decode_server.settings import load_settings as decode_settings
    from tests.decode_server.conftest import build_model_dir

    model = build_model_dir(tmp_path / "m")
    with pytest.raises(SettingsError) as err:
        decode_settings(["--engine", "reference", "--model", str(model), "--kv-host", "0.0.0.0"], env={})
    assert "--kv-secret-file" in str(err.value) and "--kv-host 0.0.0.0" in str(err.value)
    secret = tmp_path / "kv.secret"
    secret.write_bytes(SECRET + b"\n")
    ok = decode_settings(["--engine", "reference", "--model", str(model), "--kv-host", "0.0.0.0",
                          "--kv-secret-file", str(secret)], env={})
    assert ok.kv_secret() == SECRET


def test_connector_secret_by_reference_only(tmp_path, monkeypatch):
    secret = tmp_path / "kv.secret"
    secret.write_bytes(SECRET)
    assert load_settings({"kv_secret_file": str(secret)}).kv_secret() == SECRET
    monkeypatch.setenv("PD_TEST_KV_SECRET", SECRET.decode())
    assert load_settings({"kv_secret_env": "PD_TEST_KV_SECRET"}).kv_secret() == SECRET
    with pytest.raises(ConnectorConfigError) as err:
        load_settings({"kv_secret_file": str(tmp_path / "missing")})
    assert "kv_connector_extra_config.kv_secret_file" in str(err.value)
    with pytest.raises(ConnectorConfigError, match="unknown option"):
        load_settings({"kv_secret": SECRET.decode()})  # the secret itself is not an option


def test_connector_dials_only_configured_endpoints():
    configured = ConnectorSettings(decode_endpoints=("dc0:8300",))
    assert configured.endpoint_allowed("dc0:8300") and not configured.endpoint_allowed("evil.example:8300")
    local = ConnectorSettings()
    assert local.endpoint_allowed("127.0.0.1:9100") and not local.endpoint_allowed("10.0.0.9:9100")
    admissions = FakeAdmissions(SMALL)
    sched = ConnectorScheduler(block_size=16, max_tokens=512, world_size=1, reports=None, admissions=admissions,
                               endpoint_allowed=configured.endpoint_allowed)
    bad = FakeRequest("a", list(range(1000, 1020)), {"handoff_id": "h-a", "kv_endpoint": "evil.example:8300"})
    good = FakeRequest("b", list(range(1000, 1020)), {"handoff_id": "h-b", "kv_endpoint": "dc0:8300"})
    sched.on_new_request(bad)
    sched.on_new_request(good)
    assert admissions.started == ["h-b"], "the connector dialled an endpoint nobody configured"
    bad.output_token_ids.append(7)  # vLLM computed the first token: the failure travels in the answer
    _, params = sched.request_finished(bad, [])
    assert params is not None and params["reason"] == "rejected" and "decode_endpoints" in params["error"]
