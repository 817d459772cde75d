"""Connection-level HTTP/1.1 limits on uvicorn's httptools protocol.

uvicorn's httptools protocol has no limit on the size or count of request headers and no
timeout before the headers are complete: one client sending an endless header keeps
httptools re-concatenating it (CPU quadratic in its length), and idle or slow connections
hold a file descriptor each for as long as they like. :func:`limited_protocol` returns a
subclass of uvicorn's protocol that

- counts the bytes of each request head as they arrive, before httptools parses them, and
  answers ``431`` once ``max_header_bytes`` is passed (the cost is linear in what was read);
- answers ``431`` past ``max_headers`` header lines;
- closes a connection whose request head is not complete ``header_timeout`` seconds after
  the connection opened or the head began (``408`` if part of a head arrived);
- answers ``503`` with ``Retry-After`` to a connection beyond ``max_connections``;

and gives each request a :class:`~pd_http.chunk_writer.ChunkWriter` (the scope's
``extensions``), which a relay of a token stream writes its chunks through.

Between requests, uvicorn's own ``timeout_keep_alive`` closes idle connections; the body
is the application's to time (``pd_router.asgi.read_body``). Refusals carry the
application's own JSON error body (``error_body``) and ``Connection: close``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pd_http.chunk_writer import EXTENSION, ChunkWriter
from pd_net.tcp import DeadPeer, detect_dead_peer_on

ErrorBody = Callable[[int, str, str], bytes]  # (status, error type, message) -> JSON body


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 16 * 1024
    max_headers: int = 100
    header_timeout: float = 10.0
    max_connections: int = 1024
    retry_after: int = 1  # seconds, on the 503 past max_connections
    dead_peer: DeadPeer | None = None  # a client that vanished from the network is given up within its bound


class _Refused(Exception):
    """Raised inside an httptools callback to stop parsing a refused request."""


def limited_protocol(limits: HttpLimits, error_body: ErrorBody) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``limits`` (pass as ``uvicorn.Config(http=...)``)."""

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True  # reading a request head (the first, or the next on keep-alive)
            self._head_bytes = 0
            self._head_lines = 0
            self._tail = b""  # the last 3 bytes seen, to find a CRLFCRLF split across reads
            self._head_timer: asyncio.TimerHandle | None = None
            self._refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            detect_dead_peer_on(transport, limits.dead_peer)
            if len(self.connections) > limits.max_connections:
                self._refuse(
                    503,
                    "service_unavailable",
                    f"too many open connections (max_connections {limits.max_connections}); retry later",
                    retry_after=limits.retry_after,
                )
                return
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head:
                if self._head_timer is None:
                    self._arm_head_timer()
                seen = self._tail + data
                end = seen.find(b"\r\n\r\n")
                self._head_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._tail))
                if self._head_bytes > limits.max_header_bytes:
                    self._refuse(
                        431,
                        "invalid_request_error",
                        f"request headers exceed {limits.max_header_bytes} bytes (max_header_bytes)",
                    )
                    return
                self._tail = seen[-3:]
            super().data_received(data)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_lines += 1
            if self._head_lines > limits.max_headers:
                self._refuse(
                    431, "invalid_request_error", f"more than {limits.max_headers} request headers (max_headers)"
                )
                raise _Refused
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._head_bytes = self._head_lines = 0
            self._tail = b""
            self._disarm_head_timer()
            scope = self.scope
            super().on_headers_complete()
            cycle = self.cycle
            writer = ChunkWriter.of(cycle) if cycle is not None and cycle.scope is scope else None
            if writer is not None:  # a new request (not an upgrade) on a cycle the writer knows
                extensions: dict[str, Any] = scope.setdefault("extensions", {})
                extensions[EXTENSION] = writer

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head = True  # what follows on this connection is the next request's head

        def send_400_response(self, msg: str) -> None:
            if not self._refused:  # a refusal already answered (the parser then reports the raise)
                super().send_400_response(msg)

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            self._head_timer = self.loop.call_later(limits.header_timeout, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._refused or self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a response is still being written on this connection: it ends it
            if self._head_bytes == 0:
                self._refused = True
                self.transport.close()  # an idle connection: nothing to answer
                return
            self._refuse(
                408,
                "invalid_request_error",
                f"request headers not complete within {limits.header_timeout:g}s (header_timeout)",
            )

        def _refuse(self, status: int, error_type: str, message: str, retry_after: int | None = None) -> None:
            self._refused = True
            self._disarm_head_timer()
            if self.transport.is_closing():
                return
            body = error_body(status, error_type, message)
            lines = [
                f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
                "content-type: application/json",
                f"content-length: {len(body)}",
                "connection: close",
            ]
            if retry_after is not None:
                lines.append(f"retry-after: {retry_after}")
            self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body)
            self.transport.close()

    return LimitedHttpToolsProtocol
