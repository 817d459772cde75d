"""An in-process fake of the data transport, for unit tests.

Agents meet on a :class:`MemoryFabric` (the fake's network), which a test creates and
injects: ``KVSender(..., transport=fabric.transport)`` and ``KVReceiver(settings,
transport=fabric.transport)`` made with the same fabric find each other as they would
over NIXL. Writes are checked like NIXL's: both ranges must lie inside registered regions
and the peer must be known and alive, else :class:`TransportError`. Data is copied
synchronously; the notification is delivered after the copy.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from connector.kv_errors import TransportError
from connector.transport.base import Piece, Region, Transport, XferHandle, XferState, merge_pieces

if TYPE_CHECKING:
    import torch


class MemoryFabric:
    """Name -> live agent; the fake network. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._agents: dict[str, MemoryTransport] = {}

    def attach(self, agent: MemoryTransport) -> None:
        with self._lock:
            if agent.name in self._agents:
                raise TransportError(f"memory transport: agent name {agent.name!r} already in use")
            self._agents[agent.name] = agent

    def detach(self, agent: MemoryTransport) -> None:
        with self._lock:
            if self._agents.get(agent.name) is agent:
                del self._agents[agent.name]

    def lookup(self, name: str) -> MemoryTransport | None:
        with self._lock:
            return self._agents.get(name)

    def transport(self, name: str, workers: int = 1) -> MemoryTransport:
        """A :data:`connector.transport.TransportFactory` on this fabric (``workers`` unused)."""
        return MemoryTransport(name, self)


class _Done(XferHandle):
    pass


class MemoryTransport(Transport):
    kind = "memory"

    def __init__(self, name: str, fabric: MemoryFabric) -> None:
        self._name = name
        self._fabric = fabric
        self._lock = threading.Lock()
        self._regions: list[Region] = []
        self._buffers: list[torch.Tensor] = []  # keep registered memory alive
        self._peers: set[str] = set()
        self._inbox: list[tuple[str, bytes]] = []
        self._closed = False
        fabric.attach(self)

    @property
    def name(self) -> str:
        return self._name

    def register(self, tensor: torch.Tensor) -> Region:
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise TransportError("memory transport: can only register contiguous host tensors")
        region = Region(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
        with self._lock:
            self._regions.append(region)
            self._buffers.append(tensor)
        return region

    def metadata(self) -> bytes:
        return self._name.encode()

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode()
        with self._lock:
            self._peers.add(name)
        return name

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            self._peers.discard(peer)

    def connect(self, peer: str) -> None:
        self._live_peer(peer)

    def _live_peer(self, peer: str) -> MemoryTransport:
        with self._lock:
            known = peer in self._peers
        target = self._fabric.lookup(peer) if known else None
        if target is None or target._closed:
            raise TransportError(f"memory transport: peer {peer!r} is unknown or gone")
        return target

    def _owns(self, addr: int, nbytes: int) -> bool:
        with self._lock:
            return any(r.contains(addr, nbytes) for r in self._regions)

    def write(self, peer: str, pieces: Sequence[Piece], notif: bytes,
              remote_region: Region | None = None) -> XferHandle:
        target = self._live_peer(peer)
        merged = merge_pieces(pieces)
        for local, remote, n in merged:
            if not self._owns(local, n):
                raise TransportError(f"memory transport: local range {local:#x}+{n} is not registered")
            if not target._owns(remote, n):
                raise TransportError(f"memory transport: remote range {remote:#x}+{n} is not registered at {peer}")
        for local, remote, n in merged:
            ctypes.memmove(remote, local, n)
        target._deliver(self._name, notif)
        return _Done()

    def notify(self, peer: str, notif: bytes) -> None:
        self._live_peer(peer)._deliver(self._name, notif)

    def _deliver(self, sender: str, notif: bytes) -> None:
        with self._lock:
            if not self._closed:
                self._inbox.append((sender, notif))

    def poll(self, handle: XferHandle) -> XferState:
        return "done"

    def release(self, handle: XferHandle) -> None:
        pass

    def notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._regions.clear()
            self._buffers.clear()
        self._fabric.detach(self)
