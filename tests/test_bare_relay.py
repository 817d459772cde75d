"""bench/bare_relay.py, the floor bench/router_cpu_split.py measures the router's relay
against: bytes go both ways unchanged, and a side that closes closes the other."""

from __future__ import annotations

import asyncio

import pytest

from bench.bare_relay import start

pytestmark = pytest.mark.timeout(30)


async def _relayed_exchange() -> tuple[bytes, bytes, bool]:
    got: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.readexactly(5)
        got.append(data)
        for part in (b"one ", b"two ", b"three"):  # several writes: several relayed reads
            writer.write(part)
            await writer.drain()
        writer.close()

    up = await asyncio.start_server(upstream, "127.0.0.1", 0)
    relay = await start(0, ("127.0.0.1", up.sockets[0].getsockname()[1]))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.sockets[0].getsockname()[1])
        writer.write(b"hello")  # may arrive before the relay's upstream connection exists
        answer = await asyncio.wait_for(reader.read(), 10)  # to EOF: the upstream's close went through
        writer.close()
        return got[0], answer, reader.at_eof()
    finally:
        relay.close()
        up.close()


def test_the_bare_relay_passes_bytes_both_ways_and_closes_with_the_upstream():
    sent, answer, closed = asyncio.run(_relayed_exchange())
    assert sent == b"hello"
    assert answer == b"one two three"
    assert closed
