"""Data types of the receiving half (see :mod:`connector.receiver`, which re-exports them)."""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from connector.layout import KVLayout
from pd_settings.secrets import is_loopback
from pd_wire.handoff import HandoffResult

if TYPE_CHECKING:
    import torch

# upper bounds (s) of the handoff-time histogram: a small prompt's KV on one host is
# milliseconds, a long one across a slow or lossy link seconds
HANDOFF_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class SlotSource(Protocol):
    """Who owns the receive slots: the receiver's own free list (:class:`FreeSlots`), or the
    decode server's slot table (the slot held under the handoff id)."""

    def take(self, handoff_id: str) -> int | None:
        """A slot for this handoff, or None (busy)."""
        ...

    def give(self, handoff_id: str, slot: int) -> None: ...

    def reuse(self, handoff_id: str, slot: int, prefix: Sequence[str], num_tokens: int) -> int:
        """The leading tokens of this handoff's prompt (its block hashes ``prefix``,
        :mod:`connector.prefix`) whose KV the slot keeps from its last sequence, usable by this
        handoff: the sender writes only the KV past them. 0: none."""
        ...


class FreeSlots:
    """Slots first come, first served (a receiver on its own)."""

    def __init__(self, slots: int) -> None:
        self._free = list(range(slots))

    def take(self, handoff_id: str) -> int | None:
        return self._free.pop(0) if self._free else None

    def give(self, handoff_id: str, slot: int) -> None:
        self._free.append(slot)

    def reuse(self, handoff_id: str, slot: int, prefix: Sequence[str], num_tokens: int) -> int:
        return 0  # a receiver on its own keeps nothing


@dataclass
class ReceivedKV:
    """A handoff's KV in its receive slot: ``layers`` are views of ``num_tokens`` tokens, whose
    first ``reused`` the sender did not write (the engine keeps them from the slot's last
    sequence); ``prefix`` and ``tail`` are the prompt's ids as its Admit offered them
    (:func:`connector.prefix.split_prompt`), which the decode server keeps with the KV."""

    handoff_id: str
    num_tokens: int
    layers: list[dict[str, torch.Tensor]]
    result: HandoffResult | None = None  # the prefill's result, when it came with the KV (Prefilled)
    slot: int = 0
    reused: int = 0
    prefix: tuple[str, ...] = ()
    tail: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReceiverSettings:
    layout: KVLayout
    max_tokens: int
    slots: int = 1
    host: str = "127.0.0.1"
    port: int = 0  # 0: ephemeral
    unclaimed_timeout_s: float = 30.0  # an admitted/completed handoff nobody claims is freed after this
    # after a sender's last control connection closed, its incomplete handoffs fail after
    # this grace (its notifications may trail the closed connection; it may reconnect)
    disconnect_grace_s: float = 2.0
    agent_name: str | None = None
    device: str = "cpu"  # where the receive buffer lives ("cuda:0" registers VRAM)
    # the KV channel's shared secret: every control connection proves it before anything else
    # (connector/kv_auth.py); required when ``host`` is not a loopback address
    secret: bytes | None = field(default=None, repr=False)
    max_connections: int = 256  # open control connections
    max_peers: int = 256  # sender agents remembered (a peer without a live connection is forgotten first)
    auth_timeout_s: float = 10.0  # a new connection authenticates and says Hello within this, or is closed
    dead_peer_s: float = 10.0  # a sender host that vanished from the network is given up within this (pd_net.tcp)

    def __post_init__(self) -> None:
        if self.secret is None and not is_loopback(self.host):
            raise ValueError(f"ReceiverSettings.secret: required when listening on {self.host!r}, which is not a "
                             "loopback address (decode server: --kv-secret-file or --kv-secret-env)")
        checks = [
            ("max_tokens", self.max_tokens, self.max_tokens >= 1, "must be >= 1"),
            ("slots", self.slots, self.slots >= 1, "must be >= 1"),
            ("port", self.port, 0 <= self.port < 65536, "must be in 0..65535 (0: ephemeral)"),
            ("unclaimed_timeout_s", self.unclaimed_timeout_s, self.unclaimed_timeout_s > 0, "must be > 0"),
            ("disconnect_grace_s", self.disconnect_grace_s, self.disconnect_grace_s >= 0, "must be >= 0"),
            ("max_connections", self.max_connections, self.max_connections >= 1, "must be >= 1"),
            ("max_peers", self.max_peers, self.max_peers >= 1, "must be >= 1"),
            ("auth_timeout_s", self.auth_timeout_s, self.auth_timeout_s > 0, "must be > 0"),
        ]
        for name, value, ok, reason in checks:
            if not ok:
                raise ValueError(f"ReceiverSettings.{name}={value!r}: {reason}")


@dataclass
class ReceiverStats:
    """The receiver's counters since it started, read by the decode server's ``/metrics``
    (``decode_server_kv_*``). Written only on the receiver's event loop."""

    refusals: dict[str, int] = field(default_factory=dict)  # Admits refused, by reason (Refused.reason)
    completed: int = 0  # handoffs whose every layer arrived
    failed: int = 0  # admitted handoffs that failed (timed out, aborted, sender gone, released early)
    bytes_received: int = 0  # KV bytes of the completed handoffs
    # tokens of the completed handoffs whose KV was written, and those the slot kept (not
    # written); the handoffs that reused some, and the KV bytes they did not move
    pushed_tokens: int = 0
    reused_tokens: int = 0
    reused_handoffs: int = 0
    bytes_reused: int = 0
    prefilled: int = 0  # handoff results (first tokens) that came with the KV (Prefilled) and were kept
    # admission to its last layer's notification, of each completed handoff: a histogram's
    # counts per bound of HANDOFF_BUCKETS (not cumulative; the last one past every bound)
    handoff_counts: list[int] = field(default_factory=lambda: [0] * (len(HANDOFF_BUCKETS) + 1))
    handoff_seconds: float = 0.0  # their sum

    def refused(self, reason: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def handoff_took(self, seconds: float) -> None:
        self.handoff_counts[bisect.bisect_left(HANDOFF_BUCKETS, seconds)] += 1
        self.handoff_seconds += seconds


@dataclass
class HandoffState:
    """The receiver's record of one admitted handoff (private to the receiver)."""

    handoff_id: str
    slot: int | None
    num_tokens: int
    offsets: list[list[int]]
    group: str = ""  # the sender group that admitted it: its agents write and may abort it
    attempt: str = ""  # the sender's name for the try that admitted it
    arrived: set[int] = field(default_factory=set)
    state: str = "admitted"  # "admitted" | "complete" | "claimed" | "failed"
    error: str | None = None
    waiters: int = 0
    since: float = field(default_factory=time.monotonic)
    # the per-layer views handed to the engine, made at admission (off the path from the
    # last notification to wait_for returning)
    views: list[dict[str, torch.Tensor]] = field(default_factory=list)
    result: HandoffResult | None = None  # from the sender's Prefilled
    reused: int = 0  # leading tokens the slot keeps (Admitted.reused): not written
    prefix: tuple[str, ...] = ()  # the Admit's block hashes of the prompt
    tail: tuple[int, ...] = ()  # and its ids past them
