"""A minimal PD relay: the least any router speaking this product's protocol can cost.

Per client request it makes the router's upstream exchanges in the router's order: the decode
request first (a ``HandoffClaim``: the decode server answers 200 once the slot is the
request's), the prefill on that 200 (asking for its result to go with the KV,
``result_with_kv``), vLLM's answer read beside the relay; and it relays the decode server's
answer to the client byte for byte, head and chunked framing included. Nothing else: no
validation beyond what the rewrite needs, no error handling (a failed exchange drops the
client's connection), no metrics, logs, tracing, timeouts or failover, one model, one prefill
and one decode server, keep-alive connections reused. Its added TTFT and CPU per token,
measured in the same run as the router's (``bench/router_overhead.py``), are the floor of a
Python router with this protocol on the machine, as ``bench/bare_relay.py`` is the floor of any
relay.

    .venv/bin/python -m bench.pd_floor --port P --prefill 127.0.0.1:Q --decode 127.0.0.1:R
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import uuid
from typing import Any, cast

import uvloop

_END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked body, after a chunk's data


def _head_end(buf: bytes | bytearray) -> int:
    return buf.find(b"\r\n\r\n")


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


class _Upstream(asyncio.Protocol):
    """A keep-alive HTTP/1.1 connection, one request at a time: a whole answer with a
    ``Content-Length`` to :meth:`call`, or every byte of a chunked answer to a ``sink``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.answer: asyncio.Future[bytes] | None = None
        self.sink: Any = None  # a client transport: the answer's bytes go there as they come
        self.tail = b""
        self.done: asyncio.Future[None] | None = None
        self.first: asyncio.Future[None] | None = None  # set by the answer's first bytes (a relay's)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.sink is not None:
            self.sink.write(data)
            if self.first is not None:
                self.first.set_result(None)
                self.first = None
            tail = self.tail + data[-len(_END):]
            if tail.endswith(_END) and self.done is not None:
                self.sink = None
                self.done.set_result(None)
            self.tail = tail[-len(_END):]
            return
        self.buf += data
        end = _head_end(self.buf)
        if end < 0 or self.answer is None:
            return
        need = end + 4 + _content_length(bytes(self.buf[:end]))
        if len(self.buf) >= need:
            body = bytes(self.buf[end + 4:need])
            del self.buf[:need]
            self.answer.set_result(body)

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in (self.answer, self.done):
            if fut is not None and not fut.done():
                fut.set_exception(ConnectionError("upstream closed"))

    def _send(self, host: bytes, path: str, body: bytes, rid: bytes) -> None:
        assert self.transport is not None
        self.transport.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                             b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s"
                             % (path.encode(), host, rid, len(body), body))

    async def call(self, host: bytes, path: str, body: bytes, rid: bytes) -> bytes:
        self.answer = asyncio.get_running_loop().create_future()
        self._send(host, path, body, rid)
        return await self.answer

    async def relay(self, host: bytes, path: str, body: bytes, rid: bytes, sink: asyncio.Transport) -> None:
        self.sink, self.tail = sink, b""
        self.done = asyncio.get_running_loop().create_future()
        self._send(host, path, body, rid)
        await self.done


class _Pool:
    """Idle keep-alive connections to one server."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.addr = addr
        self.host = f"{addr[0]}:{addr[1]}".encode()
        self.idle: list[_Upstream] = []

    async def take(self) -> _Upstream:
        while self.idle:
            conn = self.idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                return conn
        _, conn = await asyncio.get_running_loop().create_connection(_Upstream, *self.addr)
        return conn

    def give(self, conn: _Upstream) -> None:
        self.idle.append(conn)


class _Relay:
    def __init__(self, prefill: tuple[str, int], decode: tuple[str, int], kv_endpoint: str) -> None:
        self.prefill, self.decode = _Pool(prefill), _Pool(decode)
        self.kv_endpoint = kv_endpoint
        self.ids = itertools.count()
        self.prefix = uuid.uuid4().hex[:8]  # several relays may share the fakes: their ids must differ

    async def serve(self, head: bytes, raw: bytes, client: asyncio.Transport) -> None:
        path = head.split(b" ", 2)[1].decode()
        rid = f"floor-{self.prefix}-{next(self.ids)}".encode()
        body = json.loads(raw)
        target = {"handoff_id": rid.decode(), "kv_endpoint": self.kv_endpoint, "result_with_kv": True}
        prefill = dict(body, stream=False, max_tokens=1, kv_transfer_params=target)
        prefill.pop("stream_options", None)
        claim = b'{"handoff_id": "%s", "result": "with_kv"}' % rid
        decode = raw.rstrip()[:-1] + b', "kv_transfer_params": ' + claim + b"}"
        pconn, dconn = await self.prefill.take(), await self.decode.take()
        dconn.first = granted = asyncio.get_running_loop().create_future()
        relayed = asyncio.ensure_future(dconn.relay(self.decode.host, path, decode, rid, client))
        await granted  # the prefill on the decode server's 200
        answer = asyncio.ensure_future(pconn.call(self.prefill.host, path, json.dumps(prefill).encode(), rid))
        await relayed
        self.decode.give(dconn)
        await answer  # read beside the relay (long there by now), for its connection
        self.prefill.give(pconn)


class _Client(asyncio.Protocol):
    """A client connection: each whole request (``Content-Length`` body) is served in turn."""

    def __init__(self, relay: _Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next()

    def _next(self) -> None:
        if self.task is not None and not self.task.done():
            return
        end = _head_end(self.buf)
        if end < 0:
            return
        head = bytes(self.buf[:end])
        need = end + 4 + _content_length(head)
        if len(self.buf) < need:
            return
        raw = bytes(self.buf[end + 4:need])
        del self.buf[:need]
        if head.startswith(b"GET /ready"):  # the bench's start-up check
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            return self._next()
        self.task = asyncio.ensure_future(self._serve(head, raw))

    async def _serve(self, head: bytes, raw: bytes) -> None:
        assert self.transport is not None
        try:
            await self.relay.serve(head, raw, self.transport)
        except Exception:
            self.transport.close()
            return
        self.task = None
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None:
            self.task.cancel()


async def start(port: int, prefill: tuple[str, int], decode: tuple[str, int]) -> asyncio.Server:
    """The relay on 127.0.0.1:``port`` (0: any free port), its handoff target read from the
    decode server's capabilities."""
    reader, writer = await asyncio.open_connection(*decode)
    writer.write(b"GET /v1/pd/capabilities HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n"
                 % (decode[0].encode(), decode[1]))
    data = await reader.read()
    writer.close()
    kv_endpoint = json.loads(data[_head_end(data) + 4:])["kv_endpoint"]
    relay = _Relay(prefill, decode, kv_endpoint)
    return await asyncio.get_running_loop().create_server(lambda: _Client(relay), "127.0.0.1", port)


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="host:port of the prefill server")
    parser.add_argument("--decode", required=True, help="host:port of the decode server")
    args = parser.parse_args()

    async def run() -> None:
        async with await start(args.port, _addr(args.prefill), _addr(args.decode)) as server:
            await server.serve_forever()

    uvloop.run(run())


if __name__ == "__main__":
    main()
