"""Keep-alive connections to the upstreams, per origin, for :mod:`pd_router.upstream.rawhttp`."""

from __future__ import annotations

import asyncio
import ssl
from collections import deque

from pd_net.tcp import DeadPeer
from pd_router.upstream.rawhttp import ConnectFailed, Origin, Response, _Connection


class ConnectionPool:
    """Keep-alive connections per upstream origin (LIFO, idle ones dropped after
    ``idle_ttl`` seconds, below the usual 5 s server keep-alive)."""

    def __init__(self, connect_timeout: float = 5.0, idle_ttl: float = 2.0, dead_peer: DeadPeer | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.idle_ttl = idle_ttl
        self.dead_peer = dead_peer  # a vanished upstream fails its answer within dead_peer.bound_s
        self._tls: ssl.SSLContext | None = None
        self._idle: dict[Origin, deque[_Connection]] = {}

    def put(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.origin, deque())
        idle.append(conn)
        # the oldest idle connections sit at the left: drop those past their time
        while idle and (idle[0].closed or conn.idle_since - idle[0].idle_since >= self.idle_ttl):
            idle.popleft().abort()

    async def _acquire(self, origin: Origin) -> _Connection:
        idle = self._idle.get(origin)
        if idle:
            now = asyncio.get_running_loop().time()
            while idle:
                conn = idle.pop()
                if not conn.closed and now - conn.idle_since < self.idle_ttl:
                    return conn
                conn.abort()
        loop = asyncio.get_running_loop()
        if origin.tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=self._tls if origin.tls else None,
                )
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {origin}: {exc or type(exc).__name__}") from None
        return conn

    async def post(
        self,
        origin: Origin,
        path: str,
        body: bytes,
        headers: dict[str, str],
        read_timeout: float | None = None,
    ) -> Response:
        """POST ``body`` (JSON); returns once the status and headers arrived."""
        head = "".join(
            [
                f"POST {path} HTTP/1.1\r\nHost: {origin.authority}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n",
                *(f"{k}: {v}\r\n" for k, v in headers.items()),
                "\r\n",
            ]
        ).encode("latin-1")
        retried = False
        while True:
            conn = await self._acquire(origin)
            reused = conn.uses > 0
            resp = conn.send(head, body, read_timeout)
            try:
                await resp.wait_headers()
                return resp
            except ConnectFailed:
                resp.close()
                if not reused or retried:
                    raise
                retried = True  # a pooled connection the server had just closed: once more, fresh
            except BaseException:
                resp.close()
                raise

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
