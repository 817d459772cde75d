"""The sender side's view of one handoff (see :mod:`connector.sender`).

The caller fills ``staging(layer)`` and calls ``post_layer(layer)``; the KVSender's
thread writes it and calls back ``_on_written``; ``status`` / ``wait`` / ``abort``
report and end it (``abort`` never waits: the decode server is told in the background).
Thread-safe; the staging buffer goes back to the KVSender's pool only once no WRITE
reads it any more.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Literal

from connector.layout import layer_views

if TYPE_CHECKING:
    import torch

    from connector.sender import KVSender, _Peer



log = logging.getLogger(__name__)


class Handoff:
    """One prompt's KV on its way to one decode server. Create with :meth:`KVSender.open`
    (or :meth:`KVSender.begin`)."""

    def __init__(self, sender: "KVSender", peer: _Peer, handoff_id: str, offsets: list[list[int]],
                 num_tokens: int, staging: int, deadline: float) -> None:
        self._sender = sender
        self._peer = peer
        self.handoff_id = handoff_id
        self.num_tokens = num_tokens
        self.offsets = offsets
        self.deadline = deadline  # time.monotonic(): not fully written by then -> aborted
        self._t_last_post = 0.0
        self._staging_slot = staging
        self._layers = sender.plan_layers
        self._index = {layer: i for i, layer in enumerate(self._layers)}
        self._posted: set[int] = set()
        self._sent: set[int] = set()
        self._inflight = 0
        self._status: Literal["pending", "sent", "failed"] = "pending" if self._layers else "sent"
        self.error: str | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        if not self._layers:
            self._done.set()
            sender._release_staging(staging)
        self._staging_held = bool(self._layers)

    # -- caller side ------------------------------------------------------------------

    def staging(self, layer: int) -> dict[str, "torch.Tensor"]:
        start, size = self._local_span(layer)
        return layer_views(self._sender.staging_buffer[start:start + size], self._sender.layout, self.num_tokens)

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
        self._sender._queue.put_many([(self, layer) for layer in layers])

    def status(self) -> Literal["pending", "sent", "failed"]:
        return self._status

    def wait(self, timeout: float) -> Literal["sent", "failed"]:
        if not self._done.wait(timeout):
            self.abort(f"not all layers were written within {timeout:.1f}s ({self.progress()})")
        return "sent" if self._status == "sent" else "failed"

    def abort(self, reason: str) -> None:
        """Stop sending; the receiver is told in the background (after in-flight WRITEs
        landed); the staging buffer is freed once no WRITE reads it."""
        if self._fail(f"aborted: {reason}"):
            self._sender._abort_soon(self, reason)

    def progress(self) -> str:
        return f"{len(self._sent)}/{len(self._layers)} layers sent, {len(self._posted)} posted"

    # -- sender-thread side -----------------------------------------------------------

    def _local_span(self, layer: int) -> tuple[int, int]:
        if layer not in self._index:
            raise ValueError(f"layer {layer} is not sent by this rank (plan: {self._layers})")
        size = self._sender.layout.bytes_per_layer(self.num_tokens)
        return self._staging_slot * self._sender.slot_bytes + self._index[layer] * size, size

    def _pieces(self, layers: list[int]) -> list[tuple[int, int, int]]:
        base_local = self._sender.staging_region.addr
        base_remote = self._peer.region.addr
        sizes = [p.nbytes(self.num_tokens) for p in self._sender.layout.planes]
        pieces = []
        for layer in layers:
            local, _ = self._local_span(layer)
            for offset, size in zip(self.offsets[layer], sizes):
                pieces.append((base_local + local, base_remote + offset, size))
                local += size
        return pieces

    def _fail(self, error: str) -> bool:
        with self._lock:
            if self._status != "pending":
                return False
            self._status, self.error = "failed", error
        self._done.set()
        self._maybe_free()
        return True

    def _on_written(self, layers: list[int]) -> None:
        with self._lock:
            self._inflight -= 1
            self._sent.update(layers)
            landed = self._status == "pending" and len(self._sent) == len(self._layers)
            if landed:
                self._status = "sent"
                self._done.set()
        if landed:  # parsed by bench/prefill_tail.py
            log.info("TileRT handoff %s: all %d layers landed, tail %.3f ms after the last post", self.handoff_id,
                     len(self._layers), (time.perf_counter() - self._t_last_post) * 1e3)
        self._maybe_free()

    def _maybe_free(self) -> None:
        with self._lock:
            free = self._staging_held and self._inflight == 0 and self._status != "pending"
            if free:
                self._staging_held = False
        if free:
            self._sender._forget(self)
            self._sender._release_staging(self._staging_slot)
