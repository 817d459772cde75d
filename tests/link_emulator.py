"""A node's cable as a lossy, slow link, in user space (tests/nodes.py, ``Nodes(emulated=...)``).

This machine's kernel has no netem qdisc (nor fq, cake, act_gact or nft's queue
expression: docs/deploy.md, "Rehearsal"), so loss and delay on a link between nodes are
made here: the node's ``eth0`` and its switch port are TAP devices instead of a veth pair,
and this process moves every Ethernet frame between them, dropping each with probability
``loss`` and delivering the others ``delay_s`` after they left. TAP devices without a
virtio header take no offloads, so the kernel hands over frames of at most the link's MTU,
checksummed: the loss is per packet, as on a wire.

It runs as its own process (its own interpreter lock: the test's threads cannot stall the
link), started by :class:`EmulatedCable`; commands come one per line on stdin and each is
answered ``ok`` on stdout once in force::

    impair <loss 0..1> <delay seconds>
    stats          -> "ok <frames passed> <frames dropped by the impairment> <frames lost: a port down or full>"
"""

from __future__ import annotations

import fcntl
import heapq
import os
import random
import selectors
import struct
import subprocess
import sys
import time
from pathlib import Path

from tests.nodes import enter_netns

_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000
_FRAME = 65536


def open_tap(netns: str, name: str) -> int:
    """An fd on TAP device ``name`` of ``netns`` (made by ``ip tuntap``), non-blocking."""
    enter_netns(netns)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


class Link:
    """The two ends and the frames in flight between them (a heap by delivery time)."""

    def __init__(self, a: int, b: int) -> None:
        self.peer = {a: b, b: a}
        self.loss, self.delay_s = 0.0, 0.0
        self.in_flight: list[tuple[float, int, int, bytes]] = []
        self.passed = self.dropped = 0  # dropped: by the impairment (loss) only
        self.lost = 0  # a write to a port failed (down: a pulled cable; or its queue full on a starved machine)
        self._seq = 0

    def carry(self, src: int, now: float) -> None:
        while True:
            try:
                frame = os.read(src, _FRAME)
            except BlockingIOError:
                return
            if self.loss and random.random() < self.loss:
                self.dropped += 1
                continue
            self._seq += 1
            heapq.heappush(self.in_flight, (now + self.delay_s, self._seq, self.peer[src], frame))

    def deliver(self, now: float) -> float | None:
        """Write the frames due by ``now``; the seconds until the next one is due (None: none)."""
        while self.in_flight and self.in_flight[0][0] <= now:
            _, _, dst, frame = heapq.heappop(self.in_flight)
            try:
                os.write(dst, frame)
                self.passed += 1
            except OSError:  # the port is down (a pulled cable) or cannot take it now: the frame is lost
                self.lost += 1
        return self.in_flight[0][0] - now if self.in_flight else None


def _command(link: Link, line: str) -> str:
    words = line.split()
    if words[:1] == ["impair"] and len(words) == 3:
        link.loss, link.delay_s = float(words[1]), float(words[2])
        return "ok"
    if words == ["stats"]:
        return f"ok {link.passed} {link.dropped} {link.lost}"
    return f"error: unknown command {line.strip()!r}"


def main(node_ns: str, node_tap: str, switch_ns: str, switch_tap: str) -> None:
    a, b = open_tap(node_ns, node_tap), open_tap(switch_ns, switch_tap)
    link = Link(a, b)
    sel = selectors.DefaultSelector()
    sel.register(a, selectors.EVENT_READ)
    sel.register(b, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    print("ok", flush=True)  # both ends attached: the node's link has its carrier
    wait: float | None = None
    while True:
        for key, _ in sel.select(wait):
            if key.fileobj is sys.stdin:
                line = sys.stdin.readline()
                if not line:
                    return  # the test is gone
                print(_command(link, line), flush=True)
            else:
                link.carry(key.fd, time.monotonic())
        wait = link.deliver(time.monotonic())


class EmulatedCable:
    """The process carrying one node's frames (``tests.link_emulator``): :meth:`impair` sets
    loss and delay, :meth:`stats` counts frames."""

    def __init__(self, node_ns: str, node_tap: str, switch_ns: str, switch_tap: str) -> None:
        root = Path(__file__).resolve().parents[1]
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.link_emulator", node_ns, node_tap, switch_ns,
                                       switch_tap], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, bufsize=1)
        self._expect_ok()

    def _expect_ok(self) -> str:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line.startswith("ok"):
            self.close()
            raise RuntimeError(f"the link emulator answered {line!r} (exit {self._proc.poll()})")
        return line

    def _ask(self, command: str) -> str:
        assert self._proc.stdin is not None
        self._proc.stdin.write(command + "\n")
        return self._expect_ok()

    def impair(self, loss: float = 0.0, delay_s: float = 0.0) -> None:
        """From now on: each frame dropped with probability ``loss``, the others ``delay_s`` late."""
        self._ask(f"impair {loss!r} {delay_s!r}")

    def stats(self) -> tuple[int, int]:
        """Frames passed and dropped (by the impairment) so far."""
        _, passed, dropped, _lost = self._ask("stats").split()
        return int(passed), int(dropped)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)


if __name__ == "__main__":
    main(*sys.argv[1:5])
