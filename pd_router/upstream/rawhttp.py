"""A minimal HTTP/1.1 client for the hot path: pooled keep-alive connections as
asyncio protocols, responses parsed by httptools.

Why not aiohttp/httpx here: per relayed token the router does one recv and one send;
everything else is overhead, and a general client's per-chunk machinery (stream
readers, timers rescheduled per packet, payload objects) costs as much as the kernel
work (docs/facts.md §3). This client does only what the router needs: POST a JSON body,
wait for the status and headers, then read the body whole or as it arrives. The pool of
keep-alive connections is :mod:`pd_router.upstream.connections`.

Errors (mapped to :mod:`pd_router.errors` by :mod:`pd_router.upstream.calls`):
:class:`ConnectFailed` (nothing was answered: refused, reset or closed before the first
response byte), :class:`ReadTimeout` (no byte for ``read_timeout`` seconds) and
:class:`ResponseFailed` (a malformed answer or a connection lost mid-answer).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, NamedTuple, Protocol

import httptools

from pd_net.tcp import DeadPeer, detect_dead_peer_on

_HIGH_WATER = 1 << 20  # pause reading the upstream while this much is buffered
_LOW_WATER = 1 << 16


class Origin(NamedTuple):
    host: str
    port: int
    tls: bool = False

    @property
    def authority(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.authority}"


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    pass


class ReadTimeout(UpstreamError):
    pass


class ResponseFailed(UpstreamError):
    pass


class IdleConnections(Protocol):
    """Where a connection goes back when its answer was read whole
    (:class:`pd_router.upstream.connections.ConnectionPool`)."""

    dead_peer: DeadPeer | None

    def put(self, conn: _Connection) -> None: ...


class Sink(Protocol):
    """Takes a streamed answer's body chunks in the connection's callback, instead of the reader."""

    def take(self, chunk: bytes) -> bool:
        """True: taken; False: declined (buffered for the reader, with every chunk after it
        until the reader has them all, so that order holds)."""
        ...

    def flush(self) -> None:
        """Called once after each read from the socket that gave it chunks (one read can hold
        several: the sink may write them as one)."""
        ...


class Response:
    """One upstream answer: ``status`` and ``headers`` (lower-case names), then the body
    via :meth:`read` or ``async for chunk in response``. Always end with :meth:`release`."""

    def __init__(self, conn: _Connection, read_timeout: float | None) -> None:
        self._conn = conn
        self._timeout = read_timeout
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._headers_done = False
        self._complete = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.got_bytes = False
        self.keep_alive = False
        self._watchdog: asyncio.TimerHandle | None = None
        # takes body chunks as they arrive, in the protocol's callback (see :class:`Sink`); the
        # reader is then woken only for what it declined, the end of the answer or a failure
        self.sink: Sink | None = None

    # producer side (called by the protocol)
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if not self._complete and self._error is None:
            self._error = error
            self._wake()

    # consumer side
    async def _wait(self) -> None:
        loop = self._conn.loop
        self._waiter = waiter = loop.create_future()
        if self._timeout and self._watchdog is None:
            # one timer per answer, re-armed every read_timeout, instead of one per wait
            # (a timer costs ~10 us on uvloop, more than relaying the token it guards)
            self._watchdog = loop.call_later(self._timeout, self._watch)
        try:
            await waiter
        finally:
            self._waiter = None

    def _watch(self) -> None:
        """Fail the answer if the reader has been waiting on a silent upstream for
        ``read_timeout`` seconds; else look again when that could first be true."""
        self._watchdog = None
        if self._complete or self._error is not None or self._timeout is None:
            return
        silent = time.monotonic() - self._conn.last_data
        if self._waiter is not None and not self._conn.paused and silent >= self._timeout:
            self._fail(ReadTimeout(f"no data from {self._conn.origin} for {self._timeout:g}s"))
            return
        delay = self._timeout - silent if silent < self._timeout else self._timeout
        self._watchdog = self._conn.loop.call_later(delay, self._watch)

    def _stop_watch(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    async def wait_headers(self) -> None:
        while not self._headers_done:
            if self._error is not None:
                raise self._error
            await self._wait()

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._chunks:
                chunks = self._chunks
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                self._chunks = []
                if self._buffered > _LOW_WATER and self._conn.paused:
                    self._conn.resume()
                self._buffered = 0
                return data
            if self._complete:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error
            await self._wait()

    @property
    def read_timeout(self) -> float | None:
        return self._timeout

    @read_timeout.setter
    def read_timeout(self, seconds: float | None) -> None:
        """(A watchdog running looks again at once when the new value is shorter, else at its next look.)"""
        shorter = seconds is not None and (self._timeout is None or seconds < self._timeout)
        self._timeout = seconds
        if shorter and self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = self._conn.loop.call_later(0, self._watch)

    def unread(self, chunk: bytes) -> None:
        """Put a chunk the reader took back in front of the body (read first again)."""
        if chunk:
            self._chunks.insert(0, chunk)
            self._buffered += len(chunk)

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    def release(self) -> None:
        """Back to the pool if the answer was read whole and the connection may be reused."""
        self._conn.finish(self, reusable=self._complete and self._error is None and self.keep_alive)

    def close(self) -> None:
        self._conn.finish(self, reusable=False)


class _Connection(asyncio.Protocol):
    def __init__(self, pool: IdleConnections, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        self.last_data = 0.0  # time.monotonic() of the last byte received (or of the last request sent)
        self.uses = 0

    # asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        detect_dead_peer_on(transport, self.pool.dead_peer)

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None:  # bytes nobody asked for: this connection cannot be trusted
            self.abort()
            return
        resp.got_bytes = True
        self.last_data = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp._fail(ResponseFailed(f"malformed answer from {self.origin}: {exc}"))
            self.abort()
        finally:
            sink = resp.sink
            if sink is not None:
                sink.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp = self.response
        if resp is not None:
            why = f": {exc}" if exc else ""
            resp._fail(
                ResponseFailed(f"{self.origin} closed the connection mid-answer{why}")
                if resp.got_bytes
                else ConnectFailed(f"{self.origin} closed the connection before answering{why}")
            )

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        resp = self.response
        if resp is not None:
            resp.status = self.parser.get_status_code()
            resp._headers_done = True
            resp._wake()

    def on_body(self, body: bytes) -> None:
        resp = self.response
        if resp is not None:
            sink = resp.sink
            if sink is not None and not resp._chunks and sink.take(body):  # nothing buffered before it: in order
                return
            resp._chunks.append(body)
            resp._buffered += len(body)
            if resp._buffered > _HIGH_WATER and not self.paused and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()
            resp._wake()

    def on_message_complete(self) -> None:
        resp = self.response
        if resp is not None:
            resp._complete = True
            resp.keep_alive = self.parser.should_keep_alive()  # must be asked now: the parser resets after
            resp._wake()

    # used by Response / ConnectionPool
    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def send(self, head: bytes, body: bytes, read_timeout: float | None) -> Response:
        self.response = resp = Response(self, read_timeout)
        self.last_data = time.monotonic()
        if self.transport is None or self.closed:
            resp._fail(ConnectFailed(f"connection to {self.origin} is closed"))
            return resp
        self.uses += 1
        self.transport.write(head + body)
        return resp

    def finish(self, resp: Response, reusable: bool) -> None:
        resp._stop_watch()
        if self.response is not resp:
            return
        self.response = None
        if reusable and not self.closed:
            if self.paused:
                self.resume()
            self.idle_since = self.loop.time()
            self.pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
