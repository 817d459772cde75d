"""Start real server processes on loopback for integration tests, and always stop them."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from pd_deploy.stack.process import ManagedProcess

REPO = Path(__file__).resolve().parents[1]


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.01) -> None:
    """Poll ``predicate`` (observable state) until it is true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
