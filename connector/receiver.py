"""The receiving half of the KV handoff, used by the decode server.

:class:`KVReceiver` runs on the decode server's asyncio loop. ``start()`` allocates one
receive buffer of ``slots`` regions (each sized for ``max_tokens`` tokens of every
layer and plane), registers it with the transport once, and listens on the control
endpoint. A sender handshakes (Hello -> Welcome/Reject), then admits each handoff
(Admit -> Admitted/Refused) and WRITEs its layers into the slot; every WRITE carries a
:class:`connector.protocol.LayersDone` notification. Senders come in groups (one per
prefill instance, named in their Hello): vLLM's scheduler side admits (a control-only
Hello) and its workers' agents write; a handoff accepts notifications and Aborts from
the agents of the group that admitted it only. A notification thread polls the
transport (NIXL calls never run on the loop) and hands them to the loop.

``ReceivedKV.layers[i][plane]`` is a typed torch view of layer ``i`` (main layers
first, then MTP layers) for plane ``plane`` of the layout: per-token planes have shape
``[num_tokens, width]``, paged planes ``[num_pages, width]``. Inside a slot a handoff
is packed layer-major (each layer contiguous). The views stay valid until the handoff
is released.

Hostile peers (issue 12): with a shared secret (``ReceiverSettings.secret``, required off
loopback) a connection proves it before any Welcome (NIXL metadata, buffer descriptors) is
sent; refusals tell the sender what it sent, never what this receiver expected nor anything
of other handoffs; a handoff takes Abort and LayersDone from its own sender group only;
connections, remembered peers and tombstones are capped.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from connector.control import ControlConnection, ControlLimits, ControlServer
from connector.kv_errors import HandoffTimeout, ReceiverError, TransferFailed
from connector.layout import layout_fingerprint, packed_layers_views, plane_offsets
from connector.prefix import first_written
from connector.protocol import (
    Abort,
    Aborted,
    Admit,
    Admitted,
    Hello,
    LayersDone,
    Noted,
    Prefilled,
    Refused,
    Reject,
    Revoked,
    Welcome,
    handshake_mismatch,
)
from connector.receiver_state import FreeSlots, HandoffState, ReceivedKV, ReceiverSettings, ReceiverStats, SlotSource
from connector.transport import (
    NotificationPump,
    Transport,
    TransportError,
    TransportFactory,
    encode_regions,
    host_tensor,
    nixl_transport,
)
from pd_net.tcp import DeadPeer
from pd_wire.handoff import PROTOCOL_VERSION, HandoffResult, PeerStatus

if TYPE_CHECKING:
    import torch

__all__ = ["TransferFailed", "HandoffTimeout", "KVReceiver", "ReceivedKV", "ReceiverError", "ReceiverSettings",
           "ReceiverStats", "SlotSource"]

log = logging.getLogger(__name__)
MAX_TOMBSTONES = 65536  # cancelled handoffs and aborted tries remembered (oldest forgotten first)


def _remember(table: dict[Any, float], key: Any, limit: int) -> None:
    table.pop(key, None)
    table[key] = time.monotonic()
    while len(table) > limit:
        del table[next(iter(table))]


class KVReceiver:
    """``transport`` makes this receiver's data-transport agent (NIXL unless a test injects
    another); senders must use the same kind (the handshake checks it)."""

    def __init__(self, settings: ReceiverSettings, transport: TransportFactory = nixl_transport) -> None:
        self._s = settings
        self._make_transport = transport
        self._layout = settings.layout
        self._agent_name = settings.agent_name or f"kv-recv-{uuid.uuid4().hex[:12]}"
        self._slot_bytes = self._layout.bytes_per_layer(settings.max_tokens) * self._layout.num_layers
        self._transport: Transport | None = None
        self._buffer: torch.Tensor | None = None
        self._buffer_owner: object = None
        self._welcome_parts: tuple[str, str] = ("", "")
        self._server = ControlServer(settings.host, settings.port, self._on_message, self._on_disconnect,
                                     secret=settings.secret,
                                     limits=ControlLimits(settings.max_connections, settings.auth_timeout_s,
                                                          DeadPeer.within(settings.dead_peer_s)))
        self._slots: SlotSource = FreeSlots(settings.slots)
        self._handoffs: dict[str, HandoffState] = {}
        self._peers: dict[str, PeerStatus] = {}
        self._revocable: set[str] = set()  # senders whose agent we added (they can be told Revoked)
        self._group_of: dict[str, str] = {}  # sender agent -> its group (from its Hello)
        self._changed: asyncio.Condition | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump: NotificationPump | None = None
        self._reaper: asyncio.Task | None = None
        self._stopped = False
        self._cancelled: dict[str, float] = {}  # released before admission -> when
        self._aborted_tries: dict[tuple[str, str, str], float] = {}  # (group, handoff, attempt) -> when
        self._live: dict[str, int] = {}  # open control connections per sender agent
        self._tasks: set[asyncio.Future] = set()
        self._orphan_checks: set[asyncio.Task[None]] = set()  # senders' disconnect graces running
        self.stats = ReceiverStats()

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Condition()
        transport, buffer = await asyncio.to_thread(self._allocate)
        self._transport, self._buffer = transport, buffer
        region = transport.register(buffer)
        self._welcome_parts = (base64.b64encode(transport.metadata()).decode(), encode_regions([region]))
        await self._server.start()
        self._pump = NotificationPump(transport, self._loop, self._deliver, self._expecting_kv)
        self._pump.start()
        self._reaper = asyncio.create_task(self._reap_unclaimed())

    def _allocate(self) -> tuple[Transport, torch.Tensor]:
        transport = self._make_transport(self._agent_name, 1)
        buffer, self._buffer_owner = host_tensor(self._s.slots * self._slot_bytes, self._s.device)
        return transport, buffer

    async def stop(self) -> None:
        await self._server.stop()
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        for check in self._orphan_checks:
            check.cancel()
        await asyncio.gather(*self._orphan_checks, return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._pump is not None:
            await asyncio.to_thread(self._pump.stop)
        self._stopped = True
        if self._transport is not None:
            for h in list(self._handoffs.values()):
                if h.state == "admitted":
                    await self._fail(h, "the KV receiver stopped")
            await self._notify_all()
            await asyncio.to_thread(self._transport.close)
            self._transport = None

    @property
    def endpoint(self) -> str:
        return f"{self._s.host}:{self._server.port}"

    @property
    def fingerprint(self) -> str:
        return self._layout.fingerprint()

    @property
    def listening(self) -> bool:
        return self._server.listening

    @property
    def agent_name(self) -> str:
        return self._agent_name

    def peers(self) -> list[PeerStatus]:
        return list(self._peers.values())

    def connections(self, agent: str) -> int:
        """Open control connections of the sender agent ``agent`` (after its Hello)."""
        return self._live.get(agent, 0)

    async def settled(self) -> None:
        """Return once every disconnect grace under way has run out and its check ran (tests)."""
        while self._orphan_checks:
            await asyncio.gather(*list(self._orphan_checks), return_exceptions=True)

    def use_slots(self, slots: SlotSource) -> None:
        """Before :meth:`start`: take receive slots from ``slots`` (the decode server's slot table)."""
        self._slots = slots

    def busy_slots(self) -> int:
        return sum(1 for h in self._handoffs.values() if h.slot is not None)

    @property
    def refused_connections(self) -> int:
        """Control connections closed unheard: over the cap, failed or late authentication or Hello."""
        return self._server.refused_connections

    # ----------------------------------------------------------------- decode-server API

    async def wait_for(self, handoff_id: str, timeout: float, with_result: bool = False) -> ReceivedKV:
        """The handoff's KV once every layer landed (and, ``with_result``, the sender's
        Prefilled: its first token), within ``timeout``; then the decode server owns it
        until :meth:`release`."""
        changed = self._cond()
        deadline = time.monotonic() + timeout
        counted: HandoffState | None = None
        try:
            async with changed:
                while True:
                    if self._stopped:
                        raise ReceiverError(f"handoff {handoff_id}: the KV receiver stopped")
                    h = self._handoffs.get(handoff_id)
                    if h is not None and h is not counted:
                        h.waiters += 1
                        counted = h
                    if h is not None and h.state in ("complete", "claimed") and (h.result or not with_result):
                        h.state = "claimed"  # the decode server owns it until release()
                        return self._view(h)
                    if h is not None and h.state == "failed":
                        self._handoffs.pop(handoff_id, None)
                        raise TransferFailed(f"handoff {handoff_id}: {h.error}")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        await asyncio.wait_for(changed.wait(), remaining)
                    except TimeoutError:
                        pass
        finally:
            if counted is not None:
                counted.waiters -= 1
        h = self._handoffs.get(handoff_id)
        if h is None:
            raise HandoffTimeout(f"handoff {handoff_id}: never admitted by a sender within {timeout:.1f}s")
        got = len(h.arrived)
        await self._fail(h, "timed out")
        self._handoffs.pop(handoff_id, None)
        missing = " and the prefill's result (Prefilled)" if with_result and h.result is None else ""
        raise HandoffTimeout(f"handoff {handoff_id}: {got}/{self._layout.num_layers} layers{missing} arrived "
                             f"within {timeout:.1f}s; slot freed")

    def release(self, handoff_id: str, tombstone: bool = True) -> None:
        """Free the handoff's slot (idempotent). Releasing a handoff whose KV has not fully
        arrived revokes it at the sender; releasing one not yet admitted makes the
        receiver refuse it ("cancelled") when its Admit comes, unless ``tombstone`` is False
        (the caller knows no prefill was sent for it, and the same id may come again)."""
        h = self._handoffs.pop(handoff_id, None)
        if h is None:
            if tombstone:
                _remember(self._cancelled, handoff_id, MAX_TOMBSTONES)
            return
        if h.state == "admitted":
            h.state, h.error = "failed", "released by the decode server before all layers arrived"
            self.stats.failed += 1
            self._background(self._revoke(h, h.error))
        self._free_slot(h)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _view(self, h: HandoffState) -> ReceivedKV:
        if self._buffer is None or h.slot is None or not h.views:
            raise ReceiverError(f"handoff {h.handoff_id}: its receive slot is gone (receiver stopped?)")
        return ReceivedKV(h.handoff_id, h.num_tokens, h.views, h.result, slot=h.slot, reused=h.reused,
                          prefix=h.prefix, tail=h.tail)

    def _free_slot(self, h: HandoffState) -> None:
        if h.slot is not None:
            self._slots.give(h.handoff_id, h.slot)
            h.slot = None

    async def _fail(self, h: HandoffState, error: str, revoke: bool = True) -> None:
        if h.state == "failed":
            return
        was_incomplete = h.state == "admitted"
        h.state, h.error = "failed", error
        self.stats.failed += 1
        h.since = time.monotonic()
        self._free_slot(h)
        if revoke and was_incomplete:
            await self._revoke(h, error)
        await self._notify_all()

    async def _revoke(self, h: HandoffState, reason: str) -> None:
        """Tell the handoff's senders to stop writing into the slot just freed."""
        transport = self._transport
        if transport is None:
            return
        msg = Revoked(handoff_id=h.handoff_id, reason=reason).model_dump_json().encode()
        for peer in [p for p in self._revocable if self._group_of.get(p) == h.group]:
            try:
                await asyncio.to_thread(transport.notify, peer, msg)
            except TransportError as exc:
                log.warning("KV receiver: could not revoke %s at %s: %s", h.handoff_id, peer, exc)

    async def _notify_all(self) -> None:
        changed = self._cond()
        async with changed:
            changed.notify_all()

    def _cond(self) -> asyncio.Condition:
        if self._changed is None or self._transport is None:
            raise ReceiverError("the KV receiver is not running (start() not awaited, or stopped)")
        return self._changed

    def _need_transport(self) -> Transport:
        if self._transport is None:
            raise ReceiverError("the KV receiver is not running (start() not awaited, or stopped)")
        return self._transport

    # ----------------------------------------------------------------- control channel

    async def _on_message(self, conn: ControlConnection, msg: BaseModel) -> BaseModel | None:
        if isinstance(msg, Hello):
            return await self._on_hello(conn, msg)
        if conn.peer is None:
            if isinstance(msg, (Admit, Abort, Prefilled)):
                self.stats.refused("unknown_peer")
                hid = msg.result.handoff_id if isinstance(msg, Prefilled) else msg.handoff_id
                return Refused(handoff_id=hid, reason="unknown_peer",
                               message="send Hello first: this connection has not completed the handshake")
            return None
        if isinstance(msg, Admit):
            reply = await self._on_admit(conn.peer, msg)
            if isinstance(reply, Refused):
                self.stats.refused(reply.reason)
            return reply
        if isinstance(msg, Abort):
            group = self._group_of.get(conn.peer, conn.peer)
            h = self._handoffs.get(msg.handoff_id)
            if msg.attempt and (h is None or h.attempt != msg.attempt):
                # a try whose Admit may still be unread (on a connection the sender gave up on)
                _remember(self._aborted_tries, (group, msg.handoff_id, msg.attempt), MAX_TOMBSTONES)
            if h is None or h.group != group or (msg.attempt and h.attempt != msg.attempt):
                return Aborted(handoff_id=msg.handoff_id, known=False)
            if h.state == "admitted":
                await self._fail(h, f"aborted by the sender {conn.peer}: {msg.reason}", revoke=False)
            elif h.state == "complete":  # nobody claimed it yet: the request is gone
                self._handoffs.pop(h.handoff_id, None)
                await self._fail(h, f"aborted by the sender {conn.peer}: {msg.reason}", revoke=False)
            return Aborted(handoff_id=msg.handoff_id, known=True)
        if isinstance(msg, Prefilled):
            return await self._on_prefilled(conn.peer, msg)
        return None

    async def _on_prefilled(self, peer: str, msg: Prefilled) -> Noted:
        """The first token of a handoff, from the sender group that admitted it (a failed
        result fails the handoff, as its Abort would)."""
        result = msg.result
        h = self._handoffs.get(result.handoff_id)
        group = self._group_of.get(peer, peer)
        if (h is None or h.group != group or (msg.attempt and h.attempt != msg.attempt)
                or h.state == "failed" or h.num_tokens != result.num_prompt_tokens):
            return Noted(handoff_id=result.handoff_id, known=False)
        if result.status == "failed":
            if h.state == "complete":
                self._handoffs.pop(h.handoff_id, None)
            await self._fail(h, f"the prefill failed ({result.reason}): {result.error}", revoke=False)
            return Noted(handoff_id=result.handoff_id, known=True)
        h.result = result
        self.stats.prefilled += 1
        await self._notify_all()
        return Noted(handoff_id=result.handoff_id, known=True)

    async def post_result(self, result: HandoffResult) -> bool:
        """The result of a handoff sent by the decode server's client rather than with the KV
        (a claim whose result is posted: vLLM's answer as the router read it); False when no
        such handoff is here (never admitted, failed, released) or its prompt's length differs."""
        h = self._handoffs.get(result.handoff_id)
        if h is None or h.state == "failed" or h.num_tokens != result.num_prompt_tokens:
            return False
        h.result = result
        await self._notify_all()
        return True

    async def _on_hello(self, conn: ControlConnection, hello: Hello) -> BaseModel:
        name = hello.agent_name
        if conn.peer is not None and conn.peer != name:
            return Reject(field="agent_name", received=name,
                          message=f"this connection already belongs to the sender agent {conn.peer}")
        if name not in self._peers and not self._room_for_a_peer():
            log.warning("KV receiver: refused sender agent %s: %d agents connected", name, self._s.max_peers)
            return Reject(field="agent_name", received=name,
                          message=f"the decode server serves at most {self._s.max_peers} sender agents")
        mine = layout_fingerprint(self._layout, hello.fingerprint.sender_world_size)
        bad = handshake_mismatch(decode_version=PROTOCOL_VERSION, decode_transport=self._need_transport().kind,
                                 decode_fingerprint=mine, prefill_version=hello.protocol_version,
                                 prefill_transport=hello.transport, prefill_fingerprint=hello.fingerprint)
        if bad is not None:
            fld, expected, received = bad
            message = (f"KV handshake rejected by decode agent {self._agent_name}: {fld} mismatch: "
                       f"decode expects {expected}, prefill {name} sent {received}")
            log.warning(message)
            current = self._peers.get(name)
            if current is None or current.state != "ok" or self.connections(name) == 0:
                # a working agent of that name keeps its status (one bad Hello must not take it out)
                self._peers[name] = PeerStatus(peer=name, state="rejected", reason=message)
            return Reject(field=fld, received=received,
                          message=f"KV handshake rejected by decode agent {self._agent_name}: {fld} mismatch: "
                                  f"prefill {name} sent {received} (see the decode server's log)")
        if hello.agent_metadata:  # lets us revoke its handoffs; a restarted sender may reuse its name
            transport = self._need_transport()
            self._revocable.discard(hello.agent_name)
            await asyncio.to_thread(transport.remove_peer, hello.agent_name)
            try:
                added = await asyncio.to_thread(transport.add_peer, base64.b64decode(hello.agent_metadata))
                self._revocable.add(added)
            except (TransportError, ValueError) as exc:
                log.warning("KV receiver: cannot add sender %s's agent (no revocation): %s", hello.agent_name, exc)
        if conn.peer != hello.agent_name:
            conn.peer = hello.agent_name
            self._live[conn.peer] = self._live.get(conn.peer, 0) + 1
        self._group_of[hello.agent_name] = hello.group or hello.agent_name
        self._peers[hello.agent_name] = PeerStatus(peer=hello.agent_name, state="ok")
        md, descs = self._welcome_parts
        return Welcome(protocol_version=PROTOCOL_VERSION, agent_name=self._agent_name, fingerprint=mine,
                       transport=self._need_transport().kind, agent_metadata=md, buffer_descs=descs,
                       max_tokens=self._s.max_tokens, slots=self._s.slots)

    async def _on_admit(self, peer: str, admit: Admit) -> BaseModel:
        hid, n = admit.handoff_id, admit.num_tokens
        if hid in self._cancelled:
            return Refused(handoff_id=hid, reason="cancelled",
                           message=f"handoff {hid} was cancelled by the decode server (its request is gone)")
        group = self._group_of.get(peer, peer)
        if admit.attempt and (group, hid, admit.attempt) in self._aborted_tries:
            return Refused(handoff_id=hid, reason="cancelled",
                           message=f"handoff {hid}: the sender gave this try up before it was read")
        h = self._handoffs.get(hid)
        if h is not None:
            if h.state == "admitted" and h.num_tokens == n and h.slot is not None and h.group == group:
                return Admitted(handoff_id=hid, slot=h.slot, offsets=h.offsets, reused=h.reused)  # asked again
            return Refused(handoff_id=hid, reason="duplicate",
                           message=f"handoff id {hid} is already in use on this decode server")
        if n > self._s.max_tokens:
            message = (f"handoff {hid}: {n} prompt tokens exceed the decode server's "
                       f"max_tokens {self._s.max_tokens}")
            log.warning(message)
            return Refused(handoff_id=hid, reason="too_long", message=message)
        if self._buffer is None:
            return Refused(handoff_id=hid, reason="busy", message="the KV receiver is stopping")
        slot = self._slots.take(hid)
        if slot is None:
            return Refused(handoff_id=hid, reason="busy",
                           message=f"all {self._s.slots} KV receive slots of the decode server are busy or "
                                   f"held (none for handoff {hid})")
        layer_bytes = self._layout.bytes_per_layer(n)
        planes = plane_offsets(self._layout, n)
        base = slot * self._slot_bytes
        offsets = [[base + layer * layer_bytes + p for p in planes] for layer in range(self._layout.num_layers)]
        views = packed_layers_views(self._buffer[base:], self._layout, n, self._layout.num_layers)
        reused = self._slots.reuse(hid, slot, admit.prefix, n) if admit.prefix else 0
        self._handoffs[hid] = HandoffState(hid, slot, n, offsets, group=group, attempt=admit.attempt, views=views,
                                           reused=reused, prefix=tuple(admit.prefix), tail=tuple(admit.tail))
        if self._pump is not None:
            self._pump.wake()
        await self._notify_all()
        return Admitted(handoff_id=hid, slot=slot, offsets=offsets, reused=reused)

    def _room_for_a_peer(self) -> bool:
        """Whether a new sender agent may be remembered: forgets agents without a live connection
        (oldest first) to make room."""
        if len(self._peers) < self._s.max_peers:
            return True
        for name in [p for p in self._peers if self.connections(p) == 0]:
            del self._peers[name]
            if self._handoff_group_idle(name):
                self._group_of.pop(name, None)
            if len(self._peers) < self._s.max_peers:
                return True
        return False

    def _handoff_group_idle(self, agent: str) -> bool:
        group = self._group_of.get(agent)
        return not any(h.group == group for h in self._handoffs.values())

    def _on_disconnect(self, conn: ControlConnection) -> None:
        if conn.peer is None or self._loop is None or self._stopped:
            return
        peer = conn.peer
        self._live[peer] -= 1
        check = asyncio.ensure_future(self._fail_orphans(peer))
        self._orphan_checks.add(check)
        check.add_done_callback(self._orphan_checks.discard)

    async def _fail_orphans(self, peer: str) -> None:
        await asyncio.sleep(self._s.disconnect_grace_s)  # a grace period, not a synchronisation
        if self._live.get(peer, 0) > 0:  # it reconnected (e.g. a retried Admit): its handoffs live on
            return
        group = self._group_of.get(peer, peer)
        for h in list(self._handoffs.values()):
            if h.state == "admitted" and h.group == group:
                await self._fail(h, f"the sender {peer} disconnected after {len(h.arrived)}/"
                                    f"{self._layout.num_layers} layers", revoke=False)

    # ----------------------------------------------------------------- notifications

    def _expecting_kv(self) -> bool:  # called from the pump's thread
        return any(h.state == "admitted" for h in list(self._handoffs.values()))

    def _deliver(self, notifs: list[tuple[str, bytes]]) -> None:
        self._background(self._on_notifs(notifs))

    async def _on_notifs(self, notifs: list[tuple[str, bytes]]) -> None:
        changed = False
        for peer, raw in notifs:
            try:
                done = LayersDone.model_validate_json(raw)
            except ValidationError:  # also a Revoked sent to us by mistake
                log.warning("KV receiver: ignoring a malformed notification from %s", peer)
                continue
            h = self._handoffs.get(done.handoff_id)
            if h is None or h.state != "admitted" or self._group_of.get(peer) != h.group:
                continue
            h.arrived.update(layer for layer in done.layers if 0 <= layer < self._layout.num_layers)
            if len(h.arrived) == self._layout.num_layers:
                now = time.monotonic()
                self.stats.handoff_took(now - h.since)
                h.state, h.since = "complete", now
                self.stats.completed += 1
                self._count_completed(h)
                changed = True
        if changed:
            await self._notify_all()

    def _count_completed(self, h: HandoffState) -> None:
        layout, stats = self._layout, self.stats
        kept = sum(layout.bytes_per_layer(first_written(h.reused, layout.is_mtp(layer)))
                   for layer in range(layout.num_layers))
        stats.bytes_received += layout.bytes_per_layer(h.num_tokens) * layout.num_layers - kept
        stats.pushed_tokens += h.num_tokens - h.reused
        if h.reused:
            stats.reused_tokens += h.reused
            stats.reused_handoffs += 1
            stats.bytes_reused += kept

    async def _reap_unclaimed(self) -> None:
        period = min(1.0, self._s.unclaimed_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for hid, when in list(self._cancelled.items()):
                if now - when > self._s.unclaimed_timeout_s:
                    del self._cancelled[hid]
            for key, when in list(self._aborted_tries.items()):
                if now - when > self._s.unclaimed_timeout_s:
                    del self._aborted_tries[key]
            for hid, h in list(self._handoffs.items()):
                if h.state != "claimed" and h.waiters == 0 and now - h.since > self._s.unclaimed_timeout_s:
                    log.warning("KV receiver: freeing unclaimed handoff %s (%s)", hid, h.state)
                    self._handoffs.pop(hid, None)
                    await self._fail(h, f"nobody claimed it within {self._s.unclaimed_timeout_s:g}s")
                    self._free_slot(h)
