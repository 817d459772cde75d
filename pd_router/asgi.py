"""Small raw-ASGI helpers for the hot path (no framework on the completion routes)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pd_router.errors import BodyTooLarge, InvalidRequest, RequestTimeout

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = b"application/json"
SSE = b"text/event-stream"


def header(scope: Scope, name: bytes) -> bytes | None:
    """A request header (``name`` lower-case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def authorization(scope: Scope) -> bytes | None:
    """The request's API key as an ``Authorization`` header: that header, else Anthropic's
    ``x-api-key`` as a bearer token."""
    given = header(scope, b"authorization")
    if given is None and (key := header(scope, b"x-api-key")) is not None:
        return b"Bearer " + key
    return given


async def read_body(scope: Scope, receive: Receive, limit: int, timeout: float | None = None) -> bytes:
    """The request body, at most ``limit`` bytes (else 413), in at most ``timeout`` seconds
    (else 408: a client trickling its body holds a connection and a task)."""
    if timeout is None:
        return await _read_body(scope, receive, limit)
    try:
        async with asyncio.timeout(timeout):
            return await _read_body(scope, receive, limit)
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {timeout:g}s (--body-timeout)") from None


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    length = header(scope, b"content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise InvalidRequest("invalid Content-Length header") from None
        if declared > limit:
            raise BodyTooLarge(f"request body of {declared} bytes exceeds --max-body-bytes {limit}")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds --max-body-bytes {limit}")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


class StreamTranslator:
    """The base of an ASGI ``send`` wrapper that turns the chat route's SSE stream into another
    API's events: :meth:`_relay` hands each whole chat event (without its blank line) to
    :meth:`_chat_event` as the body's chunks arrive (an event may span chunks, a chunk hold
    several), and ends the body once the chat stream ended, unless :meth:`_end` did already."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._pending = bytearray()
        self._closed = False

    async def _chat_event(self, event: bytes) -> None:
        raise NotImplementedError

    async def _relay(self, data: bytes, more: bool) -> None:
        self._pending += data
        while b"\n\n" in self._pending:
            event, _, rest = bytes(self._pending).partition(b"\n\n")
            self._pending[:] = rest
            await self._chat_event(event)
        if not more:
            await self._end()

    async def _end(self) -> None:
        """End the body (once)."""
        if not self._closed:
            self._closed = True
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})
