"""The hot-path HTTP client against small asyncio servers on loopback: keep-alive reuse,
a pooled connection closed by the server, malformed answers, timeouts, flow control."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from pd_router.upstream.connections import ConnectionPool
from pd_router.upstream.rawhttp import ConnectFailed, Origin, ReadTimeout, ResponseFailed
from tests.waits import eventually

pytestmark = pytest.mark.timeout(30)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, Origin]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, Origin("127.0.0.1", server.sockets[0].getsockname()[1])


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
    )
    return head + await reader.readexactly(length)


def _ok(body: bytes, close: bool = False) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + (b"\r\nConnection: close" if close else b"")
        + b"\r\n\r\n"
        + body
    )


async def test_keep_alive_reuse_and_stale_connection_retry():
    connections: list[int] = []

    async def handler(reader, writer):
        connections.append(1)
        n = len(connections)
        request = await _read_request(reader)
        assert b"X-Request-Id: r1" in request and request.endswith(b'{"a": 1}')
        writer.write(_ok(b"conn %d, first" % n))
        await writer.drain()
        if n == 1:  # a keep-alive race: the server closes as the next request arrives
            await _read_request(reader)
            writer.close()
            return
        while True:  # later connections answer every request
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(_ok(b"conn %d, again" % n))
            await writer.drain()

    server, origin = await _serve(handler)
    pool = ConnectionPool()
    for expected in (b"conn 1, first", b"conn 2, first", b"conn 2, again"):
        resp = await pool.post(origin, "/x", b'{"a": 1}', {"X-Request-Id": "r1"})
        assert resp.status == 200 and await resp.read() == expected
        resp.release()
    assert len(connections) == 2  # reused; the one closed under the request was replaced transparently
    pool.close()
    server.close()


async def test_refused_malformed_and_mid_answer_close():
    pool = ConnectionPool()
    server, origin = await _serve(lambda r, w: None)
    server.close()
    await server.wait_closed()
    with pytest.raises(ConnectFailed):
        await pool.post(origin, "/x", b"{}", {})

    async def garbage(reader, writer):
        await _read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    server, origin = await _serve(garbage)
    with pytest.raises(ResponseFailed):
        await pool.post(origin, "/x", b"{}", {})
    server.close()

    async def truncated(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        writer.close()

    server, origin = await _serve(truncated)
    resp = await pool.post(origin, "/x", b"{}", {})
    assert await resp.__anext__() == b"hello"
    with pytest.raises(ResponseFailed):
        await resp.__anext__()
    resp.close()
    server.close()
    pool.close()


async def test_read_timeout_and_flow_control():
    timed_out = asyncio.Event()

    async def slow_then_big(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await timed_out.wait()  # silent until the first request's read has timed out
        for _ in range(48):
            writer.write(b"10000\r\n" + b"x" * 0x10000 + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    server, origin = await _serve(slow_then_big)
    pool = ConnectionPool()
    resp = await pool.post(origin, "/x", b"{}", {}, read_timeout=0.1)
    with pytest.raises(ReadTimeout):
        await resp.read()
    timed_out.set()
    resp.close()
    resp = await pool.post(origin, "/x", b"{}", {}, read_timeout=5)
    # the server writes 3 MiB, nothing reads them: reading pauses at the high-water mark
    await eventually(lambda: resp._conn.paused, what="the connection to pause reading")
    assert resp._buffered <= 2 * (1 << 20)
    total = 0
    async for chunk in resp:
        total += len(chunk)
    assert total == 48 * 0x10000 and not resp._conn.paused
    resp.release()
    pool.close()
    server.close()


async def test_a_sink_takes_chunks_in_order_and_what_it_declines_reaches_the_reader():
    """The relay's write-through: chunks the sink takes never reach the reader; one it
    declines is buffered, and so is every chunk after it until the reader took them, even
    one the sink would take (order)."""
    step = asyncio.Event()  # set by whoever consumed the last chunk: the server sends the next

    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b"1\r\na\r\n", b"1\r\nb\r\n1\r\nc\r\n", b"1\r\nd\r\n", b"1\r\ne\r\n"):
            writer.write(part)  # b and c in one write: c arrives while b waits for the reader
            await writer.drain()
            await step.wait()
            step.clear()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    server, origin = await _serve(handler)
    pool = ConnectionPool()
    taken: list[bytes] = []
    flushed: list[int] = []

    class Sink:
        def take(self, chunk: bytes) -> bool:
            if chunk in (b"a", b"b"):
                return False
            taken.append(chunk)
            return True

        def flush(self) -> None:  # after each read: the server has the next chunk sent once it was written
            flushed.append(len(taken))
            if taken:
                step.set()

    try:
        resp = await pool.post(origin, "/", b"{}", {})
        resp.sink = Sink()
        read: list[bytes] = []
        async for chunk in resp:
            read.append(chunk)
            step.set()
        resp.release()
        assert b"".join(read) == b"abc"
        assert taken == [b"d", b"e"]
        assert 1 in flushed and 2 in flushed  # a flush after the read of d, and after e
    finally:
        pool.close()
        server.close()
        await server.wait_closed()
