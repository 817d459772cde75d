"""An in-process stand-in for connector.receiver.KVReceiver (same API), for unit tests.

Handoffs complete when the test says so (``complete``/``fail``), or at once with
``auto_complete``. Thread-safe: tests drive it from their own thread while the
server's loop runs in another. ``held()`` lists handoffs not yet released (leak check).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

from connector.kv_errors import HandoffTimeout, TransferFailed
from connector.layout import KVLayout, plane_rows, torch_dtype
from connector.receiver import ReceivedKV, ReceiverStats
from pd_wire.handoff import HandoffResult, PeerStatus


def zero_kv(layout: KVLayout, num_tokens: int, handoff_id: str) -> ReceivedKV:
    """A prompt's KV of zeros in ``layout`` (a plane per layer, its rows as the receiver's
    views); without torch (the server tests also run on a torch-less Python 3.12), no planes."""
    try:
        import torch
    except ImportError:
        return ReceivedKV(handoff_id=handoff_id, num_tokens=num_tokens, layers=[{} for _ in range(layout.num_layers)])
    layers = [{p.name: torch.zeros(plane_rows(p, num_tokens), p.width, dtype=torch_dtype(p.dtype))
               for p in layout.planes} for _ in range(layout.num_layers)]
    return ReceivedKV(handoff_id=handoff_id, num_tokens=num_tokens, layers=layers)


class FakeReceiver:
    def __init__(self, layout: KVLayout, slots: int, max_tokens: int, auto_complete: bool = True,
                 num_tokens: int = 4) -> None:
        self.layout = layout
        self.slots = slots
        self.max_tokens = max_tokens
        self.auto_complete = auto_complete
        self.num_tokens = num_tokens
        self._lock = threading.Lock()
        self._done: dict[str, str | None] = {}  # handoff id -> None (complete) or failure reason
        self._held: set[str] = set()
        self._results: dict[str, HandoffResult] = {}  # from prefilled(): what a claim waits for too
        self.released: list[str] = []
        self.release_calls: list[str] = []  # every release(), also of handoffs it does not hold
        self.tombstoned: list[str] = []  # those releases that asked for a tombstone (the default)
        self.waits: list[str] = []
        self._listening = False
        self.stats = ReceiverStats()  # what the decode server's /metrics reads: stays at zero here

    async def start(self) -> None:
        self._listening = True

    async def stop(self) -> None:
        self._listening = False

    @property
    def endpoint(self) -> str:
        return "127.0.0.1:1"

    @property
    def fingerprint(self) -> str:
        return self.layout.fingerprint()

    @property
    def listening(self) -> bool:
        return self._listening

    def peers(self) -> list[PeerStatus]:
        return [PeerStatus(peer="fake-prefill", state="ok")]

    def use_slots(self, slots: object) -> None:
        """The decode server hands its slot table over; KV here is not bound to slots."""
        self.slot_source = slots

    def busy_slots(self) -> int:
        with self._lock:
            return len(self._held)

    def held(self) -> set[str]:
        with self._lock:
            return set(self._held)

    # test controls ------------------------------------------------------------
    def complete(self, handoff_id: str) -> None:
        with self._lock:
            self._done[handoff_id] = None

    def fail(self, handoff_id: str, reason: str = "sender aborted") -> None:
        with self._lock:
            self._done[handoff_id] = reason

    def prefilled(self, result: HandoffResult) -> None:
        """The prefill's result came over the KV channel (a claim's decode waits for it)."""
        with self._lock:
            self._results[result.handoff_id] = result

    async def post_result(self, result: HandoffResult) -> bool:
        """The router's posted result (as the real receiver: only for a handoff whose KV is here)."""
        with self._lock:
            if result.handoff_id not in self._held:
                return False
            self._results[result.handoff_id] = result
        return True

    def arrive(self, handoff_id: str) -> None:
        """The handoff's KV landed (prefill pushed it): it holds a receive slot until the
        decode server claims and releases it, as in the real receiver."""
        with self._lock:
            self._done[handoff_id] = None
            self._held.add(handoff_id)

    # receiver API ---------------------------------------------------------------
    def _kv(self, handoff_id: str) -> ReceivedKV:
        return zero_kv(self.layout, self.num_tokens, handoff_id)

    async def wait_for(self, handoff_id: str, timeout: float, with_result: bool = False) -> ReceivedKV:
        with self._lock:
            self._held.add(handoff_id)
            self.waits.append(handoff_id)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                state = self._done.get(handoff_id, "pending") if not self.auto_complete else self._done.get(handoff_id)
                result = self._results.get(handoff_id)
            if state is None and (result is not None or not with_result):
                return dataclasses.replace(self._kv(handoff_id), result=result)
            if state is not None and state != "pending":
                self.release(handoff_id)
                raise TransferFailed(f"handoff {handoff_id!r}: {state}")
            if time.monotonic() >= deadline:
                self.release(handoff_id)
                raise HandoffTimeout(f"handoff {handoff_id!r}: no KV after {timeout:g} s")
            await asyncio.sleep(0.005)

    def release(self, handoff_id: str, tombstone: bool = True) -> None:
        with self._lock:
            self.release_calls.append(handoff_id)
            if tombstone:  # (the real receiver then refuses that id's KV for a while, if it holds none)
                self.tombstoned.append(handoff_id)
            if handoff_id in self._held:
                self._held.discard(handoff_id)
                self.released.append(handoff_id)
