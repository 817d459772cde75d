"""Pieces shared by the fake prefill and decode servers (see fake_backends)."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from pd_router.asgi import Receive, Scope, Send, read_body, respond

K = TypeVar("K", bound=BaseModel)


def error_body(message: str, status: int = 400) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "fake_error", "param": None, "code": status}}
    ).encode()


async def wait_or_disconnect(receive: Receive, delay: float) -> bool:
    """Sleep ``delay`` s; False if the client disconnected first."""
    watch = asyncio.ensure_future(receive())
    try:
        done, _ = await asyncio.wait({watch}, timeout=delay)
        return not (done and watch.result()["type"] == "http.disconnect")
    finally:
        watch.cancel()


async def wait_or_event(receive: Receive, event: asyncio.Event) -> bool:
    """Wait for ``event``; False if the client disconnected first (a body not yet read is read)."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watch, until = asyncio.ensure_future(disconnected()), asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({watch, until}, return_when=asyncio.FIRST_COMPLETED)
        return not watch.done()
    finally:
        watch.cancel()
        until.cancel()


@dataclass
class Records:
    requests: list[dict[str, Any]] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    cancel_handoffs: list[str] = field(default_factory=list)  # the handoff each cancel named
    disconnects: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # contract violations seen
    active: set[str] = field(default_factory=set)
    max_active: int = 0
    busy: list[str] = field(default_factory=list)  # requests answered 429: every slot taken
    swaps: list[str] = field(default_factory=list)  # the grants decode requests gave back (``replaces``)
    health: list[str] = field(default_factory=list)  # GET /health of a prefill fake: answered | held
    claims: list[str] = field(default_factory=list)  # decode requests naming only their handoff (HandoffClaim)
    closed_claims: list[str] = field(default_factory=list)  # their handoff ids, closed before the result came
    granted_first: list[str] = field(default_factory=list)  # claims (holding their slot): answered 200 at the take
    queued_claims: list[str] = field(default_factory=list)  # handoff ids of those that asked to wait (claim.wait)
    posted: list[dict[str, Any]] = field(default_factory=list)  # results the router posted (RESULT_PATH)

    def dump(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "cancels": self.cancels,
            "cancel_handoffs": self.cancel_handoffs,
            "disconnects": self.disconnects,
            "errors": self.errors,
            "active": sorted(self.active),
            "max_active": self.max_active,
            "busy": self.busy,
            "swaps": self.swaps,
            "health": self.health,
            "claims": self.claims,
            "closed_claims": self.closed_claims,
            "granted_first": self.granted_first,
            "queued_claims": self.queued_claims,
            "posted": self.posted,
        }


class FakeBase(Generic[K]):
    knobs: K

    def __init__(self) -> None:
        self.records = Records()
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, seen by the first request

    def hang(self, until: threading.Event, at_most_s: float = 60.0) -> None:
        """Stop this server's event loop until ``until`` is set (at most ``at_most_s``): as a
        SIGSTOPped process looks from the network, the kernel still accepts connections and
        acknowledges data, and nothing answers. Needs one request served before."""
        if self._loop is None:
            raise RuntimeError("hang(): the fake has served no request yet")
        self._loop.call_soon_threadsafe(until.wait, at_most_s)

    def _rid(self, scope: Scope) -> str:
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                return v.decode()
        self.records.errors.append("request without X-Request-Id")
        return "?"

    async def _control(self, scope: Scope, receive: Receive, send: Send) -> bool:
        self._loop = asyncio.get_running_loop()
        path = scope["path"]
        if path == "/fake/config":
            update = json.loads(await read_body(scope, receive, 1 << 20) or b"{}")
            self.knobs = type(self.knobs).model_validate({**self.knobs.model_dump(), **update})
        elif path == "/fake/records":
            await respond(send, 200, json.dumps(self.records.dump()).encode())
            return True
        elif path == "/fake/reset":
            self.records = Records()
        else:
            return False
        await respond(send, 200, b"{}")
        return True

    def _models(self) -> bytes:
        model = self.knobs.model  # type: ignore[attr-defined]
        return json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]}).encode()
