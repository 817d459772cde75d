"""A decode server's slot held by the test, as another router's request holds it: a decode
request (a ``HandoffClaim``, waiting for a slot if none is free) whose answer stays open while
the block runs and whose KV never comes. Routers see that slot taken until the block ends (or
the decode server's ``--kv-timeout`` gives it up: the test's block must be shorter)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from pd_wire.decode import FREE_SLOTS_HEADER
from pd_wire.handoff import HandoffClaim, SlotWait


def _here(fn: Callable[[], Any]) -> Any:
    return fn()


@dataclass(frozen=True)
class HeldSlot:
    handoff_id: str
    free: int  # the server's free slots once this one was taken (its 200 said)


@contextmanager
def held_slot(url: str, api_key: str | None = None, on: Callable[[Callable[[], Any]], Any] = _here,
              wait_s: float = 30.0) -> Iterator[HeldSlot]:
    """A slot of the decode server at ``url`` taken by a decode request (waiting up to ``wait_s``
    for one), held until the block ends. ``on``: where the request is sent from (e.g.
    ``Node.call``: from a node of tests/nodes.py; the thread holding it is started there)."""
    handoff_id = f"test-holds-{uuid.uuid4().hex}"
    claim = HandoffClaim(handoff_id=handoff_id, result="with_kv", wait=SlotWait(wait_s=wait_s, holder="the test"))
    body = {"prompt": "held by the test", "max_tokens": 1, "kv_transfer_params": claim.model_dump(exclude_none=True)}
    headers = {"X-Request-Id": handoff_id} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    answered, done = threading.Event(), threading.Event()
    got: dict[str, Any] = {}

    def hold() -> None:
        try:
            with httpx.Client(timeout=wait_s + 10) as client, client.stream(
                    "POST", url + "/v1/completions", json=body, headers=headers) as resp:
                got["status"], got["free"] = resp.status_code, int(resp.headers.get(FREE_SLOTS_HEADER, "0"))
                if resp.status_code != 200:
                    got["text"] = resp.read().decode(errors="replace")
                answered.set()
                done.wait()  # the answer stays open: the slot stays the request's
        except httpx.HTTPError as exc:
            got.setdefault("status", 0)
            got["text"] = repr(exc)
            answered.set()

    def start() -> threading.Thread:
        thread = threading.Thread(target=hold, name=f"holding-a-slot-of-{url}", daemon=True)
        thread.start()
        return thread

    thread = on(start)
    try:
        assert answered.wait(wait_s + 15), f"{url} did not answer the decode request holding a slot"
        assert got["status"] == 200, f"{url} gave no slot: {got.get('status')} {got.get('text')}"
        yield HeldSlot(handoff_id, got["free"])
    finally:
        done.set()
        thread.join(15)
