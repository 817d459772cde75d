"""The sender side's view of one handoff (see :mod:`connector.sender`).

The caller fills ``staging(layer)`` and calls ``post_layer(layer)``; the KVSender's lane
threads write the layers and report back through the public sender-side methods
(``begin_write``, ``written``, ``fail``); ``status`` / ``wait`` / ``abort`` report and end
it (``abort`` never waits: the decode server is told in the background). Thread-safe; the
staging buffer goes back to the pool only once no WRITE reads it any more.

What a handoff needs from the KVSender that made it is the :class:`StagingPool`
protocol below: this module imports nothing of :mod:`connector.sender`, and neither side
touches the other's private state.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from connector.control import ControlClient
from connector.layout import KVLayout, layer_views
from connector.prefix import first_written
from connector.protocol import Welcome
from connector.transport import Region

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

HandoffStatus = Literal["pending", "sent", "failed"]


@dataclass
class Peer:
    """A decode server this sender handshook with: its control connection, its transport
    agent and its receive buffer's region."""

    endpoint: str
    client: ControlClient
    welcome: Welcome
    agent: str
    region: Region
    stale: bool = False  # a WRITE to it failed: handshake again before the next handoff


class StagingPool(Protocol):
    """What an :class:`OutgoingHandoff` uses of the :class:`connector.sender.KVSender` that opened it."""

    layout: KVLayout
    plan_layers: tuple[int, ...]
    slot_bytes: int
    staging_buffer: torch.Tensor
    staging_region: Region

    def enqueue(self, items: list[tuple[OutgoingHandoff, int]]) -> None: ...

    def release_staging(self, slot: int) -> None: ...

    def abort_soon(self, handoff: OutgoingHandoff, reason: str) -> None: ...

    def forget(self, handoff: OutgoingHandoff) -> None: ...

    def carrier(self, handoff: OutgoingHandoff) -> str: ...


class OutgoingHandoff:
    """One prompt's KV on its way to one decode server. Create with :meth:`KVSender.open`
    (or :meth:`KVSender.begin`)."""

    def __init__(self, pool: StagingPool, peer: Peer, handoff_id: str, offsets: list[list[int]],
                 num_tokens: int, staging: int, deadline: float, reused: int = 0) -> None:
        self._pool = pool
        self.peer = peer
        self.handoff_id = handoff_id
        self.num_tokens = num_tokens
        # the leading tokens the decode server keeps (Admitted.reused): every plane's bytes for
        # them are left out of the WRITEs (a whole number of pages of a paged plane)
        self.reused = reused
        self.offsets = offsets
        self.deadline = deadline  # time.monotonic(): not fully written by then -> aborted
        self._t_last_post = 0.0
        self._t_first_write = 0.0
        # once every layer landed: what carried the WRITEs (the transport's word for it) and
        # the time from the first WRITE posted to the last landed
        self.carrier = ""
        self.write_seconds: float | None = None
        self._staging_slot = staging
        self._layers = pool.plan_layers
        self._index = {layer: i for i, layer in enumerate(self._layers)}
        self._posted: set[int] = set()
        self._sent: set[int] = set()
        self._inflight = 0
        self._status: HandoffStatus = "pending" if self._layers else "sent"
        self.error: str | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no WRITE is in flight
        self._done = threading.Event()
        if not self._layers:
            self._done.set()
            pool.release_staging(staging)
        self._staging_held = bool(self._layers)

    # -- caller side ------------------------------------------------------------------

    def staging(self, layer: int) -> dict[str, torch.Tensor]:
        start, size = self._local_span(layer)
        return layer_views(self._pool.staging_buffer[start:start + size], self._pool.layout, self.num_tokens)

    def post_layer(self, layer: int) -> None:
        self.post_layers([layer])

    def post_layers(self, layers: list[int]) -> None:
        """Queue these filled layers at once: idle sender lanes split them between them."""
        with self._lock:
            seen: set[int] = set()
            for layer in layers:
                if layer not in self._index:
                    raise ValueError(f"layer {layer} is not sent by this rank (plan: {self._layers})")
                if layer in self._posted or layer in seen:
                    raise ValueError(f"handoff {self.handoff_id}: layer {layer} posted twice")
                seen.add(layer)
            self._posted.update(seen)
            self._t_last_post = time.perf_counter()
            if self._status != "pending":
                return
        self._pool.enqueue([(self, layer) for layer in layers])

    def status(self) -> HandoffStatus:
        return self._status

    def wait(self, timeout: float) -> Literal["sent", "failed"]:
        if not self._done.wait(timeout):
            self.abort(f"not all layers were written within {timeout:.1f}s ({self.progress()})")
        return "sent" if self._status == "sent" else "failed"

    def abort(self, reason: str) -> None:
        """Stop sending; the receiver is told in the background (after in-flight WRITEs
        landed); the staging buffer is freed once no WRITE reads it."""
        if self.fail(f"aborted: {reason}"):
            self._pool.abort_soon(self, reason)

    @property
    def nbytes(self) -> int:
        """The KV bytes this handoff writes (every layer of this rank, past the reused tokens)."""
        layout = self._pool.layout
        return sum(layout.bytes_per_layer(self.num_tokens)
                   - layout.bytes_per_layer(first_written(self.reused, layout.is_mtp(layer))) for layer in self._layers)

    def progress(self) -> str:
        return f"{len(self._sent)}/{len(self._layers)} layers sent, {len(self._posted)} posted"

    # -- sender-lane side -------------------------------------------------------------

    def pieces(self, layers: list[int]) -> list[tuple[int, int, int]]:
        """The ``(local, remote, nbytes)`` pieces of one WRITE of these layers: each plane past
        its reused tokens (:func:`connector.prefix.first_written`)."""
        base_local = self._pool.staging_region.addr
        base_remote = self.peer.region.addr
        layout = self._pool.layout
        sizes = [p.nbytes(self.num_tokens) for p in layout.planes]
        pieces = []
        for layer in layers:
            local, _ = self._local_span(layer)
            skips = [p.nbytes(first_written(self.reused, layout.is_mtp(layer))) for p in layout.planes]
            for offset, size, skip in zip(self.offsets[layer], sizes, skips):
                pieces.append((base_local + local + skip, base_remote + offset + skip, size - skip))
                local += size
        return pieces

    def begin_write(self) -> None:
        """A WRITE reading this handoff's staging is about to be posted; :meth:`written` ends it."""
        with self._lock:
            self._inflight += 1
            if not self._t_first_write:
                self._t_first_write = time.perf_counter()

    def written(self, layers: list[int]) -> None:
        """A WRITE begun with :meth:`begin_write` ended; ``layers`` landed (empty: it failed)."""
        with self._lock:
            self._inflight -= 1
            self._sent.update(layers)
            landed = self._status == "pending" and len(self._sent) == len(self._layers)
            now = time.perf_counter()
            if landed:
                self.carrier = self._pool.carrier(self)
                self.write_seconds = now - self._t_first_write
                self._status = "sent"
                self._done.set()
            if not self._inflight:
                self._idle.notify_all()
        if landed:  # parsed by bench/prefill_tail.py
            log.info("TileRT handoff %s: all %d layers landed, tail %.3f ms after the last post; %.1f MB over %s "
                     "in %.3f ms from the first WRITE", self.handoff_id, len(self._layers),
                     (now - self._t_last_post) * 1e3, self.nbytes / 1e6, self.carrier,
                     (self.write_seconds or 0.0) * 1e3)
        self._maybe_free()

    def fail(self, error: str) -> bool:
        """Mark it failed (no effect once it ended); True when this call failed it."""
        with self._lock:
            if self._status != "pending":
                return False
            self._status, self.error = "failed", error
        self._done.set()
        self._maybe_free()
        return True

    def wait_writes(self, timeout: float) -> bool:
        """Wait until no WRITE of this handoff is in flight; False if some still are after ``timeout``."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    # -- internals --------------------------------------------------------------------

    def _local_span(self, layer: int) -> tuple[int, int]:
        if layer not in self._index:
            raise ValueError(f"layer {layer} is not sent by this rank (plan: {self._layers})")
        size = self._pool.layout.bytes_per_layer(self.num_tokens)
        return self._staging_slot * self._pool.slot_bytes + self._index[layer] * size, size

    def _maybe_free(self) -> None:
        with self._lock:
            free = self._staging_held and self._inflight == 0 and self._status != "pending"
            if free:
                self._staging_held = False
        if free:
            self._pool.forget(self)
            self._pool.release_staging(self._staging_slot)
