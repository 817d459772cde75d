"""Start real server processes on loopback for integration tests, and always stop them."""

from __future__ import annotations

import random
import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from pd_deploy.stack.process import ManagedProcess

REPO = Path(__file__).resolve().parents[1]


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports() -> range:
    """The kernel's range for the local ports of outgoing connections (and of ``bind(0)``)."""
    try:
        low, high = (int(v) for v in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the kernel's ephemeral range. A port from
    ``bind(0)`` comes from that range, and until the server meant for it binds it (seconds
    later for a stack whose vLLM starts first) any outgoing connection, a probe or vLLM's
    own, may take it as its local port: the server then fails with EADDRINUSE (seen once
    in a clean-clone run, the e2e stack's router)."""
    ephemeral = ephemeral_ports()
    below, above = range(20000, min(ephemeral.start, 65536)), range(max(ephemeral.stop, 20000), 65536)
    outside = below if len(below) >= len(above) else above
    if not outside:  # the whole range is ephemeral: what bind(0) gives
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = random.choice(outside)
        if port_is_free(port):
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 in {outside}")


def port_is_free(port: int) -> bool:
    """Nothing is bound to 127.0.0.1:``port`` now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ServerProcess(ManagedProcess):
    """A ManagedProcess run from the repository root with the repo on PYTHONPATH."""

    def __init__(self, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        import os

        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        super().__init__(Path(argv[0]).name, argv, log_path, env={"PYTHONPATH": path, **(env or {})}, cwd=REPO)


@contextmanager
def server(argv: Sequence[str], log_path: Path, ready_url: str | None = None, timeout: float = 180.0,
           env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    proc = ServerProcess(argv, log_path, env)
    try:
        if ready_url:
            proc.wait_http(ready_url, timeout)
        yield proc
    finally:
        proc.stop()


def python_argv(*args: str) -> list[str]:
    return [sys.executable, *args]
