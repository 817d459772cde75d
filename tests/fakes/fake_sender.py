"""A stateful in-process stand-in for :class:`connector.sender.KVSender` (same API), for unit
tests of the connector's worker side. Staging buffers are real tensors laid out as the
real sender's (:func:`connector.layout.layer_views`); what was posted is kept per
handoff so tests can check the gathered bytes. A handoff is "sent" once every layer of
its plan is posted (the fake WRITE lands at once). Behaviour knobs:

* ``reject``: endpoint -> HandshakeRejected raised by ``connect``;
* ``unreachable``: endpoints whose ``connect`` raises ControlChannelError and whose
  ``open`` answers None (not handshaken: try later);
* ``no_staging``: ``open`` answers None (no staging buffer free) this many times;
* ``fail_transfer``: handoff ids whose WRITEs fail (receiver gone);
* ``in_flight``: handoff ids whose WRITEs land only when the test calls ``land`` (after
  the step that posted them: a WRITE slower than vLLM's step);
* ``explode``: Handoff method names ("staging", "abort") that raise RuntimeError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from connector.kv_errors import AdmissionRefused, ControlChannelError, HandshakeRejected
from connector.layout import KVLayout, SenderPlan, layer_views


@dataclass
class FakeHandoff:
    sender: FakeKVSender
    endpoint: str
    handoff_id: str
    num_tokens: int
    layers: tuple[int, ...]
    offsets: Any
    deadline: float
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    posted: list[int] = field(default_factory=list)
    bursts: list[list[int]] = field(default_factory=list)  # each post_layers call
    error: str | None = None
    _status: Literal["pending", "sent", "failed"] = "pending"
    abort_reason: str | None = None
    carrier: str = ""
    write_seconds: float | None = None
    reused: int = 0  # the leading tokens the decode server keeps (not written)

    @property
    def nbytes(self) -> int:
        return len(self.layers) * self.sender.layout.bytes_per_layer(self.num_tokens)

    def _maybe_explode(self, method: str) -> None:
        if method in self.sender.explode:
            raise RuntimeError(f"{method} exploded")

    def staging(self, layer: int) -> dict[str, torch.Tensor]:
        self._maybe_explode("staging")
        if layer not in self.layers:
            raise KeyError(f"layer {layer} is not sent by this rank")
        if layer not in self.buffers:
            nbytes = self.sender.layout.bytes_per_layer(self.num_tokens)
            self.buffers[layer] = torch.zeros(nbytes, dtype=torch.uint8)
        return layer_views(self.buffers[layer], self.sender.layout, self.num_tokens)

    def post_layers(self, layers: list[int]) -> None:
        if any(layer in self.posted for layer in layers):
            raise ValueError(f"layers {layers} posted twice")
        self.posted.extend(layers)
        self.bursts.append(list(layers))
        if self._status != "pending":
            return
        if self.handoff_id in self.sender.fail_transfer:
            self._status, self.error = "failed", "nixlRemoteDisconnectError: receiver gone"
            self.sender.settle(self)
        elif sorted(self.posted) == sorted(self.layers) and self.handoff_id not in self.sender.in_flight:
            self.land()

    def land(self) -> None:
        """Every layer posted has landed."""
        if self._status != "pending" or sorted(self.posted) != sorted(self.layers):
            raise AssertionError(f"handoff {self.handoff_id} ({self._status}): not all of {self.layers} posted")
        self._status, self.carrier, self.write_seconds = "sent", "fake", 0.001
        self.sender.settle(self)

    def status(self) -> Literal["pending", "sent", "failed"]:
        return self._status

    def abort(self, reason: str) -> None:
        self.sender.settle(self)
        self._maybe_explode("abort")
        if self._status == "pending":
            self._status, self.error, self.abort_reason = "failed", f"aborted: {reason}", reason


class FakeKVSender:
    def __init__(
        self,
        agent_name: str,
        layout: KVLayout,
        max_tokens: int,
        sender_plan: SenderPlan | None = None,
    ) -> None:
        self.agent_name = agent_name
        self.layout = layout
        self.max_tokens = max_tokens
        self.plan = sender_plan or SenderPlan()
        self.connected: list[str] = []
        self.handoffs: dict[str, FakeHandoff] = {}
        self.open_handoffs: set[str] = set()
        self.reject: dict[str, HandshakeRejected] = {}
        self.unreachable: set[str] = set()
        self.no_staging = 0
        self.fail_transfer: set[str] = set()
        self.in_flight: set[str] = set()
        self.explode: set[str] = set()
        self.device = "cpu"  # where the worker asked for staging
        self.closed = False

    def connect(self, endpoint: str, timeout: float) -> None:
        if endpoint in self.unreachable:
            raise ControlChannelError(f"cannot connect to {endpoint}")
        if endpoint in self.reject:
            raise self.reject[endpoint]
        if endpoint not in self.connected:
            self.connected.append(endpoint)

    def open(self, endpoint: str, handoff_id: str, num_tokens: int, offsets: Any,
             deadline: float, reused: int = 0) -> FakeHandoff | None:
        if num_tokens > self.max_tokens:
            raise AdmissionRefused(handoff_id, "too_long", f"{num_tokens} > {self.max_tokens}")
        if endpoint in self.unreachable:
            return None
        if self.no_staging > 0:
            self.no_staging -= 1
            return None
        handoff = FakeHandoff(self, endpoint, handoff_id, num_tokens, self.plan.layers(self.layout.num_layers),
                              offsets, deadline)
        handoff.reused = reused
        self.handoffs[handoff_id] = handoff
        self.open_handoffs.add(handoff_id)
        return handoff

    def settle(self, handoff: FakeHandoff) -> None:
        self.open_handoffs.discard(handoff.handoff_id)

    def close(self) -> None:
        self.closed = True


def make_factory(configure=None) -> tuple[list[FakeKVSender], object]:
    """A sender factory for ConnectorWorker that records the senders it made."""
    made: list[FakeKVSender] = []

    def factory(agent_name: str, layout: KVLayout, max_tokens: int, plan: SenderPlan,
                device: str = "cpu") -> FakeKVSender:
        sender = FakeKVSender(agent_name, layout, max_tokens, plan)
        sender.device = device
        if configure is not None:
            configure(sender)
        made.append(sender)
        return sender

    return made, factory
