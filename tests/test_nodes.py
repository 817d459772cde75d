"""The multi-node fixture itself (tests/nodes.py): hostnames, names resolved as on a
cluster, traffic between nodes and only between them, a pulled cable, an emulated lossy and
slow cable (tests/link_emulator.py), and nothing left behind, also by a run that was killed."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pd_deploy.stack.process import ManagedProcess
from tests.nodes import ETC_NETNS, Nodes, _ip, netns_names, remove_stale
from tests.waits import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]  # root: network namespaces

RESOLVE = "import socket; print(socket.gethostname(), *(socket.gethostbyname(n) for n in __import__('sys').argv[1:]))"


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout.strip()


def _connects(address: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def test_nodes_have_their_names_and_reach_each_other_by_them(tmp_path: Path) -> None:
    with Nodes(2) as nodes:
        a, b = nodes[0], nodes[1]
        assert _run(a.argv([sys.executable, "-c", RESOLVE, a.name, b.name])).split() == [a.name, a.address, b.address]
        assert _run(b.argv(["hostname"])) == b.name
        assert socket.gethostname() not in (a.name, b.name)  # the machine's own is untouched
        listener = ManagedProcess("listener", b.argv([sys.executable, "-m", "http.server", "--bind", b.address,
                                                      "8765"]), tmp_path / "http.log")
        try:
            wait_until(lambda: a.call(_connects, b.address, 8765, 1.0), 30, "node 0 to reach node 1")
            fetch = f"import urllib.request; print(urllib.request.urlopen('http://{b.name}:8765/').status)"
            assert _run(a.argv([sys.executable, "-c", fetch])) == "200"  # by name, from a process on node 0
            assert not a.call(_connects, "127.0.0.1", 8765, 1.0)  # each node has its own loopback
            b.cable(up=False)
            assert not a.call(_connects, b.address, 8765, 1.0), "connected over a pulled cable"
            b.cable(up=True)
            wait_until(lambda: a.call(_connects, b.address, 8765, 1.0), 30, "the link back up")
        finally:
            listener.stop()
        made = [node.netns for node in nodes.nodes] + [nodes.switch]
        assert set(made) <= set(netns_names())
    assert not set(made) & set(netns_names())
    assert not any((ETC_NETNS / name).exists() for name in made)


def test_processes_on_a_node_go_with_it(tmp_path: Path) -> None:
    with Nodes(1) as nodes:
        sleeper = subprocess.Popen(nodes[0].argv(["sleep", "300"]))
        wait_until(lambda: str(sleeper.pid) in _ip("netns", "pids", nodes[0].netns).stdout.split(), 10,
                   "the process to run in the node")
    assert sleeper.wait(10) == -9


def test_what_a_killed_run_left_is_removed_by_the_next() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = f"pdt-{gone.pid}-0-n0"  # named as a run with that (now dead) pid names its nodes
    _ip("netns", "add", left)
    (ETC_NETNS / left).mkdir(parents=True, exist_ok=True)
    try:
        remove_stale()
        assert left not in netns_names() and not (ETC_NETNS / left).exists()
    finally:
        _ip("netns", "del", left, check=False)


def _echo_server(srv: socket.socket) -> None:
    """Echo every connection's bytes, one connection after another, until ``srv`` is shut down."""
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)


def _round_trips(address: str, port: int, n: int, size: int) -> float:
    """Seconds per round trip of ``size`` bytes echoed, mean of ``n``."""
    with socket.create_connection((address, port), timeout=30) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        for _ in range(n):
            conn.sendall(b"x" * size)
            got = 0
            while got < size:
                got += len(conn.recv(65536))
        return (time.perf_counter() - t0) / n


def test_an_emulated_cable_carries_drops_and_delays_frames() -> None:
    """Node 1's cable is the link emulator's: traffic crosses it whole; impaired, frames are
    dropped (each at most the MTU: TCP still delivers every byte) and a round trip takes at
    least twice the delay; a pulled cable stops it."""
    with Nodes(2, emulated=frozenset({1})) as nodes:
        a, b, link = nodes[0], nodes[1], nodes.link(1)
        srv = b.call(socket.create_server, (b.address, 8766))
        threading.Thread(target=_echo_server, args=(srv,), daemon=True).start()
        try:
            a.call(_round_trips, b.address, 8766, 5, 100_000)
            passed, dropped = link.stats()
            assert passed > 2 * 5 * 100_000 // 1500 and dropped == 0  # MTU-sized frames, none lost
            link.impair(loss=0.05, delay_s=0.01)
            rtt = a.call(_round_trips, b.address, 8766, 5, 100_000)
            assert link.stats()[1] > 0, "no frame dropped at 5% loss"
            assert rtt >= 0.02, f"a round trip took {rtt * 1e3:.1f} ms through a 10 ms link each way"
            link.impair()
            b.cable(up=False)
            assert not a.call(_connects, b.address, 8766, 1.0), "connected over a pulled cable"
            b.cable(up=True)
            wait_until(lambda: a.call(_connects, b.address, 8766, 1.0), 30, "the emulated link back up")
        finally:
            srv.shutdown(socket.SHUT_RDWR)  # wakes its accept()
            srv.close()
