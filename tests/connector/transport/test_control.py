"""Control-channel framing and the in-memory transport's NIXL-like checks."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest
import torch

from connector.control import ControlClient, decode_body, encode_frame, parse_endpoint
from connector.kv_errors import ControlChannelError, TransportError
from connector.protocol import Abort, Aborted, Admitted
from connector.transport import Region, decode_regions, encode_regions, merge_pieces
from tests.fakes.memory_transport import MemoryFabric, MemoryTransport

pytestmark = pytest.mark.timeout(30)


def test_frame_roundtrip_and_malformed_body():
    msg = Admitted(handoff_id="h", slot=1, offsets=[[0, 10]])
    frame = encode_frame(msg)
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    assert decode_body(frame[4:]) == msg
    with pytest.raises(ControlChannelError, match="malformed"):
        decode_body(b'{"type": "admit", "handoff_id": "", "num_tokens": 0}')


@pytest.mark.parametrize("bad", ["localhost", "h:0", "h:x", ":80", "h:70000"])
def test_parse_endpoint_rejects(bad):
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoint(bad)


def test_regions_encode_decode_and_merge():
    regions = [Region(0x1000, 4096, 0), Region(0x9000, 8, 3, "VRAM")]
    assert decode_regions(encode_regions(regions)) == regions
    with pytest.raises(ValueError):
        decode_regions("AAAA")
    assert merge_pieces([(100, 900, 10), (0, 800, 100), (110, 950, 5)]) == [(0, 800, 110), (110, 950, 5)]


async def test_garbage_and_oversized_frames_close_only_that_connection(kv):
    async with kv.running_receiver() as receiver:
        host, port = parse_endpoint(receiver.endpoint)
        for payload in (struct.pack(">I", 5) + b"nope!", struct.pack(">I", 1 << 30)):
            with socket.create_connection((host, port), timeout=5) as sock:
                sock.sendall(payload)
                sock.settimeout(5)
                assert await asyncio.to_thread(sock.recv, 1) == b""  # closed by the receiver
        client = await asyncio.to_thread(ControlClient, receiver.endpoint, 5)
        try:  # the server still answers well-formed requests
            reply = await asyncio.to_thread(client.request, Abort(handoff_id="x", reason="r"), 5)
            assert reply.type == "refused"  # no Hello on this connection
        finally:
            client.close()
        assert receiver.listening


async def test_client_times_out_on_a_silent_server():
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client = await asyncio.to_thread(ControlClient, f"127.0.0.1:{port}", 5)
        with pytest.raises(ControlChannelError, match="no reply .* within 0.3s"):
            await asyncio.to_thread(client.request, Aborted(handoff_id="x", known=False), 0.3)
        assert client.broken
        client.close()
    finally:
        server.close()


def test_memory_transport_checks_ranges_and_peers():
    fabric = MemoryFabric()
    a, b = MemoryTransport("a", fabric), MemoryTransport("b", fabric)
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    with pytest.raises(TransportError, match="unknown or gone"):
        a.write("b", [(ra.addr, rb.addr, 8)], b"n")
    peer = a.add_peer(b.metadata())
    a.write(peer, [(ra.addr, rb.addr + 8, 16)], b"n1")
    assert torch.equal(dst[8:24], src[:16]) and b.notifications() == [("a", b"n1")]
    with pytest.raises(TransportError, match="remote range"):
        a.write(peer, [(ra.addr, rb.addr + 60, 8)], b"n")
    with pytest.raises(TransportError, match="local range"):
        a.write(peer, [(ra.addr + 60, rb.addr, 8)], b"n")
    with pytest.raises(TransportError, match="already in use"):
        MemoryTransport("a", fabric)
    b.close()
    with pytest.raises(TransportError, match="unknown or gone"):
        a.write(peer, [(ra.addr, rb.addr, 8)], b"n")
    a.close()


def test_host_buffer_is_zeroed_and_huge_page_aligned():
    from connector.transport import HostBuffer, host_tensor

    buf = HostBuffer(3 << 20)
    assert buf.tensor.numel() == 3 << 20 and buf.tensor.data_ptr() % (2 << 20) == 0
    assert int(buf.tensor.count_nonzero()) == 0
    tensor, owner = host_tensor(4096)
    tensor.fill_(7)
    assert owner is not None and int(tensor.sum()) == 7 * 4096
    with pytest.raises(ValueError, match="nbytes=0"):
        HostBuffer(0)
