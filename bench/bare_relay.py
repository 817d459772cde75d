"""A byte relay: the least any proxy between a client and a decode server can cost.

Each client connection gets its own connection to the upstream server; bytes go both ways
unchanged, with no HTTP parsing, no rewriting, no slot request or prefill: one read and one write
per upstream chunk, on uvloop, as the router's relay does after its first chunk. Its CPU
per relayed token, measured in the same run as the router's (``bench/router_cpu_split.py``),
is the floor of the router's on this machine: on loopback each write also runs the
receiving end's TCP processing in the writer's system call, which no proxy avoids.

    .venv/bin/python -m bench.bare_relay --port P --upstream 127.0.0.1:Q
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

import uvloop


class _Pipe(asyncio.Protocol):
    """One side of a relayed connection: what it reads goes to ``peer``'s transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.pending: list[bytes] = []  # read before the peer connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.pending.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class _Client(_Pipe):
    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self.upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, server = await loop.create_connection(_Pipe, *self.upstream)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        server.peer, self.peer = self, server
        for data in self.pending:
            server.transport.write(data)  # type: ignore[union-attr]
        self.pending.clear()


async def start(port: int, upstream: tuple[str, int]) -> asyncio.Server:
    """The relay, listening on 127.0.0.1:``port`` (0: any free port)."""
    return await asyncio.get_running_loop().create_server(lambda: _Client(upstream), "127.0.0.1", port)


async def serve(port: int, upstream: tuple[str, int]) -> None:
    async with await start(port, upstream) as server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="host:port of the server to relay to")
    args = parser.parse_args()
    host, _, port = args.upstream.rpartition(":")
    uvloop.run(serve(args.port, (host, int(port))))


if __name__ == "__main__":
    main()
