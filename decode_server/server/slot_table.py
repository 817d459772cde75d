"""Decode slots: how many sequences run at once (``--slots``; 1 for TileRT), held through
the lease table (:mod:`decode_server.server.leases`, the one count of free slots), and the
in-flight registry by request id used by the cancel endpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decode_server.server.api_errors import ApiError, Busy, Conflict, NotReady
from decode_server.server.leases import LeaseRefused, LeaseTable
from pd_wire.handoff import SlotWait


def refusal_error(exc: LeaseRefused, param: str = "lease_id") -> ApiError:
    """The answer to a refused slot request: 409 (the id is held or queued here, ``param``
    names it), 503 (draining), else 429."""
    if exc.reason == "duplicate":
        return Conflict(exc.message, param)
    if exc.reason == "closed":
        return NotReady(exc.message)
    return Busy(exc.message)


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
        self._check_new(request_id)
        index = self.leases.take(lease_id, "job")
        if index is None:
            raise Busy(f"all {self.capacity} decode slots are busy or leased; retry later (or lease one: "
                       "POST /v1/pd/lease)")
        self._jobs[request_id] = job
        return Slot(index, request_id, lease_id)

    async def wait(self, request_id: str, job: Any, lease_id: str, queue: SlotWait) -> Slot:
        """The slot of a decode request that holds it itself, after a wait in the queue as
        ``queue`` says (:meth:`LeaseTable.acquire`, the job as its holder); refusals raised as
        their answers (:func:`refusal_error`). Cancelling it leaves the queue."""
        self._check_new(request_id)
        try:
            index = await self.leases.acquire(lease_id, queue.wait_s, queue.holder, queue.arrived_at, queue.sent_at,
                                              queue.replaces, kind="job")
        except LeaseRefused as exc:
            raise refusal_error(exc, "kv_transfer_params.handoff_id") from None
        if request_id in self._jobs:  # the same request id came again while this one waited
            self.leases.put(lease_id, "job")
            self._check_new(request_id)
        self._jobs[request_id] = job
        return Slot(index, request_id, lease_id)

    def _check_new(self, request_id: str) -> None:
        if request_id in self._jobs:
            raise Conflict(f"request id {request_id!r} is already in flight on this decode server", "X-Request-Id")

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
