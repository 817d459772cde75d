"""Worker side of :class:`connector.TileRTConnector` (runs in each vLLM worker process).

The only user of :class:`connector.sender.KVSender`. Life of one handed-off request:

1. ``bind(plan)`` (before the forward): the first plan that names the request begins
   its handoff (handshake if needed, admission at the decode server, with timeouts);
   a refusal is reported to the scheduler side at once as "failed".
2. ``save_kv_layer`` in the request's *last* prefill step (the one computing its final
   prompt token): gather the prompt's KV of that layer out of vLLM's paged cache into
   ``Handoff.staging(layer)`` and ``post_layer(layer)`` at once, so the layer's WRITE
   overlaps the computation of the remaining layers (the MTP layer comes last, from
   the drafter's forward). Earlier chunks only compute into the paged cache; the whole
   prompt (prefix-cached tokens included) is gathered from the request's blocks in the
   last step.
3. ``wait_for_save`` (after the drafter, before the step's output goes back): wait for
   each of this step's handoffs (bounded by ``transfer_timeout_s``) and send one
   :class:`connector.metadata.SendReport` per handoff to the scheduler side
   (see :mod:`connector.scheduler` for why this channel).
4. ``get_finished``: a request listed in ``finished_req_ids`` whose handoff is settled
   (or aborted now) is returned in the first set, so vLLM frees its blocks.

With tensor parallelism every rank holds the same MLA KV; a
:class:`connector.layout.SenderPlan` gives each rank its share of the layers, every rank
reports, and the scheduler side answers "sent" only when all ranks did.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from connector.errors import AdmissionRefused, HandshakeRejected
from connector.keeper import HandshakeKeeper
from connector.layout import KVLayout, SenderPlan, gather_fp8_ds_mla, gather_pages, gather_tokens
from connector.metadata import RequestWork, SendReport, StepPlan
from connector.protocol import FailureReason
from connector.profiles import ModelProfile, ProfileMismatch, check_layers, observed_layout, scan_layers

if TYPE_CHECKING:
    import torch

    from connector.config import ConnectorSettings

log = logging.getLogger(__name__)
_REFUSALS = ("busy", "too_long", "cancelled", "duplicate", "unknown_peer")


class Handoff(Protocol):
    error: str | None

    def staging(self, layer: int) -> dict[str, torch.Tensor]: ...

    def post_layer(self, layer: int) -> None: ...

    def status(self) -> str: ...

    def wait(self, timeout: float) -> str: ...

    def abort(self, reason: str) -> None: ...


class Sender(Protocol):
    def connect(self, endpoint: str, timeout: float) -> None: ...

    def begin(self, endpoint: str, handoff_id: str, num_tokens: int, timeout: float) -> Handoff: ...

    def close(self) -> None: ...


SenderFactory = Callable[[str, KVLayout, int, SenderPlan], Sender]


class Reports(Protocol):
    def send(self, report: SendReport) -> bool: ...

    def close(self) -> None: ...


@dataclass
class _Send:
    work: RequestWork
    handoff: Handoff | None = None
    error: str | None = None
    posted: set[int] = field(default_factory=set)
    reported: bool = False
    t_step: float = 0.0  # perf_counter at bind of the last step
    t_last_post: float = 0.0


class ConnectorWorker:
    def __init__(
        self,
        *,
        settings: ConnectorSettings,
        profile: ModelProfile,
        rank: int,
        world_size: int,
        agent_name: str,
        max_tokens: int,
        sender_factory: SenderFactory,
        reports: Reports,
    ) -> None:
        self.settings = settings
        self.profile = profile
        self.plan = SenderPlan(world_size=world_size, rank=rank)
        self.agent_name = agent_name
        self.max_tokens = max_tokens
        self._sender_factory = sender_factory
        self._reports = reports
        self._sender: Sender | None = None
        self._layer_of: dict[str, int] = {}
        self._indexer: dict[int, torch.Tensor] = {}
        self._my_layers: frozenset[int] = frozenset()
        self._sends: dict[str, _Send] = {}
        self._active: list[_Send] = []
        self._keeper: HandshakeKeeper | None = None

    # -- start-up -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = scan_layers(list(kv_caches))
        mismatch: ProfileMismatch | None = None
        try:
            check_layers(layers, self.profile)
            for name in layers.mla:
                self._check_cache(name, kv_caches[name])
        except ProfileMismatch as exc:
            mismatch = exc
        layout = self.profile.layout if mismatch is None else observed_layout(layers, self.profile)
        self._sender = self._sender_factory(self.agent_name, layout, self.max_tokens, self.plan)
        rejected = self._handshake_all()
        if mismatch is not None or rejected is not None:
            self.shutdown()
            reasons = [str(e) for e in (mismatch, rejected) if e is not None]
            raise ProfileMismatch("; ".join(reasons))
        self._layer_of = {name: i for i, name in enumerate(layers.mla)}
        self._indexer = {i: kv_caches[name] for i, name in enumerate(layers.indexer) if name is not None}
        self._my_layers = frozenset(self.plan.layers(layout.num_layers))
        self._keeper = HandshakeKeeper(self._sender, self.settings.decode_endpoints,
                                       self.settings.handshake_interval_s, self.settings.handshake_timeout_s)
        self._keeper.start()
        log.info(
            "TileRTConnector worker rank %d: profile %s, %d layers (sends %d), layout %s",
            self.plan.rank,
            self.profile.name,
            layout.num_layers,
            len(self._my_layers),
            layout.fingerprint(),
        )

    def _check_cache(self, name: str, cache: torch.Tensor) -> None:
        cache = _paged_rows(cache)
        row_bytes = cache.shape[-1] * cache.element_size() if cache.dim() == 3 else -1
        if row_bytes != self.profile.mla_row_bytes or not cache.is_contiguous():
            raise ProfileMismatch(
                f"KV cache {name!r} is {tuple(cache.shape)} {cache.dtype} (contiguous={cache.is_contiguous()}); "
                f"profile {self.profile.name!r} expects contiguous [num_blocks, block_size, row] with "
                f"{self.profile.mla_row_bytes}-byte rows"
            )

    def _handshake_all(self) -> ProfileMismatch | None:
        assert self._sender is not None
        first: ProfileMismatch | None = None
        for endpoint in self.settings.decode_endpoints:
            try:
                self._sender.connect(endpoint, self.settings.handshake_timeout_s)
                log.info("KV handshake with %s: ok", endpoint)
            except HandshakeRejected as exc:
                log.error("KV handshake with %s rejected: %s", endpoint, exc)
                first = first or ProfileMismatch(
                    f"decode KV endpoint {endpoint} rejected the handshake: {exc}"
                )
            except Exception as exc:  # noqa: BLE001 - unreachable now is not fatal: retried per request
                log.warning("KV handshake with %s failed (will retry per request): %s", endpoint, exc)
        return first

    # -- per step -----------------------------------------------------------------------

    def bind(self, plan: StepPlan) -> None:
        for req_id in plan.aborted:
            send = self._sends.get(req_id)
            if send is not None:
                self._abort(send, "the request finished before its prompt was computed")
        self._active = []
        for work in plan.work:
            send = self._sends.get(work.req_id)
            if send is None:
                send = self._sends[work.req_id] = _Send(work)
                self._begin(send)
            send.work = work
            if work.last and not send.reported:
                send.posted = set()
                send.t_step = time.perf_counter()
                self._active.append(send)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        if not self._active:
            return
        layer = self._layer_of.get(layer_name)
        if layer is None or layer not in self._my_layers:
            return
        for send in self._active:
            if send.error is not None or send.handoff is None:
                continue
            try:
                self._gather(send.handoff.staging(layer), layer, _paged_rows(kv_layer), send.work)
                if kv_layer.is_cuda:
                    import torch

                    torch.cuda.current_stream(kv_layer.device).synchronize()
                send.handoff.post_layer(layer)
                send.posted.add(layer)
                send.t_last_post = time.perf_counter()
            except Exception as exc:  # noqa: BLE001 - any failure fails this handoff, not vLLM
                self._fail(send, f"layer {layer}: {type(exc).__name__}: {exc}", "internal")

    def wait_for_save(self) -> None:
        active, self._active = self._active, []
        for send in active:
            if send.reported:
                continue
            if send.error is None and send.handoff is not None:
                missing = sorted(self._my_layers - send.posted)
                if missing:
                    self._fail(send, f"layers {missing} were not saved in the prompt's last step", "internal")
                    continue
                try:
                    status = send.handoff.wait(self.settings.transfer_timeout_s)
                    error = send.handoff.error
                except Exception as exc:  # noqa: BLE001 - fails this handoff, not vLLM
                    status, error = "failed", f"{type(exc).__name__}: {exc}"
                if status != "sent":
                    self._fail(send, error or f"transfer ended {status!r}", "transfer")
                    continue
                _log_tail(send, time.perf_counter())
            self._report(send, "sent", None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        done = set()
        for req_id in finished_req_ids:
            send = self._sends.pop(req_id, None)
            if send is None:
                continue
            self._abort(send, "the request finished before its handoff completed")
            done.add(req_id)
        return (done or None), None

    def shutdown(self) -> None:
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None
        for send in list(self._sends.values()):
            self._abort(send, "the prefill connector is shutting down")
        self._sends.clear()
        if self._sender is not None:
            try:
                self._sender.close()
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                log.warning("closing the KV sender failed: %s", exc)
            self._sender = None

    def pending(self) -> dict[str, str]:
        """Requests this worker still holds state for (req id -> status); for leak checks."""
        return {
            req_id: (s.handoff.status() if s.handoff else (s.error and "failed") or "idle")
            for req_id, s in self._sends.items()
        }

    # -- internals ----------------------------------------------------------------------

    def _begin(self, send: _Send) -> None:
        if not self._my_layers or self._sender is None:
            return
        work = send.work
        try:
            self._sender.connect(work.kv_endpoint, self.settings.handshake_timeout_s)
            send.handoff = self._sender.begin(
                work.kv_endpoint, work.handoff_id, work.num_tokens, self.settings.admission_timeout_s
            )
        except AdmissionRefused as exc:
            self._fail(send, f"{type(exc).__name__}: {exc}", exc.reason if exc.reason in _REFUSALS else "internal")
        except Exception as exc:  # noqa: BLE001 - a refused or broken handoff must not stop vLLM
            self._fail(send, f"{type(exc).__name__}: {exc}", "unreachable")

    def _gather(
        self, views: dict[str, torch.Tensor], layer: int, cache: torch.Tensor, work: RequestWork
    ) -> None:
        n, blocks = work.num_tokens, work.block_ids
        if self.profile.cache_format == "cpu_mla":
            gather_tokens(cache, blocks, n, views["kv"])
            return
        gather_fp8_ds_mla(cache, blocks, n, views["kv"], views["rope"])
        pages = views["indexer"].shape[0]
        gather_pages(self._indexer[layer], blocks, pages, views["indexer"])

    def _fail(self, send: _Send, error: str, reason: FailureReason) -> None:
        log.warning("handoff %s (request %s) failed: %s", send.work.handoff_id, send.work.req_id, error)
        _abort_quietly(send.handoff, error)
        send.error = error
        self._report(send, "failed", error, reason)

    def _abort(self, send: _Send, reason: str) -> None:
        _abort_quietly(send.handoff, reason)
        send.error = send.error or reason
        if send in self._active:
            self._active.remove(send)

    def _report(self, send: _Send, status: str, error: str | None, reason: FailureReason | None = None) -> None:
        if send.reported:
            return
        send.reported = True
        self._reports.send(
            SendReport(
                req_id=send.work.req_id,
                rank=self.plan.rank,
                status=status,  # type: ignore[arg-type]
                error=error,
                reason=reason,
            )
        )


def _log_tail(send: _Send, t_done: float) -> None:
    """One line per handoff: the prefill step up to the last layer, then the tail (last layer
    posted -> every WRITE of this rank landed). Parsed by bench/prefill_tail.py."""
    step_ms = (send.t_last_post - send.t_step) * 1e3
    tail_ms = (t_done - send.t_last_post) * 1e3
    log.info(
        "TileRT handoff %s: %d tokens, %d layers; step to last layer %.2f ms, tail %.3f ms (%.2f%%)",
        send.work.handoff_id,
        send.work.num_tokens,
        len(send.posted),
        step_ms,
        tail_ms,
        100.0 * tail_ms / step_ms if step_ms > 0 else 0.0,
    )


def _abort_quietly(handoff: Handoff | None, reason: str) -> None:
    """Abort a pending handoff; a failing abort (receiver gone) is logged, never raised into vLLM."""
    if handoff is None or handoff.status() != "pending":
        return
    try:
        handoff.abort(reason)
    except Exception as exc:  # noqa: BLE001
        log.warning("aborting handoff failed (%s): %s", reason, exc)


def _paged_rows(cache: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU MLA cache is ``[num_blocks, 1, block_size, row]`` (one latent "head"):
    view it as ``[num_blocks, block_size, row]``."""
    if cache.dim() == 4 and cache.shape[1] == 1:
        return cache.squeeze(1)
    return cache


def default_agent_name(engine_id: str, rank: int) -> str:
    import os
    import socket

    return f"tilert-prefill-{socket.gethostname()}-{os.getpid()}-{engine_id[:8]}-r{rank}"


def nixl_sender_factory(agent_name: str, layout: KVLayout, max_tokens: int, plan: SenderPlan,
                        lanes: int = 2, pin_lanes: bool = True) -> Any:
    from connector.sender import KVSender

    return KVSender(agent_name, layout, max_tokens, sender_plan=plan, transport="nixl", lanes=lanes,
                    pin_lanes=pin_lanes)
