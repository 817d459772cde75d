"""Data transports for KV handoffs: the interface, NIXL, and an in-memory fake."""

from __future__ import annotations

from connector.errors import TransportError
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
from connector.transport.memory import MemoryFabric, MemoryTransport
from connector.transport.pump import NotificationPump

TRANSPORT_KINDS = ("nixl", "memory")


class TransportFactory:
    """Creates transports by kind. The "memory" kind attaches to ``fabric`` (one per
    factory), so agents made by one factory can reach each other."""

    def __init__(self, fabric: MemoryFabric | None = None) -> None:
        self.fabric = fabric or MemoryFabric()

    def create(self, kind: str, name: str, workers: int = 1) -> Transport:
        """``workers``: independent progress contexts, so that as many threads can move
        bytes at once (NIXL: UCX workers; the in-memory fake has no use for it)."""
        if kind == "nixl":
            from connector.transport.nixl import NixlTransport

            return NixlTransport(name, workers)
        if kind == "memory":
            return MemoryTransport(name, self.fabric)
        raise ValueError(f"transport={kind!r}: must be one of {', '.join(TRANSPORT_KINDS)}")


# The process's shared fake network: what "memory" transports created by name use
# (the in-memory fake's stand-in for the real network; NIXL needs none).
SHARED_FACTORY = TransportFactory()


def create_transport(kind: str, name: str, workers: int = 1) -> Transport:
    return SHARED_FACTORY.create(kind, name, workers)


__all__ = [
    "HostBuffer", "MemoryFabric", "MemoryTransport", "NotificationPump", "Piece", "Region", "SHARED_FACTORY",
    "TRANSPORT_KINDS", "Transport", "TransportError", "TransportFactory", "XferHandle", "XferState",
    "create_transport", "decode_regions", "encode_regions", "host_tensor", "merge_pieces",
]
