"""Scheduler side of :class:`connector.TileRTConnector` (runs in vLLM's engine-core process).

No torch and no NIXL here: this module only reads vLLM's request and scheduler-output
objects by attribute and builds :class:`connector.metadata.StepPlan` s.

Which requests: those whose ``kv_transfer_params`` validate as
:class:`connector.protocol.HandoffTarget`; every other request is left alone (no KV work,
``request_finished`` returns ``(False, None)``).

Blocks and chunked prefill: ``update_state_after_alloc`` starts tracking a request (and
restarts it after a preemption); ``build_connector_meta`` follows its blocks (new, added,
or replaced on resumption) and the tokens each step computes, and tells the workers to
gather ``[start, end)`` of every layer. The first range starts at 0, so prefix-cached
tokens are gathered too. The step whose range reaches the prompt's end is the *last*
step: the workers post every layer as soon as it is computed.

How ``request_finished`` knows the transfer's outcome (the decision): with
``max_tokens=1`` (what the router sends), vLLM finishes the request in the
``update_from_output`` of the very step that computed its last layer, and calls
``request_finished`` *before* it hands that step's ``kv_connector_output`` to
``update_connector_output``. Worse, with MTP (speculative decoding) the model runner
builds ``kv_connector_output`` (``get_finished``, ``build_connector_worker_meta``)
before the drafter's forward and before ``wait_for_save``, so vLLM's own
worker->scheduler channel is always at least one step too late to say "sent" or
"failed" in the HTTP response. Therefore:

1. each worker finishes that step's sends inside ``wait_for_save`` (``Handoff.wait``,
   bounded by ``transfer_timeout_s``); ``wait_for_save`` runs before the step's output
   is returned to the scheduler;
2. before returning, it sends a :class:`connector.metadata.SendReport` per handoff on a
   local datagram socket that this side binds (named after vLLM's ``engine_id``);
3. ``request_finished`` drains that socket (waiting at most ``report_grace_s`` for a
   rank that has not reported, which does not happen unless a worker died) and answers
   ``status: "sent"`` only when every rank reported "sent"; otherwise ``"failed"`` with
   the error.

Blocks: ``request_finished`` returns ``True`` for every request the workers were told
about, so vLLM holds its blocks until each worker lists it in ``get_finished``'s first
set; workers do so as soon as the request id appears in ``finished_req_ids`` (one step
later) and their handoff is settled (sent, failed, or aborted now). Requests aborted
mid-prefill are listed in the next plan's ``aborted`` so the workers abort their handoff
(the receiver is told and frees its slot). Requests the workers never saw (aborted while
waiting, too long) are freed at once. Nothing is held on a worker's say-so alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from connector.metadata import ReportInbox, RequestWork, SendReport, StepPlan
from connector.protocol import FailureReason, HandoffResult, HandoffTarget

log = logging.getLogger(__name__)


class ReportSource(Protocol):
    def drain(self) -> list[SendReport]: ...

    def wait_readable(self, timeout: float) -> bool: ...

    def close(self) -> None: ...


@dataclass
class _Tracked:
    target: HandoffTarget
    num_tokens: int
    block_ids: list[int] = field(default_factory=list)
    sent_upto: int = 0  # tokens covered by plans so far
    announced: bool = False  # some plan named it: the workers hold state for it
    completed: bool = False  # the plan with its last range was issued
    error: str | None = None  # refused before any KV work
    reason: FailureReason = "internal"  # why, when error is set
    reports: dict[int, SendReport] = field(default_factory=dict)


class ConnectorScheduler:
    def __init__(
        self,
        *,
        block_size: int,
        max_tokens: int,
        world_size: int,
        reports: ReportSource | None,
        report_grace_s: float = 2.0,
    ) -> None:
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.world_size = world_size
        self._reports = reports
        self._report_grace_s = report_grace_s
        self._tracked: dict[str, _Tracked] = {}
        self._held: set[str] = set()  # request_finished said True; waiting for finished_sending
        self._aborts: list[str] = []
        self._early_reports: dict[str, dict[int, SendReport]] = {}

    @classmethod
    def with_inbox(cls, address: str, **kw: Any) -> ConnectorScheduler:
        return cls(reports=ReportInbox(address), **kw)

    # -- vLLM hooks -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # producer only: nothing is ever loaded

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        req_id = request.request_id
        tracked = self._tracked.get(req_id)
        if tracked is None:
            target = _handoff_target(request)
            if target is None:
                return
            num_tokens = int(request.num_prompt_tokens)
            tracked = _Tracked(target, num_tokens)
            if num_tokens > self.max_tokens:
                tracked.error = (
                    f"prompt of {num_tokens} tokens exceeds the connector's max_tokens {self.max_tokens}"
                )
                tracked.reason = "too_long"
            self._tracked[req_id] = tracked
        elif not tracked.completed:
            tracked.sent_upto = 0  # resumed after preemption: gather everything again
        tracked.block_ids = list(block_ids)

    def build_step(self, scheduler_output: Any) -> StepPlan:
        self._collect_reports()
        scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        computed_before: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                computed_before[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed and new_blocks is not None:
                tracked.block_ids = list(new_blocks[0])
            elif new_blocks is not None:
                tracked.block_ids.extend(new_blocks[0])
            computed_before[req_id] = cached.num_computed_tokens[i]
        work = [
            w
            for req_id, before in computed_before.items()
            if (w := self._work_for(req_id, before, scheduled.get(req_id, 0))) is not None
        ]
        aborted, self._aborts = tuple(self._aborts), []
        return StepPlan(work=tuple(work), aborted=aborted)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        tracked = self._tracked.get(req_id)
        if tracked is None:
            return False, None
        if not tracked.announced:
            del self._tracked[req_id]
            return False, self._result(
                request, tracked, "failed", tracked.error or "request finished before its prompt was computed",
                tracked.reason,
            )
        self._held.add(req_id)
        if not tracked.completed:
            self._aborts.append(req_id)
            return True, self._result(
                request, tracked, "failed", "request finished before its prompt was computed", "cancelled"
            )
        status, error, reason = self._outcome(req_id, tracked)
        return True, self._result(request, tracked, status, error, reason)

    def update_connector_output(self, finished_sending: set[str] | None) -> None:
        for req_id in finished_sending or ():
            if req_id in self._held:
                self._held.discard(req_id)
                self._tracked.pop(req_id, None)
                self._early_reports.pop(req_id, None)

    def has_pending_block_frees(self) -> bool:
        return bool(self._held)

    def close(self) -> None:
        if self._reports is not None:
            self._reports.close()

    # -- introspection for tests --------------------------------------------------------

    def in_flight(self) -> dict[str, str]:
        """Requests still tracked (req id -> state); empty when nothing can leak."""
        return {req_id: ("held" if req_id in self._held else "tracked") for req_id in self._tracked}

    # -- internals ----------------------------------------------------------------------

    def _work_for(self, req_id: str, computed_before: int, num_scheduled: int) -> RequestWork | None:
        tracked = self._tracked[req_id]
        if tracked.completed or tracked.error is not None or num_scheduled <= 0:
            return None
        end = min(computed_before + num_scheduled, tracked.num_tokens)
        start = min(tracked.sent_upto, computed_before)
        if end <= start:
            return None
        needed_blocks = -(-end // self.block_size)
        if needed_blocks > len(tracked.block_ids):
            tracked.error = (
                f"internal: {end} tokens need {needed_blocks} blocks of {self.block_size}, "
                f"vLLM gave {len(tracked.block_ids)}"
            )
            log.error("request %s: %s", req_id, tracked.error)
            if tracked.announced:
                self._aborts.append(req_id)
            return None
        tracked.sent_upto = end
        tracked.announced = True
        tracked.completed = end >= tracked.num_tokens
        return RequestWork(
            req_id=req_id,
            handoff_id=tracked.target.handoff_id,
            kv_endpoint=tracked.target.kv_endpoint,
            num_tokens=tracked.num_tokens,
            block_ids=tuple(tracked.block_ids[:needed_blocks]),
            start=start,
            end=end,
        )

    def _collect_reports(self) -> None:
        if self._reports is None:
            return
        for report in self._reports.drain():
            if report.req_id in self._tracked:  # a straggler for a forgotten request is dropped
                self._early_reports.setdefault(report.req_id, {})[report.rank] = report

    def _outcome(self, req_id: str, tracked: _Tracked) -> tuple[str, str | None, FailureReason | None]:
        deadline = time.monotonic() + self._report_grace_s
        while True:
            self._collect_reports()
            reports = self._early_reports.get(req_id, {})
            failed = [r for r in reports.values() if r.status == "failed"]
            if failed:
                return ("failed", "; ".join(f"rank {r.rank}: {r.error}" for r in failed),
                        failed[0].reason or "internal")
            if len(reports) >= self.world_size:
                return "sent", None, None
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._reports is None or not self._reports.wait_readable(remaining):
                missing = sorted(set(range(self.world_size)) - set(reports))
                return (
                    "failed",
                    f"no transfer report from worker rank(s) {missing} within {self._report_grace_s}s",
                    "internal",
                )

    @staticmethod
    def _result(request: Any, tracked: _Tracked, status: str, error: str | None,
                reason: FailureReason | None = None) -> dict[str, Any] | None:
        outputs = list(request.output_token_ids)
        if not outputs:
            return None  # nothing was generated: there is no response to carry a handoff
        result = HandoffResult(
            handoff_id=tracked.target.handoff_id,
            kv_endpoint=tracked.target.kv_endpoint,
            num_prompt_tokens=tracked.num_tokens,
            first_token_id=outputs[0],
            last_prompt_token_id=request.prompt_token_ids[tracked.num_tokens - 1],
            status=status,
            error=error,
            reason=reason if status == "failed" else None,
        )  # type: ignore[arg-type]
        return result.model_dump(exclude_none=True)


def _handoff_target(request: Any) -> HandoffTarget | None:
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or "handoff_id" not in params:
        return None
    try:
        return HandoffTarget.model_validate(params)
    except ValidationError as exc:
        log.warning(
            "request %s: kv_transfer_params is not a handoff target, ignored: %s", request.request_id, exc
        )
        return None
