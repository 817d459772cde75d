"""The two messages between the connector's scheduler side and its worker side.

* :class:`StepPlan` (scheduler -> workers, once per engine step, carried by vLLM inside
  ``SchedulerOutput.kv_connector_metadata``): for each handled request scheduled in this
  step, its blocks and the token range whose KV this step computes; plus the requests
  whose handoff must be aborted.
* :class:`SendReport` (worker rank -> scheduler, once per handoff, at the end of the
  step that computed the prompt's last token): "pending" (every layer posted or about to
  be), "sent" (already landed) or "failed", and how many layers were gathered early
  (``save_kv_layer``) and late (``wait_for_save`` or after). vLLM's own worker->scheduler
  channel cannot carry it in time (see :mod:`connector.scheduler`), so it travels as one
  datagram on a Unix socket that the scheduler side binds (:class:`ReportInbox`) and every
  worker rank writes to (:class:`ReportOutbox`), named after vLLM's ``engine_id`` so both
  sides agree without configuration. Datagrams on a local socket are reliable and ordered,
  and a worker sends its report before its step returns, so the scheduler has it when the
  step's output is processed.
"""

from __future__ import annotations

import logging
import socket
from collections import deque

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pd_wire.handoff import FailureReason, HandoffStatus

log = logging.getLogger(__name__)

_MAX_DATAGRAM = 64 * 1024
_MAX_ERROR_CHARS = 2000


class RequestWork(BaseModel):
    """One handled request in one step: gather tokens ``[start, end)`` of every layer."""

    model_config = ConfigDict(frozen=True)

    req_id: str
    handoff_id: str
    kv_endpoint: str
    num_tokens: int = Field(ge=1, description="prompt tokens handed off")
    block_ids: tuple[int, ...] = Field(description="the request's blocks, in token order (all so far)")
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    # offsets[layer][plane] in the decode server's receive buffer (its Admitted answer),
    # sent with the last step only
    offsets: tuple[tuple[int, ...], ...] | None = None
    # the prompt's leading tokens the decode server keeps (its Admitted answer): their KV is
    # not written; sent with the last step only
    reused: int = Field(default=0, ge=0)

    @property
    def last(self) -> bool:
        """This step computes the prompt's last token: post every layer, then finish the send."""
        return self.end >= self.num_tokens


class StepPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    work: tuple[RequestWork, ...] = ()
    aborted: tuple[str, ...] = Field(default=(), description="req ids whose handoff is to be aborted")

    def is_empty(self) -> bool:
        return not self.work and not self.aborted


class SendReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    req_id: str
    rank: int = Field(ge=0)
    status: HandoffStatus
    error: str | None = None
    reason: FailureReason | None = None
    layers_early: int = Field(default=0, ge=0)
    layers_late: int = Field(default=0, ge=0)


def report_address(engine_id: str, dp_rank: int = 0) -> str:
    """Abstract-namespace Unix socket name shared by the scheduler and its workers."""
    return f"\0tilert-connector-{engine_id}-dp{dp_rank}"


class ReportInbox:
    """Scheduler side: receives :class:`SendReport` datagrams without blocking."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(address)
        except OSError as exc:
            self._sock.close()
            raise RuntimeError(
                f"TileRTConnector: cannot bind its report socket {address.lstrip(chr(0))!r} ({exc}); "
                "another vLLM on this host uses the same kv_transfer_config.engine_id"
            ) from exc
        self._sock.setblocking(False)

    def drain(self) -> list[SendReport]:
        reports: list[SendReport] = []
        while True:
            try:
                data = self._sock.recv(_MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return reports
            except OSError:
                return reports
            try:
                reports.append(SendReport.model_validate_json(data))
            except ValidationError as exc:
                log.error("dropping a malformed send report (%d bytes): %s", len(data), exc)

    def close(self) -> None:
        self._sock.close()


class ReportOutbox:
    """Worker side: sends :class:`SendReport` datagrams to the scheduler's inbox.

    Never blocks: the inbox holds only a few datagrams (Linux ``net.unix.max_dgram_qlen``,
    10 by default) and the scheduler drains it only between steps, while it waits for this
    worker to finish the step. A blocking send past the queue's limit (more than ~10
    handoffs reported in one step) deadlocked the engine. Reports the queue has no room for
    wait here, in order, and go out at the next :meth:`send` or :meth:`flush` (the worker
    flushes every step, after the scheduler drained)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._backlog: deque[bytes] = deque()

    @property
    def backlog(self) -> int:
        return len(self._backlog)

    def send(self, report: SendReport) -> bool:
        """Queue ``report`` and send what the inbox has room for; False only if the inbox is gone."""
        if report.error and len(report.error) > _MAX_ERROR_CHARS:
            report = report.model_copy(update={"error": report.error[:_MAX_ERROR_CHARS] + "..."})
        self._backlog.append(report.model_dump_json().encode())
        return self.flush()

    def flush(self) -> bool:
        while self._backlog:
            try:
                self._sock.sendto(self._backlog[0], self.address)
            except (BlockingIOError, InterruptedError):
                return True  # the inbox is full: the rest goes out after the scheduler drained it
            except OSError as exc:
                log.error("cannot report %d handoff outcome(s) to the scheduler: %s", len(self._backlog), exc)
                self._backlog.clear()
                return False
            self._backlog.popleft()
        return True

    def close(self) -> None:
        self._sock.close()
