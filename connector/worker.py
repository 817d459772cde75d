"""Worker side of :class:`connector.TileRTConnector` (runs in each vLLM worker process).

The only user of :class:`connector.sender.KVSender`. Nothing here waits on the network:
admission happened on the scheduler side before the request was scheduled
(:mod:`connector.admission`), handshakes run in the background
(:class:`connector.keeper.HandshakeKeeper`, or one started when a handoff needs it), WRITEs
are posted to sender lanes, and Aborts go out in the background. Life of one handed-off
request:

1. ``bind(plan)``: the step that computes the prompt's last token carries the admitted
   slot's offsets; the handoff is opened (a staging buffer taken, never waited for).
2. **Early path**: ``save_kv_layer`` (vLLM's CPU attention calls it after each layer):
   gather that layer's prompt KV out of vLLM's paged cache into ``staging(layer)`` and
   post it at once, so its WRITE overlaps the next layers' computation.
3. **Late path, guaranteed**: ``wait_for_save`` (after the MTP drafter, before the step's
   output goes back) gathers every layer of this rank not posted yet from the caches
   registered in ``register_kv_caches`` and posts them in one burst. vLLM 0.32's CUDA
   attention for GLM-5.1 never calls ``save_kv_layer``, so there every layer is late.
   Then one :class:`connector.metadata.SendReport` per handoff (pending/sent/failed, layers
   early and late) goes to the scheduler side without waiting for the WRITEs.
4. **Deferred**: a handoff that could not open (no staging buffer free, decode server not
   handshaken yet) is gathered in a later step, from the request's blocks, which vLLM
   holds until this worker reports the request in ``get_finished``; past
   ``transfer_timeout_s`` (counted from the end of the last step's forward pass, like every
   handoff's transfer deadline) it fails.
5. ``get_finished``: a request vLLM finished is returned in the first set (vLLM frees
   its blocks) as soon as every layer of this rank is copied into staging (the WRITEs
   read staging, not vLLM's cache), or its handoff failed or was aborted.

With tensor parallelism every rank holds the same MLA KV; a
:class:`connector.layout.SenderPlan` gives each rank its share of the layers, every rank
reports, and the scheduler side answers "failed" if any rank failed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, get_args

from connector.endpoints import DecodeEndpoints
from connector.keeper import HandshakeKeeper
from connector.kv_errors import AdmissionRefused, ControlChannelError, HandshakeRejected
from connector.layout import KVLayout, SenderPlan, gather_layer
from connector.metadata import RequestWork, SendReport, StepPlan
from connector.profiles import (
    ModelProfile,
    ProfileMismatch,
    cache_row_hint,
    check_layers,
    observed_layout,
    scan_layers,
)
from pd_wire.handoff import FailureReason

if TYPE_CHECKING:
    import torch

    from connector.config import ConnectorSettings

log = logging.getLogger(__name__)


class Handoff(Protocol):
    error: str | None
    deadline: float  # time.monotonic(); the sender aborts a handoff not fully written by then
    carrier: str  # once sent: what carried its WRITEs (e.g. the UCX transport "tcp/eth0")
    write_seconds: float | None  # once sent: its first WRITE posted to its last landed

    @property
    def nbytes(self) -> int: ...

    def staging(self, layer: int) -> dict[str, torch.Tensor]: ...

    def post_layers(self, layers: list[int]) -> None: ...

    def status(self) -> str: ...

    def abort(self, reason: str) -> None: ...


class Sender(Protocol):
    def connect(self, endpoint: str, timeout: float) -> None: ...

    def open(self, endpoint: str, handoff_id: str, num_tokens: int, offsets: Any,
             deadline: float, reused: int = 0) -> Handoff | None: ...

    def close(self) -> None: ...


# (agent name, layout, max_tokens, plan, staging device): staging lives where vLLM's caches
# do, VRAM registered with NIXL on GPUs (the gather lands with one on-device copy).
SenderFactory = Callable[[str, KVLayout, int, SenderPlan, str], Sender]


class Reports(Protocol):
    def send(self, report: SendReport) -> bool: ...

    def flush(self) -> bool: ...

    def close(self) -> None: ...


# vLLM's KV-connector stats (connector.vllm_stats): counters per step, summed over ranks and steps
STAT_COUNTERS = ("handoffs_posted", "handoffs_failed", "layers_early", "layers_late", "bytes_posted",
                 *(f"failed_{reason}" for reason in get_args(FailureReason)))
POST_SECONDS = "post_seconds"  # per handoff this rank gathered: its last step's start to its last layer posted
WRITES = "writes"  # per handoff this rank sent: [carrier, bytes, seconds from its first WRITE to its last landed]


def empty_stats() -> dict[str, Any]:
    return {**dict.fromkeys(STAT_COUNTERS, 0), POST_SECONDS: [], WRITES: []}


@dataclass
class _Send:
    work: RequestWork
    handoff: Handoff | None = None
    error: str | None = None
    early: set[int] = field(default_factory=set)  # posted from save_kv_layer
    late: set[int] = field(default_factory=set)  # posted from wait_for_save or a later step
    last_bound: bool = False  # the step computing the prompt's last token began
    gathered: bool = False  # every layer of this rank is in staging (vLLM's blocks may go)
    finished: bool = False  # vLLM finished the request: report it in get_finished when done
    reported: str = ""  # status last reported to the scheduler side
    reason: FailureReason = "internal"  # why, when error is set
    deadline: float = 0.0  # time.monotonic(): gathered and written by then, or failed
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
        self._caches: list[torch.Tensor] = []
        self._indexer: dict[int, torch.Tensor] = {}
        self._my_layers: frozenset[int] = frozenset()
        self._sends: dict[str, _Send] = {}
        self._active: list[_Send] = []
        # handoffs reported "pending" (their WRITEs in flight after their last step): their
        # WRITEs are counted in the stats of the step that finds them landed
        self._landing: list[Handoff] = []
        self._keeper: HandshakeKeeper | None = None
        self._layout: KVLayout | None = None
        self._stats = empty_stats()
        self._endpoints = DecodeEndpoints(settings)

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
        device = str(next(iter(kv_caches.values())).device) if kv_caches else "cpu"
        self._sender = self._sender_factory(self.agent_name, layout, self.max_tokens, self.plan, device)
        rejected = self._handshake_all()
        if mismatch is not None or rejected is not None:
            self.shutdown()
            reasons = [str(e) for e in (mismatch, rejected) if e is not None]
            raise ProfileMismatch("; ".join(reasons))
        self._layer_of = {name: i for i, name in enumerate(layers.mla)}
        self._caches = [kv_caches[name] for name in layers.mla]
        self._indexer = {i: kv_caches[name] for i, name in enumerate(layers.indexer) if name is not None}
        self._my_layers = frozenset(self.plan.layers(layout.num_layers))
        self._layout = layout
        listed = self._endpoints.refresh if self._endpoints.dynamic else self.settings.decode_endpoints
        self._keeper = HandshakeKeeper(self._sender, listed, self.settings.handshake_interval_s,
                                       self.settings.handshake_timeout_s)
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
            hint = cache_row_hint(row_bytes, self.profile)
            raise ProfileMismatch(
                f"KV cache {name!r} is {tuple(cache.shape)} {cache.dtype} (contiguous={cache.is_contiguous()}); "
                f"profile {self.profile.name!r} expects contiguous [num_blocks, block_size, row] with "
                f"{self.profile.mla_row_bytes}-byte rows" + (f"; {hint}" if hint else "")
            )

    def _handshake_all(self) -> ProfileMismatch | None:
        assert self._sender is not None
        first: ProfileMismatch | None = None
        for endpoint in self._endpoints.refresh():
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
            send.work = work
            if work.last and not send.last_bound and send.error is None:
                send.last_bound = True
                # the step's forward pass is not the transfer's to bound: the deadline starts
                # when the pass has ended (wait_for_save); a long prompt's last step (an 8k
                # prompt on a loaded CPU: tens of seconds) must not use it up
                send.deadline = math.inf
                send.t_step = time.perf_counter()
                self._active.append(send)
                self._open(send)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """The early path: post this layer's KV while vLLM computes the next layers."""
        if not self._active:
            return
        layer = self._layer_of.get(layer_name)
        if layer is None or layer not in self._my_layers:
            return
        for send in self._active:
            if send.error is not None or send.handoff is None or layer in send.early:
                continue
            try:
                self._gather(send.handoff.staging(layer), layer, _paged_rows(kv_layer), send.work)
                _synchronize(kv_layer)
                send.handoff.post_layers([layer])
                send.early.add(layer)
                send.t_last_post = time.perf_counter()
            except Exception as exc:  # noqa: BLE001 - any failure fails this handoff, not vLLM
                self._fail(send, f"layer {layer}: {type(exc).__name__}: {exc}", "internal")

    def wait_for_save(self) -> None:
        """The late path: every layer not posted yet, from the registered caches, in one burst;
        then report each handoff of this step without waiting for its WRITEs."""
        active, self._active = self._active, []
        deadline = time.monotonic() + self.settings.transfer_timeout_s
        for send in active:
            send.deadline = deadline
            if send.handoff is not None:
                send.handoff.deadline = deadline
            if send.error is None:
                self._open(send)
                self._gather_late(send)
            self._report(send)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        self._reports.flush()  # reports the scheduler's inbox had no room for in an earlier step
        for req_id in finished_req_ids:
            send = self._sends.get(req_id)
            if send is None:
                continue
            send.finished = True
            if not send.last_bound:
                self._abort(send, "the request finished before its prompt was computed")
        self._progress_deferred()
        self._count_landed()
        done = {req_id for req_id, send in self._sends.items()
                if send.finished and (send.error is not None or send.gathered)}
        for req_id in done:
            del self._sends[req_id]
        return (done or None), None

    def shutdown(self) -> None:
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None
        for send in list(self._sends.values()):
            self._abort(send, "the prefill connector is shutting down")
        self._sends.clear()
        self._landing.clear()
        if self._sender is not None:
            try:
                self._sender.close()
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                log.warning("closing the KV sender failed: %s", exc)
            self._sender = None

    def take_stats(self) -> dict[str, Any] | None:
        """Counters since the last call (vLLM's KV-connector stats), or None if nothing happened."""
        if not any(self._stats.values()):
            return None
        taken, self._stats = self._stats, empty_stats()
        return taken

    def pending(self) -> dict[str, str]:
        """Requests this worker still holds state for (req id -> status); for leak checks."""
        return {
            req_id: (s.handoff.status() if s.handoff else (s.error and "failed") or "idle")
            for req_id, s in self._sends.items()
        }

    # -- internals ----------------------------------------------------------------------

    def _open(self, send: _Send) -> None:
        """Take the handoff's staging buffer if it can be had now (never waits)."""
        if send.handoff is not None or send.error is not None or self._sender is None:
            return
        if not self._my_layers:
            send.gathered = True  # this rank sends no layer
            return
        work = send.work
        if work.offsets is None:
            self._fail(send, "internal: the last step carries no admitted offsets", "internal")
            return
        try:
            send.handoff = self._sender.open(work.kv_endpoint, work.handoff_id, work.num_tokens, work.offsets,
                                             send.deadline, work.reused)
        except AdmissionRefused as exc:
            self._fail(send, f"{type(exc).__name__}: {exc}", "too_long" if exc.reason == "too_long" else "internal")
        except ControlChannelError as exc:
            self._fail(send, f"{type(exc).__name__}: {exc}", "unreachable")
        except Exception as exc:  # noqa: BLE001 - a broken handoff must not stop vLLM
            self._fail(send, f"{type(exc).__name__}: {exc}", "internal")

    def _count_landed(self) -> None:
        """The WRITEs of handoffs reported pending that have landed since: counted now (vLLM
        takes the stats at the end of this step); failed or landed, they are not watched again."""
        still: list[Handoff] = []
        for handoff in self._landing:
            status = handoff.status()
            if status == "pending":
                still.append(handoff)
            elif status == "sent":
                self._count_writes(handoff)
        self._landing = still

    def _count_writes(self, handoff: Handoff) -> None:
        """A landed handoff's WRITEs in this step's stats: what carried them, their bytes and time."""
        if handoff.write_seconds is not None:
            self._stats[WRITES].append([handoff.carrier, handoff.nbytes, handoff.write_seconds])

    def _gather_late(self, send: _Send) -> None:
        if send.error is not None or send.handoff is None or send.gathered:
            return
        layers = sorted(self._my_layers - send.early)
        try:
            views = [send.handoff.staging(layer) for layer in layers]
            for layer, staging in zip(layers, views):
                self._gather(staging, layer, _paged_rows(self._caches[layer]), send.work)
            if layers:
                _synchronize(self._caches[layers[0]])
                send.handoff.post_layers(layers)
                send.t_last_post = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - any failure fails this handoff, not vLLM
            self._fail(send, f"late gather of layers {layers}: {type(exc).__name__}: {exc}", "internal")
            return
        send.late.update(layers)
        send.gathered = True
        if send.t_last_post:  # this rank posted layers
            self._stats[POST_SECONDS].append(send.t_last_post - send.t_step)
        _log_step(send)

    def _progress_deferred(self) -> None:
        """Handoffs whose last step ended before they could open: try again, or give up."""
        now = time.monotonic()
        for send in list(self._sends.values()):
            if not send.last_bound or send.gathered or send.error is not None or send in self._active:
                continue
            self._open(send)
            if send.handoff is not None:
                self._gather_late(send)
            elif now > send.deadline:
                self._fail(send, f"no KV staging buffer free or no handshake with {send.work.kv_endpoint} "
                                 f"within transfer_timeout_s={self.settings.transfer_timeout_s:g}", "transfer")
            if send.reported and send.reported != "failed" and send.error is not None:
                self._report(send)

    def _gather(
        self, views: dict[str, torch.Tensor], layer: int, cache: torch.Tensor, work: RequestWork
    ) -> None:
        gather_layer(cache, work.block_ids, work.num_tokens, views, self._indexer.get(layer))

    def _fail(self, send: _Send, error: str, reason: FailureReason) -> None:
        if send.error is not None:
            return
        log.warning("handoff %s (request %s) failed: %s", send.work.handoff_id, send.work.req_id, error)
        _abort_quietly(send.handoff, error)
        send.error, send.reason = error, reason

    def _abort(self, send: _Send, reason: str) -> None:
        _abort_quietly(send.handoff, reason)
        send.error = send.error or reason
        if send in self._active:
            self._active.remove(send)

    def _report(self, send: _Send) -> None:
        """Tell the scheduler side how the handoff stands (again only if it failed since)."""
        if send.error is not None:
            status = "failed"
        else:
            handoff = send.handoff
            status = handoff.status() if handoff is not None else "pending"
            if handoff is not None and status == "failed":
                send.error, send.reason = handoff.error or "the KV transfer failed", "transfer"
        if status == send.reported or send.reported == "failed":
            return
        early = len(send.early)
        late = len(send.late) if status == "failed" else len(self._my_layers) - early
        if not send.reported:  # vLLM's KV-connector stats: the outcome at the end of the last step
            stats = self._stats
            if status == "failed":
                stats["handoffs_failed"] += 1
                key = f"failed_{send.reason}"
                stats[key] = stats.get(key, 0) + 1
            else:
                stats["handoffs_posted"] += 1
                if send.handoff is not None:  # the bytes its WRITEs carry (past what decode keeps)
                    stats["bytes_posted"] += send.handoff.nbytes
            stats["layers_early"] += early
            stats["layers_late"] += late
        handoff = send.handoff
        if status == "sent" and handoff is not None:
            self._count_writes(handoff)
        elif status == "pending" and handoff is not None and not send.reported:
            self._landing.append(handoff)
        send.reported = status
        self._reports.send(
            SendReport(
                req_id=send.work.req_id,
                rank=self.plan.rank,
                status=status,  # type: ignore[arg-type]
                error=send.error,
                reason=send.reason if status == "failed" else None,
                layers_early=early,
                layers_late=late,
            )
        )


def _synchronize(tensor: torch.Tensor) -> None:
    """Gathers on a CUDA cache are asynchronous: the staging bytes must be there before the WRITE."""
    if tensor.is_cuda:
        import torch

        torch.cuda.current_stream(tensor.device).synchronize()


def _log_step(send: _Send) -> None:
    """One line per handoff once its layers are all posted: the prefill step up to the last
    layer posted. Parsed by bench/prefill_tail.py (with the sender's line when they landed)."""
    log.info(
        "TileRT handoff %s: %d tokens, %d layers (%d early, %d late); step to last layer %.2f ms",
        send.work.handoff_id,
        send.work.num_tokens,
        len(send.early) + len(send.late),
        len(send.early),
        len(send.late),
        (send.t_last_post - send.t_step) * 1e3,
    )


def _abort_quietly(handoff: Handoff | None, reason: str) -> None:
    """Abort a pending handoff; a failing abort is logged, never raised into vLLM."""
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


def default_agent_name(engine_id: str, rank: int | None) -> str:
    """A worker rank's agent name, or (rank None) the scheduler side's."""
    import os
    import socket

    role = "sched" if rank is None else f"r{rank}"
    return f"tilert-prefill-{socket.gethostname()}-{os.getpid()}-{engine_id[:8]}-{role}"


def sender_group(engine_id: str, dp_rank: int = 0) -> str:
    """The KV sender group of one prefill instance: its scheduler side admits, its workers write."""
    import socket

    return f"tilert-prefill-{socket.gethostname()}-{engine_id}-dp{dp_rank}"


def nixl_sender_factory(agent_name: str, layout: KVLayout, max_tokens: int, plan: SenderPlan, device: str = "cpu",
                        lanes: int = 2, pin_lanes: bool = True, group: str = "",
                        control_timeout_s: float = 10.0, secret: bytes | None = None) -> Any:
    from connector.sender import KVSender

    return KVSender(agent_name, layout, max_tokens, sender_plan=plan, device=device, lanes=lanes,
                    pin_lanes=pin_lanes, group=group, control_timeout_s=control_timeout_s, secret=secret)
