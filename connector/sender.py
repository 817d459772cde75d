"""The sending half of the KV handoff, used by the vLLM connector's worker side.

Thread-safe, and nothing on the caller's path waits on the network. :class:`KVSender`
owns one transport agent, a registered staging pool (``staging_slots`` buffers, each
sized for ``max_tokens`` tokens of the layers this rank sends), ``lanes`` sender threads
that post WRITEs and poll them, and a small pool of control threads (handshakes made in
the background, Aborts).

Per handoff: the slot was admitted by the connector's scheduler side
(:mod:`connector.admission`); ``open`` (non-blocking) takes a staging buffer for it, or
answers None (no staging buffer free, or the decode server not handshaken yet: a
handshake starts in the background) and the caller tries again later. The caller fills
``staging(layer)`` and calls ``post_layer(layer)`` (or ``post_layers`` for several
ready at once). Each lane has a transport worker of its own; a lane takes its run of the
queued layers (:mod:`connector.lanes`) and writes it as one WRITE of as few descriptors
as possible (a layer is contiguous on both sides, consecutive layers too), tagged with a
:class:`LayersDone` notification. An intra-node NIXL/UCX WRITE is a kernel copy (CMA)
inside the posting call, about 0.6 of a ``memcpy``'s bandwidth; two lanes copy on two
cores at once. A handoff not fully written by its deadline is aborted (the decode server
is told in the background). A staging buffer is reused only after every WRITE reading it
has finished. ``begin`` (admission over this sender's own control connection, blocking)
serves callers outside vLLM: benchmarks and tests.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from connector.control import ABORT_TIMEOUT_S, ControlClient
from connector.handoff import OutgoingHandoff, Peer
from connector.kv_errors import AdmissionRefused, ControlChannelError, HandshakeRejected, TransportError
from connector.lanes import LaneQueue
from connector.layout import KVLayout, SenderPlan, layout_fingerprint
from connector.prefix import NO_PREFIX, PREFIX_BLOCK_TOKENS, Prefix
from connector.protocol import (
    Abort,
    Admit,
    Admitted,
    Hello,
    LayersDone,
    Refused,
    Reject,
    Revoked,
    Welcome,
    handshake_mismatch,
)
from connector.transport import TransportFactory, XferHandle, decode_regions, host_tensor, nixl_transport
from pd_wire.handoff import PROTOCOL_VERSION

__all__ = ["AdmissionRefused", "HandshakeRejected", "KVSender", "OutgoingHandoff", "SenderPlan"]

log = logging.getLogger(__name__)

_POLL_S = 0.0002
_IDLE_POLL_S = 0.02  # while handoffs are pending but nothing is queued: look for Revoked
_IDLE_TICK_S = 1.0  # otherwise progress the agent now and then (it has no progress thread)
MAX_LANES = 8
CONTROL_THREADS = 4  # background handshakes and Aborts; a hung decode server holds one for its timeout


def lane_cpus(lanes: int, device: str) -> list[int]:
    """CPUs to pin the lanes to, one each, or none. Only host staging is pinned: there a
    lane's WRITE is a copy on its CPU, and left to itself the scheduler now and then ran
    two lanes' copies on one CPU for a whole push (measured: half the pushes at one-lane
    speed). GPU staging is moved by the NIC / NVLink, and every TP rank's process would
    pin its lanes to the same CPUs. None either with fewer CPUs than lanes."""
    import torch

    if lanes < 2 or torch.device(device).type != "cpu" or not hasattr(os, "sched_getaffinity"):
        return []
    cpus = sorted(os.sched_getaffinity(0))
    return cpus if len(cpus) >= lanes else []


class KVSender:
    def __init__(self, agent_name: str, layout: KVLayout, max_tokens: int,
                 sender_plan: SenderPlan | None = None, transport: TransportFactory = nixl_transport,
                 staging_slots: int = 2,
                 device: str = "cpu", lanes: int = 2, pin_lanes: bool = True, group: str = "",
                 control_timeout_s: float = 10.0, secret: bytes | None = None) -> None:
        if max_tokens < 1:
            raise ValueError(f"KVSender max_tokens={max_tokens}: must be >= 1")
        if staging_slots < 1:
            raise ValueError(f"KVSender staging_slots={staging_slots}: must be >= 1")
        if not 1 <= lanes <= MAX_LANES:
            raise ValueError(f"KVSender lanes={lanes}: must be in 1..{MAX_LANES}")
        self.agent_name = agent_name
        self.group = group
        self.control_timeout_s = control_timeout_s
        self._secret = secret  # the KV channel's shared secret (authenticates each control connection)
        self.layout = layout
        self.max_tokens = max_tokens
        self.plan = sender_plan or SenderPlan()
        self.plan_layers = self.plan.layers(layout.num_layers)
        self.slot_bytes = max(1, len(self.plan_layers)) * layout.bytes_per_layer(max_tokens)
        self._fingerprint = layout_fingerprint(layout, self.plan.world_size)
        self._transport = transport(agent_name, lanes)
        self._transport_kind = self._transport.kind
        self.staging_buffer, self._staging_owner = host_tensor(staging_slots * self.slot_bytes, device)
        self.staging_region = self._transport.register(self.staging_buffer)
        self._free_staging = list(range(staging_slots))
        self._staging_cv = threading.Condition()
        self._peers: dict[str, Peer] = {}
        self._peers_lock = threading.Lock()  # the dicts only: never held across network I/O
        self._handshake_locks: dict[str, threading.Lock] = {}
        self._connecting: set[str] = set()
        self._connect_errors: dict[str, str] = {}  # endpoint -> why its last background handshake failed
        self._control = ThreadPoolExecutor(CONTROL_THREADS, thread_name_prefix=f"{agent_name}-kv-control")
        self._queue: LaneQueue[tuple[OutgoingHandoff, int]] = LaneQueue()
        self._active: dict[str, OutgoingHandoff] = {}  # pending handoffs by id, for Revoked
        self._active_lock = threading.Lock()
        self._closed = False
        self._revocation_lock = threading.Lock()
        self._lanes_lock = threading.Lock()
        self._posting = 0  # lanes inside transport.write()
        self._last_revocation_check = 0.0
        self.lanes = lanes
        self._lane_cpus = lane_cpus(lanes, device) if pin_lanes else []
        self._threads = [
            threading.Thread(target=self._run, args=(lane,), name=f"{agent_name}-kv-sender-{lane}", daemon=True)
            for lane in range(lanes)
        ]
        for thread in self._threads:
            thread.start()

    # ----------------------------------------------------------------- handshake

    def connect(self, endpoint: str, timeout: float) -> None:
        """Handshake with ``endpoint`` unless a live connection exists (blocking; start-up
        and the handshake keeper)."""
        self._peer(endpoint, timeout)

    def disconnect(self, endpoint: str) -> bool:
        """Forget ``endpoint`` (a decode server no longer listed): close its control
        connection and remove its NIXL peer. False, and nothing done, while a handoff to it
        is pending (the keeper tries again next round)."""
        with self._active_lock:
            if any(h.peer.endpoint == endpoint for h in self._active.values()):
                return False
        with self._peers_lock:
            lock = self._handshake_locks.setdefault(endpoint, threading.Lock())
        with lock:
            with self._peers_lock:
                peer = self._peers.pop(endpoint, None)
                self._connect_errors.pop(endpoint, None)
            if peer is not None:
                peer.client.close()
                self._transport.remove_peer(peer.agent)
        return True

    def _ready_peer(self, endpoint: str) -> Peer | None:
        with self._peers_lock:
            peer = self._peers.get(endpoint)
        if peer is None or peer.stale or peer.client.broken:
            return None
        return peer

    def _peer(self, endpoint: str, timeout: float) -> Peer:
        with self._peers_lock:
            lock = self._handshake_locks.setdefault(endpoint, threading.Lock())
        with lock:  # one handshake per endpoint at a time; other endpoints are not held up
            peer = self._ready_peer(endpoint)
            if peer is not None:
                return peer
            with self._peers_lock:
                old = self._peers.pop(endpoint, None)
            if old is not None:
                old.client.close()
                self._transport.remove_peer(old.agent)
            peer = self._handshake(endpoint, timeout)
            with self._peers_lock:
                self._peers[endpoint] = peer
            return peer

    def _connect_soon(self, endpoint: str) -> None:
        with self._peers_lock:
            if endpoint in self._connecting or self._closed:
                return
            self._connecting.add(endpoint)
        self._control.submit(self._connect_in_background, endpoint)

    def _connect_in_background(self, endpoint: str) -> None:
        error = None
        try:
            self._peer(endpoint, self.control_timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported to the handoffs waiting for it
            error = f"{type(exc).__name__}: {exc}"
            log.warning("KV sender: background handshake with %s failed: %s", endpoint, error)
        finally:
            with self._peers_lock:
                self._connecting.discard(endpoint)
                if error is not None:
                    self._connect_errors[endpoint] = error

    def _handshake(self, endpoint: str, timeout: float) -> Peer:
        client = ControlClient(endpoint, timeout, self._secret)
        try:
            hello = Hello(protocol_version=PROTOCOL_VERSION, agent_name=self.agent_name,
                          fingerprint=self._fingerprint, transport=self._transport_kind,
                          agent_metadata=base64.b64encode(self._transport.metadata()).decode(), group=self.group)
            reply = client.request(hello, timeout)
            if isinstance(reply, Reject):
                raise HandshakeRejected(reply.field, "", reply.received,
                                        f"decode server {endpoint}: {reply.message}")
            if not isinstance(reply, Welcome):
                raise ControlChannelError(f"{endpoint} answered Hello with {type(reply).__name__}")
            self._check_welcome(endpoint, reply)
            self._transport.remove_peer(reply.agent_name)  # a restarted peer may reuse its name
            agent = self._transport.add_peer(base64.b64decode(reply.agent_metadata))
            if agent != reply.agent_name:
                raise ControlChannelError(
                    f"{endpoint}: agent metadata names {agent!r}, Welcome {reply.agent_name!r}")
            self._transport.connect(agent)
            regions = decode_regions(reply.buffer_descs)
        except BaseException:
            client.close()
            raise
        return Peer(endpoint, client, reply, agent, regions[0])

    def _check_welcome(self, endpoint: str, welcome: Welcome) -> None:
        bad = handshake_mismatch(decode_version=welcome.protocol_version, decode_transport=welcome.transport,
                                 decode_fingerprint=welcome.fingerprint, prefill_version=PROTOCOL_VERSION,
                                 prefill_transport=self._transport_kind, prefill_fingerprint=self._fingerprint)
        if bad is not None:
            field, expected, received = bad
            raise HandshakeRejected(field, expected, received,
                                    f"KV handshake with decode server {endpoint} failed: {field} mismatch: "
                                    f"decode expects {expected}, this prefill ({self.agent_name}) has {received}")

    # ----------------------------------------------------------------- handoffs

    def open(self, endpoint: str, handoff_id: str, num_tokens: int, offsets: list[list[int]] | tuple,
             deadline: float, reused: int = 0) -> OutgoingHandoff | None:
        """The handoff of a slot admitted elsewhere (the connector's scheduler side), or None
        when it cannot start yet (no staging buffer free, or ``endpoint`` not handshaken: a
        handshake starts in the background; if that fails, the next ``open`` for the
        endpoint raises :class:`ControlChannelError`). Never waits. ``deadline``
        (``time.monotonic``): not fully written by then, the handoff is aborted. ``reused``: the
        prompt's leading tokens the decode server keeps (``Admitted.reused``): not written."""
        self._check_open(handoff_id, num_tokens)
        peer = self._ready_peer(endpoint)
        if peer is None:
            with self._peers_lock:
                error = self._connect_errors.pop(endpoint, None)
            if error is not None:  # the handshake this handoff waited for failed: so does the handoff
                raise ControlChannelError(f"no KV handshake with decode server {endpoint}: {error}")
            self._connect_soon(endpoint)
            return None
        with self._staging_cv:
            if not self._free_staging:
                return None
            slot = self._free_staging.pop(0)
        return self._start(peer, handoff_id, num_tokens, offsets, slot, deadline, reused)

    def begin(self, endpoint: str, handoff_id: str, num_tokens: int, timeout: float,
              transfer_timeout: float = 30.0, prefix: Prefix = NO_PREFIX) -> OutgoingHandoff:
        """Admit the handoff over this sender's own control connection, offering ``prefix``
        (:func:`connector.prefix.split_prompt` of the prompt's ids), then open it (blocking, up
        to ``timeout``); for callers outside vLLM."""
        self._check_open(handoff_id, num_tokens)
        deadline = time.monotonic() + timeout
        peer = self._peer(endpoint, timeout)
        slot = self._take_staging(handoff_id, deadline)
        try:
            admit = Admit(handoff_id=handoff_id, num_tokens=num_tokens, rank=self.plan.rank, prefix=list(prefix[0]),
                          tail=list(prefix[1]))
            try:
                reply = peer.client.request(admit, max(0.01, deadline - time.monotonic()))
            except ControlChannelError:  # a cached connection went stale: handshake again once
                peer = self._peer(endpoint, max(0.01, deadline - time.monotonic()))
                reply = peer.client.request(admit, max(0.01, deadline - time.monotonic()))
            if isinstance(reply, Refused):
                raise AdmissionRefused(handoff_id, reply.reason, f"decode server {endpoint}: {reply.message}")
            if not isinstance(reply, Admitted) or reply.handoff_id != handoff_id:
                raise ControlChannelError(f"{endpoint} answered Admit with {reply!r:.200}")
        except BaseException:
            self.release_staging(slot)
            raise
        return self._start(peer, handoff_id, num_tokens, reply.offsets, slot, time.monotonic() + transfer_timeout,
                           reply.reused)

    def _check_open(self, handoff_id: str, num_tokens: int) -> None:
        if self._closed:
            raise TransportError("KVSender is closed")
        if num_tokens > self.max_tokens:
            raise AdmissionRefused(handoff_id, "too_long", f"handoff {handoff_id}: {num_tokens} prompt tokens "
                                   f"exceed this prefill's KV staging size max_tokens={self.max_tokens}")

    def _start(self, peer: Peer, handoff_id: str, num_tokens: int, offsets: list[list[int]] | tuple, slot: int,
               deadline: float, reused: int = 0) -> OutgoingHandoff:
        try:
            self._check_offsets(peer, offsets, num_tokens)
            if not 0 <= reused < num_tokens or reused % PREFIX_BLOCK_TOKENS:
                raise ControlChannelError(f"{peer.endpoint}: admitted reuse of {reused} tokens is not a whole number "
                                          f"of {PREFIX_BLOCK_TOKENS}-token blocks below the prompt's {num_tokens}")
        except BaseException:
            self.release_staging(slot)
            raise
        handoff = OutgoingHandoff(self, peer, handoff_id, [list(o) for o in offsets], num_tokens, slot, deadline,
                                  reused)
        if handoff.status() == "pending":
            with self._active_lock:
                self._active[handoff_id] = handoff
        return handoff

    def _check_offsets(self, peer: Peer, offsets: list[list[int]] | tuple, num_tokens: int) -> None:
        sizes = [p.nbytes(num_tokens) for p in self.layout.planes]
        ok = len(offsets) == self.layout.num_layers and all(
            len(offs) == len(sizes) and all(0 <= o and o + s <= peer.region.nbytes for o, s in zip(offs, sizes))
            for offs in offsets)
        if not ok:
            raise ControlChannelError(f"{peer.endpoint}: admitted offsets do not fit the layout or the buffer")

    def _take_staging(self, handoff_id: str, deadline: float) -> int:
        with self._staging_cv:
            while not self._free_staging:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    raise AdmissionRefused(handoff_id, "busy", "all KV staging buffers of this prefill are in use")
                self._staging_cv.wait(remaining)
            return self._free_staging.pop(0)

    def release_staging(self, slot: int) -> None:
        with self._staging_cv:
            self._free_staging.append(slot)
            self._staging_cv.notify()

    def enqueue(self, items: list[tuple[OutgoingHandoff, int]]) -> None:
        """Layers of handoffs to write (called by :meth:`OutgoingHandoff.post_layers`)."""
        self._queue.put_many(items)

    def abort_soon(self, handoff: OutgoingHandoff, reason: str) -> None:
        """Tell the decode server, in the background, once the handoff's in-flight WRITEs landed."""
        try:
            self._control.submit(self._send_abort, handoff, reason)
        except RuntimeError:  # closing: the receiver frees what this sender held when it goes away
            pass

    def _send_abort(self, handoff: OutgoingHandoff, reason: str) -> None:
        handoff.wait_writes(ABORT_TIMEOUT_S)  # in-flight WRITEs land before the Abort
        with self._peers_lock:  # the connection may have been made again since the handoff began
            current = self._peers.get(handoff.peer.endpoint, handoff.peer)
        try:
            current.client.request(Abort(handoff_id=handoff.handoff_id, reason=reason), ABORT_TIMEOUT_S)
        except ControlChannelError as exc:
            log.warning("KV sender: could not tell %s about aborting %s: %s", current.endpoint,
                        handoff.handoff_id, exc)

    # ----------------------------------------------------------------- sender lanes

    def _run(self, lane: int) -> None:
        if self._lane_cpus:
            cpu = self._lane_cpus[-1 - lane % len(self._lane_cpus)]  # from the last CPU: away from CPU 0
            try:
                os.sched_setaffinity(0, {cpu})  # this thread only
            except OSError as exc:
                log.info("KV sender lane %d: cannot pin to CPU %d: %s", lane, cpu, exc)
        try:
            self._send_loop()
        except Exception as exc:  # a bug must not leave handoffs hanging until their timeouts
            log.exception("KV sender thread of %s died", self.agent_name)
            self._closed = True
            with self._active_lock:
                pending = list(self._active.values())
            for handoff in pending:
                handoff.fail(f"the KV sender thread died: {type(exc).__name__}: {exc}")

    def _send_loop(self) -> None:
        inflight: list[tuple[OutgoingHandoff, XferHandle, list[int]]] = []
        while True:
            waiting = bool(self._active)
            # due every 10 ms while handoffs are pending, also while layers keep coming
            self._maybe_check_revocations(_IDLE_POLL_S / 2 if waiting else _IDLE_TICK_S)
            timeout = _POLL_S if inflight else (_IDLE_POLL_S if waiting else _IDLE_TICK_S)
            batch, stop = self._queue.take(timeout)
            if batch:
                inflight.extend(self._post(batch))
            still = []
            for handoff, xfer, layers in inflight:
                state = self._transport.poll(xfer)
                if state == "pending":
                    still.append((handoff, xfer, layers))
                    continue
                self._transport.release(xfer)
                if state == "done":
                    handoff.written(layers)
                else:
                    self._on_transport_error(handoff, f"KV WRITE of layers {layers} to {handoff.peer.endpoint} "
                                                      "failed (decode server unreachable or gone?)")
                    handoff.written([])
            inflight = still
            if stop:
                break
        for handoff, xfer, _ in inflight:
            self._transport.release(xfer)
            handoff.fail("the KV sender closed")
            handoff.written([])

    def _maybe_check_revocations(self, every_s: float) -> None:
        if time.monotonic() - self._last_revocation_check < every_s or self._posting:
            # reading notifications takes the agent's exclusive lock, which would wait for
            # (and hold up) the WRITEs that other lanes are posting
            return
        if not self._revocation_lock.acquire(blocking=False):
            return  # another lane is reading notifications
        try:
            self._last_revocation_check = time.monotonic()
            self._check_revocations()
            self._check_deadlines()
        finally:
            self._revocation_lock.release()

    def _post(self, batch: list[tuple[OutgoingHandoff, int]]) -> list[tuple[OutgoingHandoff, XferHandle, list[int]]]:
        grouped: dict[int, tuple[OutgoingHandoff, list[int]]] = {}
        for handoff, layer in batch:
            grouped.setdefault(id(handoff), (handoff, []))[1].append(layer)
        posted = []
        for handoff, layers in grouped.values():
            if handoff.status() != "pending":
                continue
            notif = LayersDone(handoff_id=handoff.handoff_id, layers=layers).model_dump_json().encode()
            handoff.begin_write()
            with self._lanes_lock:
                self._posting += 1
            try:
                xfer = self._transport.write(handoff.peer.agent, handoff.pieces(layers), notif,
                                             handoff.peer.region)
            except TransportError as exc:
                self._on_transport_error(handoff, f"KV WRITE of layers {layers} to decode server "
                                                  f"{handoff.peer.endpoint} failed: {exc}")
                handoff.written([])
                continue
            finally:
                with self._lanes_lock:
                    self._posting -= 1
            posted.append((handoff, xfer, layers))
        return posted

    def _check_revocations(self) -> None:
        try:
            notifs = self._transport.notifications()
        except TransportError as exc:
            log.warning("KV sender: reading notifications failed: %s", exc)
            return
        for peer, raw in notifs:
            try:
                revoked = Revoked.model_validate_json(raw)
            except ValueError:
                continue
            with self._active_lock:
                handoff = self._active.get(revoked.handoff_id)
            if handoff is not None and handoff.peer.agent == peer:
                handoff.fail(f"revoked by the decode server {handoff.peer.endpoint}: {revoked.reason}")

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        with self._active_lock:
            late = [h for h in self._active.values() if h.deadline < now]
        for handoff in late:
            handoff.abort(f"not all layers were written by the transfer deadline ({handoff.progress()})")

    def carrier(self, handoff: OutgoingHandoff) -> str:
        """What carried ``handoff``'s WRITEs: the transport's word for WRITEs of its largest piece."""
        return self._transport.carrier(max(p.nbytes(handoff.num_tokens) for p in self.layout.planes))

    def forget(self, handoff: OutgoingHandoff) -> None:
        with self._active_lock:
            if self._active.get(handoff.handoff_id) is handoff:
                del self._active[handoff.handoff_id]

    def _on_transport_error(self, handoff: OutgoingHandoff, error: str) -> None:
        handoff.peer.stale = True  # handshake again (and re-add the agent) next time
        handoff.fail(error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.close()
        deadline = time.monotonic() + 10.0
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._active_lock:
            pending = list(self._active.values())
        for handoff in pending:  # nothing will write them any more
            handoff.fail("the KV sender closed")
        with self._staging_cv:
            self._staging_cv.notify_all()
        self._control.shutdown(wait=True, cancel_futures=True)
        with self._peers_lock:
            for peer in self._peers.values():
                peer.client.close()
            self._peers.clear()
        self._transport.close()
