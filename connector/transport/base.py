"""The data-transport interface: one-sided WRITEs from registered local memory into a
peer's registered memory, each carrying a notification for the peer.

Implementations: :class:`connector.transport.nixl.NixlTransport` (UCX over NIXL; DRAM on
CPU, VRAM on GPU) and, in the tests, ``tests/fakes/memory_transport.py`` (an in-process
fake, same semantics and checks). ``kind`` names the implementation; both ends of a
handoff must use the same (checked by the handshake).

Contract:

* ``register(tensor)`` registers a contiguous tensor once and returns its
  :class:`Region`; regions travel to peers with :func:`encode_regions`.
* ``metadata()`` is this agent's connection info; a peer passes it to ``add_peer``
  (which returns this agent's name) and may pre-warm with ``connect``.
* ``write(peer, pieces, notif, remote_region)`` queues one WRITE of ``(local_addr,
  remote_addr, nbytes)`` pieces into the peer's region ``remote_region`` (None: host
  memory); adjacent pieces are merged first (:func:`merge_pieces`); the
  notification reaches the peer after the data. It returns a handle to ``poll``
  ("pending" / "done" / "error") and ``release``. Errors raise :class:`TransportError`.
* ``notify(peer, msg)`` sends a standalone notification (no data) to a known peer.
* ``notifications()`` drains the notifications received: ``[(peer_name, bytes)]``.
* ``carrier(nbytes)`` names what carries this agent's WRITEs of ``nbytes`` to its peers
  (NIXL: the UCX transport, e.g. ``tcp/eth0``; ``unknown`` when it cannot tell).

Implementations are thread-safe: a sender thread writes while another thread
handshakes. Nothing here has timeouts: callers bound every wait themselves.
"""

from __future__ import annotations

import base64
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

XferState = Literal["pending", "done", "error"]
_REGION = struct.Struct("<QQQQ")
_MEMS = ("DRAM", "VRAM")


@dataclass(frozen=True)
class Region:
    addr: int
    nbytes: int
    device: int = 0  # the GPU index for VRAM, 0 for host memory
    mem: str = "DRAM"  # "DRAM" (host) or "VRAM" (GPU)

    def contains(self, addr: int, nbytes: int) -> bool:
        return self.addr <= addr and addr + nbytes <= self.addr + self.nbytes


def encode_regions(regions: Sequence[Region]) -> str:
    """Regions as base64 of little-endian (addr, nbytes, device, 0=DRAM|1=VRAM) uint64 quadruples."""
    return base64.b64encode(b"".join(_REGION.pack(r.addr, r.nbytes, max(r.device, 0), _MEMS.index(r.mem))
                                     for r in regions)).decode()


def decode_regions(text: str) -> list[Region]:
    raw = base64.b64decode(text, validate=True)
    if not raw or len(raw) % _REGION.size:
        raise ValueError(f"region descriptors of {len(raw)} bytes: not a multiple of {_REGION.size}")
    regions = []
    for i in range(0, len(raw), _REGION.size):
        addr, nbytes, device, mem = _REGION.unpack_from(raw, i)
        if mem >= len(_MEMS):
            raise ValueError(f"region descriptor with unknown memory kind {mem}")
        regions.append(Region(addr, nbytes, device, _MEMS[mem]))
    return regions


Piece = tuple[int, int, int]  # (local_addr, remote_addr, nbytes)


def merge_pieces(pieces: Sequence[Piece]) -> list[Piece]:
    """Merge pieces that continue each other on both sides (fewer, larger descriptors)."""
    merged: list[Piece] = []
    for local, remote, n in sorted(pieces, key=lambda p: p[0]):
        if n <= 0:
            continue
        if merged:
            pl, pr, pn = merged[-1]
            if pl + pn == local and pr + pn == remote:
                merged[-1] = (pl, pr, pn + n)
                continue
        merged.append((local, remote, n))
    return merged


class XferHandle:
    """One posted WRITE (each transport subclasses it)."""


class Transport(ABC):
    kind: str

    @property
    @abstractmethod
    def name(self) -> str: ...

    @abstractmethod
    def register(self, tensor: torch.Tensor) -> Region: ...

    @abstractmethod
    def metadata(self) -> bytes: ...

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str: ...

    @abstractmethod
    def remove_peer(self, peer: str) -> None: ...

    @abstractmethod
    def connect(self, peer: str) -> None: ...

    @abstractmethod
    def write(self, peer: str, pieces: Sequence[Piece], notif: bytes,
              remote_region: Region | None = None) -> XferHandle: ...

    @abstractmethod
    def notify(self, peer: str, notif: bytes) -> None: ...

    @abstractmethod
    def poll(self, handle: XferHandle) -> XferState: ...

    @abstractmethod
    def release(self, handle: XferHandle) -> None: ...

    @abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]: ...

    def carrier(self, nbytes: int) -> str:
        return self.kind

    @abstractmethod
    def close(self) -> None: ...
