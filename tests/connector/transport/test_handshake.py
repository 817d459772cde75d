"""Mismatches fail clearly on both sides, nothing hangs: layer count, plane dtype,
protocol version, transport kind, sequence too long."""

from __future__ import annotations

import asyncio

import pytest

from connector import sender as sender_module
from connector.control import ControlClient
from connector.kv_errors import AdmissionRefused, ControlChannelError, HandshakeRejected
from connector.layout import cpu_mla_layout, glm5_fp8_ds_mla_layout, layout_fingerprint
from connector.protocol import Admit, Hello, Refused, Reject
from pd_wire.handoff import PROTOCOL_VERSION
from tests.connector.transport.helpers import assert_no_leaks

pytestmark = pytest.mark.timeout(30)


async def _rejected(receiver, sender) -> HandshakeRejected:
    with pytest.raises(HandshakeRejected) as info:
        await asyncio.to_thread(sender.connect, receiver.endpoint, 5)
    (peer,) = receiver.peers()
    assert peer.peer == sender.agent_name and peer.state == "rejected"
    assert info.value.field in peer.reason and info.value.received in peer.reason
    assert info.value.expected == "", "a Reject must not tell whoever connects what the decode server expects"
    return info.value, peer.reason


@pytest.mark.parametrize("transport", ["memory", "nixl"])
async def test_78_layer_prefill_against_79_layer_decode(kv, transport):
    async with kv.running_receiver(glm5_fp8_ds_mla_layout(78, 1), 128, transport) as receiver:
        sender = kv.make_sender(glm5_fp8_ds_mla_layout(78, 0), 128, transport)
        try:
            err, decode_side = await _rejected(receiver, sender)
        finally:
            sender.close()
    assert (err.field, err.received) == ("num_layers", "78")
    assert "num_layers mismatch" in str(err) and "sent 78" in str(err)
    assert "expects" not in str(err)  # decode's own value stays in its log (agent ids are random hex)
    assert "num_layers mismatch: decode expects 79" in decode_side  # the decode server's own report


async def test_plane_dtype_mismatch_names_the_plane(kv):
    async with kv.running_receiver(cpu_mla_layout(2, 1, "bfloat16")) as receiver:
        sender = kv.make_sender(cpu_mla_layout(2, 1, "float32"))
        try:
            err, decode_side = await _rejected(receiver, sender)
        finally:
            sender.close()
    assert err.field == "planes[0].dtype"
    assert err.received == "float32" and "expects bfloat16" in decode_side


async def test_protocol_version_mismatch(kv, monkeypatch):
    monkeypatch.setattr(sender_module, "PROTOCOL_VERSION", 99)
    async with kv.running_receiver() as receiver:
        sender = kv.make_sender()
        try:
            err, decode_side = await _rejected(receiver, sender)
        finally:
            sender.close()
    assert (err.field, err.received) == ("protocol_version", "99")
    assert f"expects {PROTOCOL_VERSION}" in decode_side


async def test_transport_kind_mismatch(kv):
    async with kv.running_receiver(transport="memory") as receiver:
        client = await asyncio.to_thread(ControlClient, receiver.endpoint, 5)
        try:
            hello = Hello(protocol_version=PROTOCOL_VERSION, agent_name="p",
                          fingerprint=layout_fingerprint(cpu_mla_layout(2, 1)), transport="nixl")
            reply = await asyncio.to_thread(client.request, hello, 5)
        finally:
            client.close()
    assert isinstance(reply, Reject) and reply.field == "transport"
    assert reply.received == "nixl" and "memory" not in reply.message


async def test_sequence_too_long_is_refused_by_the_receiver_and_checked_by_the_sender(kv):
    async with kv.running_receiver(max_tokens=64) as receiver:
        sender = kv.make_sender(max_tokens=128)
        try:
            with pytest.raises(AdmissionRefused) as info:
                await asyncio.to_thread(sender.begin, receiver.endpoint, "long", 100, 5)
            assert info.value.reason == "too_long"
            assert "100 prompt tokens exceed the decode server's max_tokens 64" in str(info.value)
            assert receiver.stats.refusals == {"too_long": 1}
            with pytest.raises(AdmissionRefused, match="exceed this prefill's KV staging size"):
                await asyncio.to_thread(sender.begin, receiver.endpoint, "longer", 129, 5)
            assert_no_leaks(receiver, sender)
        finally:
            sender.close()


async def test_admit_without_hello_is_refused(kv):
    async with kv.running_receiver() as receiver:
        client = await asyncio.to_thread(ControlClient, receiver.endpoint, 5)
        try:
            reply = await asyncio.to_thread(client.request, Admit(handoff_id="x", num_tokens=1), 5)
        finally:
            client.close()
        assert isinstance(reply, Refused) and reply.reason == "unknown_peer"
        assert receiver.busy_slots() == 0 and receiver.stats.refusals == {"unknown_peer": 1}


async def test_unreachable_endpoint_fails_fast_with_its_address(kv):
    sender = kv.make_sender()
    try:
        with pytest.raises(ControlChannelError, match="127.0.0.1:1"):
            await asyncio.to_thread(sender.connect, "127.0.0.1:1", 2)
    finally:
        sender.close()


async def test_connect_is_cached_per_endpoint(kv):
    async with kv.running_receiver() as receiver:
        sender = kv.make_sender()
        try:
            await asyncio.to_thread(sender.connect, receiver.endpoint, 5)
            first = sender._peers[receiver.endpoint].client
            await asyncio.to_thread(sender.connect, receiver.endpoint, 5)
            assert sender._peers[receiver.endpoint].client is first
            assert receiver.peers()[0].state == "ok"
        finally:
            sender.close()


def test_fingerprint_mismatch_order_and_fields():
    from connector.protocol import fingerprint_mismatch

    glm, tiny = layout_fingerprint(glm5_fp8_ds_mla_layout(2, 1)), layout_fingerprint(cpu_mla_layout(2, 1))
    assert fingerprint_mismatch(glm, glm) is None
    assert fingerprint_mismatch(glm, tiny) == ("profile", "glm5.1-fp8-ds-mla", "tiny-mla")
    fewer = glm.model_copy(update={"planes": glm.planes[:2]})
    assert fingerprint_mismatch(glm, fewer) == ("planes", "kv,rope,indexer", "kv,rope")
    pages128 = glm.planes[2].model_copy(update={"page_tokens": 128})
    paged = glm.model_copy(update={"planes": [*glm.planes[:2], pages128]})
    assert fingerprint_mismatch(glm, paged) == ("planes[2].page_tokens", "64", "128")
    # the sender's world size is informational: TP8 and TP1 prefills both fit one decode layout
    assert fingerprint_mismatch(glm, layout_fingerprint(glm5_fp8_ds_mla_layout(2, 1), 8)) is None
