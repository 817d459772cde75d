"""Hosts on one machine, for multi-node tests: each node a network namespace with its own
interface, address (198.18.0.0/15, the benchmarking range, used only on links made here),
hostname and name resolution as on a cluster, all joined by one switch.

    with Nodes(3) as nodes:
        proc = ManagedProcess("decode", nodes[1].argv([...]), log)  # runs on node 1
        nodes[0].call(httpx.get, f"http://{nodes[1].address}:8200/ready")  # from node 0, by address
        nodes[1].cable(up=False)  # the link between node 1 and the switch goes down

The switch is a bridge in a namespace of its own, so that nothing here touches the
machine's own network: a node's cable is the veth pair from its ``eth0`` to the switch
(the switch-side end is ``n<i>`` there), or, for the nodes made ``emulated``, two TAP
devices joined by a process that can drop and delay frames (tests/link_emulator.py: this
kernel has no netem). Processes run on a node through ``ip netns exec``
(which also gives them ``/etc/netns/<ns>/hosts`` as their ``/etc/hosts``: every node's
name resolves to its address, on every node) and ``unshare --uts`` (their hostname is the
node's). The test process itself reaches a node from a thread that entered the node's
network namespace (:meth:`Node.call`): sockets made there belong to the node.

Everything is removed on exit, also when the test fails; namespaces left by a run that was
killed (their names carry its pid) are removed by the next run. Needs root and ``ip``
(iproute2); without them :func:`require_nodes` fails naming what is missing.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from tests.link_emulator import EmulatedCable

T = TypeVar("T")

NETWORK = ipaddress.ip_network("198.18.0.0/24")  # inside 198.18.0.0/15
FIRST_HOST = 10  # node i is 198.18.0.(10 + i)
NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")
_PREFIX = "pdt-"
_NAME = re.compile(rf"^{_PREFIX}(\d+)-")
_CLONE_NEWNET = 0x40000000


def require_nodes() -> None:
    """Fail, naming the fix, when this machine cannot make nodes."""
    missing = [what for what, ok in (("root (network namespaces)", os.geteuid() == 0),
                                     ("ip (Debian's iproute2)", shutil.which("ip") is not None),
                                     ("unshare (util-linux)", shutil.which("unshare") is not None)) if not ok]
    if missing:
        raise RuntimeError(f"the multi-node tests need {', '.join(missing)}; CI runs as root with both")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def enter_netns(netns: str) -> None:
    """Move the calling thread (only it) into ``netns``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Node:
    index: int
    name: str  # its hostname, resolved on every node
    netns: str
    address: str
    switch: str  # the switch's namespace

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on this node: in its network namespace, with its hostname."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name, *argv]

    def call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """``fn(*args, **kwargs)`` on a thread inside this node's network namespace."""
        out: list[T] = []
        err: list[BaseException] = []

        def run() -> None:
            try:
                enter_netns(self.netns)
                out.append(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller
                err.append(exc)

        thread = threading.Thread(target=run, name=f"in-{self.name}", daemon=True)
        thread.start()
        thread.join()
        if err:
            raise err[0]
        return out[0]

    def cable(self, up: bool) -> None:
        """Plug (``up``) or pull this node's cable at the switch: the node keeps its own
        interface and address, packets between it and every other node stop."""
        _ip("-n", self.switch, "link", "set", f"n{self.index}", "up" if up else "down")


class Nodes:
    """``n`` nodes behind one switch (see the module's docstring); a context manager."""

    def __init__(self, n: int, name: str = "pdnode", emulated: frozenset[int] = frozenset()) -> None:
        """``emulated``: the nodes whose cable is a user-space link that can be made lossy and
        slow (:meth:`link`; tests/link_emulator.py), not a veth pair."""
        require_nodes()
        self._emulated = emulated
        self._links: dict[int, EmulatedCable] = {}
        self._run = f"{_PREFIX}{os.getpid()}-{id(self) & 0xffff:x}"
        self.switch = f"{self._run}-sw"
        hosts = list(NETWORK.hosts())
        self.nodes = [Node(i, f"{name}{i}", f"{self._run}-n{i}", str(hosts[FIRST_HOST - 1 + i]), self.switch)
                      for i in range(n)]

    def __getitem__(self, i: int) -> Node:
        return self.nodes[i]

    def __len__(self) -> int:
        return len(self.nodes)

    def hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        return "\n".join(lines + [f"{node.address} {node.name}" for node in self.nodes]) + "\n"

    def __enter__(self) -> Nodes:
        remove_stale()
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _create(self) -> None:
        from tests.link_emulator import EmulatedCable  # noqa: PLC0415 - it imports this module

        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "sw", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "sw", "up")
        hosts = self.hosts_file()
        for node in self.nodes:
            _ip("netns", "add", node.netns)
            (ETC_NETNS / node.netns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / node.netns / "hosts").write_text(hosts)
            _ip("-n", node.netns, "link", "set", "lo", "up")
            if node.index in self._emulated:
                _ip("-n", node.netns, "tuntap", "add", "dev", "eth0", "mode", "tap")
                _ip("-n", self.switch, "tuntap", "add", "dev", f"n{node.index}", "mode", "tap")
                self._links[node.index] = EmulatedCable(node.netns, "eth0", self.switch, f"n{node.index}")
            else:
                _ip("-n", node.netns, "link", "add", "eth0", "type", "veth", "peer", "name", f"n{node.index}",
                    "netns", self.switch)
            _ip("-n", node.netns, "addr", "add", f"{node.address}/{NETWORK.prefixlen}", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", f"n{node.index}", "master", "sw")
            _ip("-n", self.switch, "link", "set", f"n{node.index}", "up")

    def link(self, i: int) -> EmulatedCable:
        """Node ``i``'s emulated cable (it was made with ``emulated={i}``)."""
        return self._links[i]

    def remove(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
        for netns in [node.netns for node in self.nodes] + [self.switch]:
            _remove_netns(netns)


def _remove_netns(netns: str) -> None:
    """Kill what runs in ``netns``, delete it (its veth ends go with it) and its /etc/netns."""
    if (NETNS_DIR / netns).exists():
        pids = _ip("netns", "pids", netns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _ip("netns", "del", netns, check=False)
    shutil.rmtree(ETC_NETNS / netns, ignore_errors=True)


def remove_stale() -> None:
    """Remove the namespaces of earlier runs whose process is gone (a run killed mid-test)."""
    names = {p.name for p in NETNS_DIR.iterdir()} if NETNS_DIR.is_dir() else set()
    names |= {p.name for p in ETC_NETNS.iterdir()} if ETC_NETNS.is_dir() else set()
    for name in sorted(names):
        match = _NAME.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        _remove_netns(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def netns_names() -> list[str]:
    """This machine's named network namespaces made by these tests (for leak checks)."""
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(_PREFIX)) if NETNS_DIR.is_dir() else []
