"""Data transports for KV handoffs: the interface (:mod:`.base`), NIXL (:mod:`.nixl`),
registered host buffers (:mod:`.hostmem`) and the notification pump (:mod:`.pump`).

A :class:`connector.sender.KVSender` or :class:`connector.receiver.KVReceiver` is given a
:data:`TransportFactory`; :func:`nixl_transport` is the one every process of the stack
uses. Tests inject their own (``tests/fakes/memory_transport.py``: an in-process fake
whose agents meet on a fabric the test creates).
"""

from __future__ import annotations

from collections.abc import Callable

from connector.kv_errors import TransportError
from connector.transport.base import (
    Piece,
    Region,
    Transport,
    XferHandle,
    XferState,
    decode_regions,
    encode_regions,
    merge_pieces,
)
from connector.transport.hostmem import HostBuffer, host_tensor
from connector.transport.pump import NotificationPump

# (agent name, workers) -> a new transport agent. ``workers``: independent progress
# contexts, so that as many threads can move bytes at once (NIXL: UCX workers).
TransportFactory = Callable[[str, int], Transport]


def nixl_transport(name: str, workers: int = 1) -> Transport:
    """A NIXL agent (imported on first use: the scheduler side and the router never need it)."""
    from connector.transport.nixl import NixlTransport

    return NixlTransport(name, workers)


__all__ = [
    "HostBuffer", "NotificationPump", "Piece", "Region", "Transport", "TransportError", "TransportFactory",
    "XferHandle", "XferState", "decode_regions", "encode_regions", "host_tensor", "merge_pieces", "nixl_transport",
]
