"""Finding a dead peer on a TCP connection within a bound, without a byte on the wire of
the protocol above it.

A host that vanishes (its link down, its node powered off) sends no FIN and no RST: the
other end's kernel learns nothing until it has something to send, and then retransmits
for ~15 minutes (``tcp_retries2``) before it gives up. A relay that only reads (the
router reading a decode server's token stream) learns nothing at all. So every connection
between the roles gets, with :func:`detect_dead_peer`:

- TCP keepalive: after ``idle`` seconds without a byte from the peer, a probe every
  ``interval`` seconds; ``count`` unanswered probes end the connection (``ETIMEDOUT``).
  The peer's kernel answers them whatever its application is doing, so a server that is
  merely slow (a long prefill, a first token waiting for its KV) is never cut;
- ``TCP_USER_TIMEOUT``: data of ours the peer has not acknowledged for the same total ends
  the connection too (a server writing tokens to a router that is gone).

The bound is ``idle + interval * count`` seconds after the peer's last byte. Linux only;
elsewhere the options that do not exist are skipped.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeadPeer:
    """How soon a silent, unreachable peer is given up: within :attr:`bound_s` seconds."""

    idle: int = 3
    interval: int = 1
    count: int = 3

    @classmethod
    def within(cls, seconds: float) -> DeadPeer:
        """Settings whose bound is at most ``seconds`` (>= 3): a third idle, the rest probes."""
        total = max(3, int(seconds))
        idle = max(1, total // 3)
        interval = max(1, (total - idle) // 3)
        return cls(idle=idle, interval=interval, count=max(1, (total - idle) // interval))

    @property
    def bound_s(self) -> int:
        return self.idle + self.interval * self.count


def detect_dead_peer(sock: socket.socket | Any, dead: DeadPeer) -> None:
    """Set keepalive and the user timeout on ``sock`` (a socket, or asyncio's TransportSocket)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", dead.idle), ("TCP_KEEPINTVL", dead.interval),
                        ("TCP_KEEPCNT", dead.count), ("TCP_USER_TIMEOUT", dead.bound_s * 1000)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def detect_dead_peer_on(transport: Any, dead: DeadPeer | None) -> None:
    """:func:`detect_dead_peer` on an asyncio transport's socket (if it is a TCP one)."""
    if dead is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        detect_dead_peer(sock, dead)


def dead_peer_protocol(base: type[Any], dead: DeadPeer) -> type[Any]:
    """uvicorn's HTTP protocol class ``base`` with :func:`detect_dead_peer` on every accepted
    connection (pass as ``uvicorn.Config(http=...)``)."""

    class DeadPeerProtocol(base):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            detect_dead_peer_on(transport, dead)

    return DeadPeerProtocol
