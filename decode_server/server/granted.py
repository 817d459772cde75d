"""The answer of a decode request that holds its slot (a ``HandoffClaim``; contract:
:mod:`pd_wire.decode`, "Slots").

Its 200 goes out as soon as the slot is taken, before the KV lands: the router learns at once
that this server is alive and the slot is the request's. What the generation sends afterwards
goes through :class:`GrantedSend`, which keeps the rest of the server's answer code as it is
for any request: a later response start is dropped (the status went out already); a refusal
(a start with an error status and its body) becomes the body's one ``event: pd-error``
(:class:`pd_wire.decode.DecodeRefusal`); everything else passes unchanged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pd_wire.decode import FREE_SLOTS_FIELD, DecodeRefusal
from pd_wire.errors import ErrorBody, ErrorDetail

Send = Callable[[dict[str, Any]], Awaitable[None]]


class GrantedSend:
    """An ASGI ``send`` for one granted answer. :meth:`start` sends the 200 (``headers``: the
    content type the answer will have, and the server's own headers)."""

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        self._send = send
        self._headers = headers
        self._status = 200  # of the start the answer code sent last
        self._refusal: list[bytes] = []

    async def start(self, free_slots: int) -> None:
        """The 200; ``free_slots``: the server's free slots after this grant (``FREE_SLOTS_HEADER``)."""
        await self._send({"type": "http.response.start", "status": 200,
                          "headers": [*self._headers, (FREE_SLOTS_FIELD, str(free_slots).encode())]})

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self._status = message["status"]
            return
        if message["type"] != "http.response.body" or self._status == 200:
            await self._send(message)
            return
        self._refusal.append(message.get("body", b""))
        if message.get("more_body"):
            return
        await self._send({"type": "http.response.body", "body": refusal_event(self._status, b"".join(self._refusal))})


def refusal_event(status: int, body: bytes) -> bytes:
    """The ``pd-error`` event of a refusal answered with ``status`` and the OpenAI error ``body``."""
    try:
        error = ErrorBody.model_validate_json(body).error
    except ValueError:
        error = ErrorDetail(message=body[:500].decode(errors="replace"), type="decode_error", code=status)
    return DecodeRefusal(status=status, error=error).event()
