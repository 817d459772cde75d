"""Decode slots: how many sequences run at once (``--slots``; 1 for TileRT), and
the in-flight registry by request id used by the cancel endpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decode_server.server.api_errors import Busy, Conflict


@dataclass(eq=False)
class Slot:
    index: int
    request_id: str
    released: bool = False


class SlotManager:
    """Not thread-safe: used from the event loop only (workers hand back through it)."""

    def __init__(self, slots: int) -> None:
        self.capacity = slots
        self._free = list(range(slots - 1, -1, -1))
        self._jobs: dict[str, Any] = {}

    @property
    def busy(self) -> int:
        return self.capacity - len(self._free)

    def acquire(self, request_id: str, job: Any) -> Slot:
        if request_id in self._jobs:
            raise Conflict(f"request id {request_id!r} is already in flight on this decode server", "X-Request-Id")
        if not self._free:
            raise Busy(f"all {self.capacity} decode slots are busy; retry later")
        self._jobs[request_id] = job
        return Slot(self._free.pop(), request_id)

    def release(self, slot: Slot) -> None:
        """Idempotent."""
        if slot.released:
            return
        slot.released = True
        self._free.append(slot.index)
        self._jobs.pop(slot.request_id, None)

    def job(self, request_id: str) -> Any | None:
        return self._jobs.get(request_id)

    def jobs(self) -> list[Any]:
        return list(self._jobs.values())
