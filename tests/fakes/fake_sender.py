"""A stateful in-process stand-in for :class:`connector.sender.KVSender` (same API), for unit
tests of the connector's worker side. Staging buffers are real tensors laid out as the
real sender's (:func:`connector.layout.layer_views`); what was posted is kept per
handoff so tests can check the gathered bytes. Behaviour knobs:

* ``reject``: endpoint -> HandshakeRejected raised by ``connect``;
* ``refuse``: endpoint -> reason ("busy", "too_long") raised by ``begin``;
* ``fail_wait``: handoff ids whose ``wait`` ends "failed" (receiver gone);
* ``unreachable``: endpoints whose ``connect`` raises ControlChannelError;
* ``explode``: Handoff method names ("staging", "abort", "wait") that raise RuntimeError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from connector.errors import AdmissionRefused, ControlChannelError, HandshakeRejected
from connector.layout import KVLayout, SenderPlan, layer_views


@dataclass
class FakeHandoff:
    sender: FakeKVSender
    endpoint: str
    handoff_id: str
    num_tokens: int
    layers: tuple[int, ...]
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    posted: list[int] = field(default_factory=list)
    error: str | None = None
    _status: Literal["pending", "sent", "failed"] = "pending"
    abort_reason: str | None = None

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

    def post_layer(self, layer: int) -> None:
        if self._status != "pending":
            raise RuntimeError(f"post_layer on a {self._status} handoff")
        self.posted.append(layer)

    def status(self) -> Literal["pending", "sent", "failed"]:
        return self._status

    def wait(self, timeout: float) -> Literal["sent", "failed"]:
        self._maybe_explode("wait")
        if self._status == "pending":
            if self.handoff_id in self.sender.fail_wait:
                self._status, self.error = "failed", "nixlRemoteDisconnectError: receiver gone"
            elif sorted(set(self.posted)) != sorted(self.layers):
                self._status, self.error = (
                    "failed",
                    f"timed out: layers {sorted(self.posted)} of {self.layers}",
                )
            else:
                self._status = "sent"
        self.sender.settle(self)
        return self._status  # type: ignore[return-value]

    def abort(self, reason: str) -> None:
        self.sender.settle(self)
        self._maybe_explode("abort")
        if self._status == "pending":
            self._status, self.error, self.abort_reason = "failed", f"aborted: {reason}", reason
        self.sender.settle(self)


class FakeKVSender:
    def __init__(
        self,
        agent_name: str,
        layout: KVLayout,
        max_tokens: int,
        sender_plan: SenderPlan | None = None,
        transport: str = "nixl",
    ) -> None:
        self.agent_name = agent_name
        self.layout = layout
        self.max_tokens = max_tokens
        self.plan = sender_plan or SenderPlan()
        self.connected: list[str] = []
        self.handoffs: dict[str, FakeHandoff] = {}
        self.open_handoffs: set[str] = set()
        self.reject: dict[str, HandshakeRejected] = {}
        self.refuse: dict[str, str] = {}
        self.fail_wait: set[str] = set()
        self.unreachable: set[str] = set()
        self.explode: set[str] = set()
        self.closed = False

    def connect(self, endpoint: str, timeout: float) -> None:
        if endpoint in self.unreachable:
            raise ControlChannelError(f"cannot connect to {endpoint}")
        if endpoint in self.reject:
            raise self.reject[endpoint]
        if endpoint not in self.connected:
            self.connected.append(endpoint)

    def begin(self, endpoint: str, handoff_id: str, num_tokens: int, timeout: float) -> FakeHandoff:
        if endpoint in self.refuse:
            raise AdmissionRefused(
                handoff_id, self.refuse[endpoint], f"{endpoint} refused {handoff_id}: {self.refuse[endpoint]}"
            )
        if num_tokens > self.max_tokens:
            raise AdmissionRefused(handoff_id, "too_long", f"{num_tokens} > {self.max_tokens}")
        handoff = FakeHandoff(
            self, endpoint, handoff_id, num_tokens, self.plan.layers(self.layout.num_layers)
        )
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

    def factory(agent_name: str, layout: KVLayout, max_tokens: int, plan: SenderPlan) -> FakeKVSender:
        sender = FakeKVSender(agent_name, layout, max_tokens, plan)
        if configure is not None:
            configure(sender)
        made.append(sender)
        return sender

    return made, factory
