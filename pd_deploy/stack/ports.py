"""Who holds a TCP port: the launcher's checks before it starts anything (a port taken,
say by a stack left from an earlier run) and after each readiness probe (the answer came
from its own child, not from a stale server on the same port)."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import psutil


class PortInUse(RuntimeError):
    """A port the stack needs is taken, or two of its servers would share one."""


@dataclass(frozen=True)
class PortNeed:
    host: str
    port: int
    purpose: str  # what binds it and the option that sets it, e.g. "decode-0 HTTP (--decode-port)"


def _describe(pid: int) -> str:
    try:
        proc = psutil.Process(pid)
        cmd = " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return f"pid {pid}"
    return f"pid {pid} ({cmd[:160]})"


def listeners(port: int) -> list[int]:
    """Pids with a listening TCP socket on ``port`` that the OS lets this user see."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:  # some systems list other users' sockets only to root
        return []
    return sorted({c.pid for c in conns if c.pid is not None and c.status == psutil.CONN_LISTEN
                   and c.laddr and c.laddr.port == port})


def owner_text(port: int) -> str:
    pids = listeners(port)
    if not pids:
        return "a process the OS does not name to this user"
    return ", ".join(_describe(pid) for pid in pids)


def _bind_error(host: str, port: int) -> OSError | None:
    """Bind as the servers do (SO_REUSEADDR, as uvicorn and asyncio set it); the error, if any."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc
    return None


def check_free(needs: Iterable[PortNeed]) -> None:
    """Raise :class:`PortInUse` naming the first port that two servers share or that is
    already taken (and, where the OS tells, by which process)."""
    seen: dict[int, PortNeed] = {}
    needs = list(needs)
    for need in needs:
        other = seen.get(need.port)
        if other is not None:
            raise PortInUse(f"port {need.port} would serve both the {other.purpose} and the {need.purpose}; "
                            "choose ports that do not overlap")
        seen[need.port] = need
    for need in needs:
        err = _bind_error(need.host, need.port)
        if err is None:
            continue
        if err.errno == errno.EADDRINUSE:
            raise PortInUse(f"port {need.port} for the {need.purpose} on {need.host} is already in use by "
                            f"{owner_text(need.port)}: stop it (an earlier stack?) or choose another port")
        raise PortInUse(f"cannot bind port {need.port} for the {need.purpose} on {need.host}: {err}")


def tree_listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` or one of its descendants listens on TCP ``port``."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for proc in procs:
        try:
            conns = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            return True
    return False
