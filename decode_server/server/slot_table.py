"""Decode slots: how many sequences run at once (``--slots``; 1 for TileRT), held through
the lease table (:mod:`decode_server.server.leases`, the one count of free slots), and the
in-flight registry by request id used by the cancel endpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decode_server.server.api_errors import Busy, Conflict
from decode_server.server.leases import LeaseTable


@dataclass(eq=False)
class Slot:
    index: int
    request_id: str
    lease_id: str  # the handoff id: the generation's hold on its lease's slot
    released: bool = False


class SlotManager:
    """Not thread-safe: used from the event loop only (workers hand back through it)."""

    def __init__(self, leases: LeaseTable) -> None:
        self.leases = leases
        self.capacity = leases.capacity
        self._jobs: dict[str, Any] = {}

    @property
    def busy(self) -> int:
        return self.leases.busy

    def acquire(self, request_id: str, job: Any, lease_id: str) -> Slot:
        """The slot of the lease ``lease_id`` (the request's handoff id): leased by the router,
        or taken now if one is free and nobody waits for one."""
        if request_id in self._jobs:
            raise Conflict(f"request id {request_id!r} is already in flight on this decode server", "X-Request-Id")
        index = self.leases.take(lease_id, "job")
        if index is None:
            raise Busy(f"all {self.capacity} decode slots are busy or leased; retry later (or lease one: "
                       "POST /v1/pd/lease)")
        self._jobs[request_id] = job
        return Slot(index, request_id, lease_id)

    def release(self, slot: Slot) -> None:
        """Idempotent. The generation's end also ends its lease."""
        if slot.released:
            return
        slot.released = True
        self._jobs.pop(slot.request_id, None)
        self.leases.put(slot.lease_id, "job")

    async def wait_idle(self) -> None:
        """Until no slot is held (leased, holding KV or generating)."""
        await self.leases.wait_idle()

    def job(self, request_id: str) -> Any | None:
        return self._jobs.get(request_id)

    def jobs(self) -> list[Any]:
        return list(self._jobs.values())
