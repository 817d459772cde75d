"""Scheduler side of :class:`connector.TileRTConnector` (runs in vLLM's engine-core process).

No torch and no NIXL here: this module only reads vLLM's request and scheduler-output
objects by attribute and builds :class:`connector.metadata.StepPlan` s.

Which requests: those whose ``kv_transfer_params`` validate as
:class:`connector.protocol.HandoffTarget`; every other request is left alone (no KV work,
``request_finished`` returns ``(False, None)``).

Nothing here waits on the network (vLLM runs these hooks on its engine loop, between the
forward passes of every user):

1. **Admission before scheduling.** ``on_new_request`` starts the request's admission
   at its decode server in the background (:class:`connector.admission.AdmissionClient`).
   Until the answer is there, ``get_num_new_matched_tokens`` answers ``None`` ("not yet"):
   vLLM keeps the request waiting and schedules the others. A refusal or a timeout is
   final: the request is then prefilled without KV work and answered ``failed`` with the
   refusal's ``reason`` ("busy": the router waits for a slot and tries again).
2. **Blocks and chunked prefill.** ``update_state_after_alloc`` tracks the request's blocks
   (and restarts it after a preemption); ``build_connector_meta`` follows its blocks and
   the tokens each step computes. The step whose range reaches the prompt's end is the
   *last* step: its :class:`connector.metadata.RequestWork` carries the admitted slot's
   offsets, and the workers gather every layer (as vLLM computes it, or at the end of the
   step) and post its WRITE.
3. **The answer.** With ``max_tokens=1`` vLLM finishes the request in the same step and
   calls ``request_finished`` right after the workers' ``wait_for_save``, which sent one
   :class:`connector.metadata.SendReport` per rank on a local datagram socket (vLLM's own
   worker->scheduler channel is a step late, see ``docs/connector_vllm.md``).
   ``request_finished`` reads what is there without waiting: ``failed`` if a rank failed,
   else ``pending`` (the KV is on its way; the decode server waits for its last layer and
   learns of a later failure from the sender's Abort) or ``sent`` (already landed), with
   the counts of layers gathered early and late. A target with ``result_with_kv`` also
   gets that result (unless failed) sent to its decode server, behind its Admit
   (:meth:`connector.admission.AdmissionClient.prefilled`): the first token with the KV.
4. **Blocks are held** (``request_finished`` returns True) for every request the workers
   were told about, until each worker lists it in ``get_finished``: once all its layers
   are copied into staging, or its handoff failed. A request that ends before its last
   step is aborted at the workers (next plan's ``aborted``) and at the decode server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from connector.admission import Admission, Admissions
from connector.metadata import ReportInbox, RequestWork, SendReport, StepPlan
from connector.prefix import NO_PREFIX, PREFIX_BLOCK_TOKENS, split_prompt
from pd_wire.handoff import FailureReason, HandoffResult, HandoffStatus, HandoffTarget

log = logging.getLogger(__name__)
# the longest prompt whose prefix an Admit offers (Admit.prefix holds at most 16384 block hashes)
MAX_PREFIX_TOKENS = 16384 * PREFIX_BLOCK_TOKENS


class ReportSource(Protocol):
    def drain(self) -> list[SendReport]: ...

    def close(self) -> None: ...


@dataclass
class _Tracked:
    target: HandoffTarget
    num_tokens: int
    admission: Admission | None = None  # None while under way
    allocated: bool = False  # vLLM gave it blocks once (a later alloc is a resumption)
    block_ids: list[int] = field(default_factory=list)
    sent_upto: int = 0  # tokens covered by plans so far
    announced: bool = False  # some plan named it: the workers hold state for it
    completed: bool = False  # the plan with its last range was issued
    error: str | None = None  # refused before any KV work
    reason: FailureReason = "internal"  # why, when error is set
    released: bool = False  # the decode server was told to free the slot


class ConnectorScheduler:
    def __init__(
        self,
        *,
        block_size: int,
        max_tokens: int,
        world_size: int,
        reports: ReportSource | None,
        admissions: Admissions,
        endpoint_allowed: Callable[[str], bool] | None = None,
    ) -> None:
        self.block_size = block_size
        # which kv_endpoints a request may name (ConnectorSettings.endpoint_allowed); None: any
        self._endpoint_allowed = endpoint_allowed
        self.max_tokens = max_tokens
        self.world_size = world_size
        self._reports = reports
        self._admissions = admissions
        self._tracked: dict[str, _Tracked] = {}
        self._held: set[str] = set()  # request_finished said True; waiting for finished_sending
        self._aborts: list[str] = []
        self._early_reports: dict[str, dict[int, SendReport]] = {}

    @classmethod
    def with_inbox(cls, address: str, **kw: Any) -> ConnectorScheduler:
        return cls(reports=ReportInbox(address), **kw)

    # -- vLLM hooks -------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        if request.request_id in self._tracked:
            return
        target = _handoff_target(request)
        if target is None:
            return
        tracked = self._tracked[request.request_id] = _Tracked(target, int(request.num_prompt_tokens))
        if tracked.num_tokens > self.max_tokens:
            tracked.error = (
                f"prompt of {tracked.num_tokens} tokens exceeds the connector's max_tokens {self.max_tokens}"
            )
            tracked.reason = "too_long"
            return
        if self._endpoint_allowed is not None and not self._endpoint_allowed(target.kv_endpoint):
            tracked.error = (f"kv_endpoint {target.kv_endpoint!r} is not one of this connector's decode_endpoints "
                             "(kv_connector_extra_config.decode_endpoints; none: loopback endpoints only)")
            tracked.reason = "rejected"
            log.warning("request %s: %s", request.request_id, tracked.error)
            return
        ids = request.prompt_token_ids[:tracked.num_tokens]
        prefix = split_prompt(ids) if len(ids) <= MAX_PREFIX_TOKENS else NO_PREFIX
        self._admissions.start(target.handoff_id, target.kv_endpoint, tracked.num_tokens, prefix)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Producer only: nothing is ever loaded. ``None`` (schedule it later) while the
        request's admission is under way."""
        self.on_new_request(request)  # vLLM calls it on arrival; a no-op then
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.error is not None or tracked.admission is not None:
            return 0, False
        admission = self._admissions.result(tracked.target.handoff_id)
        if admission is None:
            return None, False
        tracked.admission = admission
        if not admission.ok:
            tracked.error, tracked.reason = admission.error, admission.reason or "internal"
            log.warning("request %s: handoff %s not admitted: %s", request.request_id,
                        tracked.target.handoff_id, admission.error)
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        if tracked.allocated and not tracked.completed:
            tracked.sent_upto = 0  # resumed after preemption: gather everything again
        tracked.allocated = True
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
            self._release_admission(tracked, "the request finished before its prompt was computed")
            reason: FailureReason = tracked.reason if tracked.error else "cancelled"
            return False, _dumped(self._result(
                request, tracked, "failed", tracked.error or "request finished before its prompt was computed",
                reason,
            ))
        self._held.add(req_id)
        if not tracked.completed:
            self._aborts.append(req_id)
            self._release_admission(tracked, "the request finished before its prompt was computed")
            return True, _dumped(self._result(
                request, tracked, "failed", "request finished before its prompt was computed", "cancelled"
            ))
        outcome = self._outcome(req_id)
        if outcome[0] == "failed":  # a rank may not have been able to tell the decode server itself
            self._release_admission(tracked, outcome[1] or "the KV transfer failed")
        result = self._result(request, tracked, *outcome)
        if result is not None and outcome[0] != "failed" and tracked.target.result_with_kv:
            self._admissions.prefilled(result)  # the first token goes with the KV, not through the router
        return True, _dumped(result)

    def update_connector_output(self, finished_sending: set[str] | None) -> None:
        self._collect_reports()  # a failure reported with the request's release is acted on first
        for req_id in finished_sending or ():
            if req_id in self._held:
                self._held.discard(req_id)
                tracked = self._tracked.pop(req_id, None)
                if tracked is not None:
                    self._admissions.forget(tracked.target.handoff_id)
                self._early_reports.pop(req_id, None)

    def has_pending_block_frees(self) -> bool:
        return bool(self._held)

    def close(self) -> None:
        self._admissions.close()
        if self._reports is not None:
            self._reports.close()

    # -- introspection for tests --------------------------------------------------------

    def in_flight(self) -> dict[str, str]:
        """Requests still tracked (req id -> state); empty when nothing can leak."""
        return {req_id: ("held" if req_id in self._held else "tracked") for req_id in self._tracked}

    # -- internals ----------------------------------------------------------------------

    def _release_admission(self, tracked: _Tracked, reason: str) -> None:
        """The request ends without its KV: free the decode server's slot if it has (or may
        get) one. The Abort follows a pending Admit on the same channel."""
        handoff_id = tracked.target.handoff_id
        admission = tracked.admission or self._admissions.result(handoff_id)
        if tracked.error is None and (admission is None or admission.ok) and not tracked.released:
            tracked.released = True
            self._admissions.abort(handoff_id, tracked.target.kv_endpoint, reason)
        if not tracked.announced:
            self._admissions.forget(handoff_id)

    def _work_for(self, req_id: str, computed_before: int, num_scheduled: int) -> RequestWork | None:
        tracked = self._tracked[req_id]
        if tracked.completed or tracked.error is not None or num_scheduled <= 0:
            return None
        if tracked.admission is None:  # scheduled without asking us first: never by vLLM
            tracked.error, tracked.reason = "internal: scheduled before its admission was known", "internal"
            log.error("request %s: %s", req_id, tracked.error)
            self._release_admission(tracked, tracked.error)
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
            self._release_admission(tracked, tracked.error)
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
            offsets=tracked.admission.offsets if tracked.completed else None,
            reused=tracked.admission.reused if tracked.completed else 0,
        )

    def _collect_reports(self) -> None:
        if self._reports is None:
            return
        for report in self._reports.drain():
            tracked = self._tracked.get(report.req_id)
            if tracked is None:  # a straggler for a forgotten request is dropped
                continue
            self._early_reports.setdefault(report.req_id, {})[report.rank] = report
            if report.status == "failed" and report.req_id in self._held:  # failed after the answer
                self._release_admission(tracked, report.error or "the KV transfer failed")

    def _outcome(self, req_id: str) -> tuple[HandoffStatus, str | None, FailureReason | None, int | None, int | None]:
        """(status, error, reason, layers early, layers late) from the reports already there."""
        self._collect_reports()
        reports = self._early_reports.get(req_id, {})
        failed = [r for r in reports.values() if r.status == "failed"]
        if failed:
            error = "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
            return "failed", error, failed[0].reason or "internal", None, None
        if len(reports) < self.world_size:  # a rank's report is late: say nothing we don't know
            return "pending", None, None, None, None
        status: HandoffStatus = "sent" if all(r.status == "sent" for r in reports.values()) else "pending"
        return (status, None, None, sum(r.layers_early for r in reports.values()),
                sum(r.layers_late for r in reports.values()))

    @staticmethod
    def _result(request: Any, tracked: _Tracked, status: HandoffStatus, error: str | None,
                reason: FailureReason | None = None, layers_early: int | None = None,
                layers_late: int | None = None) -> HandoffResult | None:
        outputs = list(request.output_token_ids)
        if not outputs:
            return None  # nothing was generated: there is no response to carry a handoff
        return HandoffResult(
            handoff_id=tracked.target.handoff_id,
            kv_endpoint=tracked.target.kv_endpoint,
            num_prompt_tokens=tracked.num_tokens,
            first_token_id=outputs[0],
            last_prompt_token_id=request.prompt_token_ids[tracked.num_tokens - 1],
            status=status,
            error=error,
            reason=reason if status == "failed" else None,
            layers_early=layers_early,
            layers_late=layers_late,
        )


def _dumped(result: HandoffResult | None) -> dict[str, Any] | None:
    return None if result is None else result.model_dump(exclude_none=True)


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
