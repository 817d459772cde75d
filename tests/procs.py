"""Start real server processes on loopback for integration tests, and always stop them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A child process (own process group) with its log in a file."""

    def __init__(self, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO,
            start_new_session=True,
        )

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_http(self, url: str, timeout: float, ok_status: int = 200) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[:4]} exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(url, timeout=2.0).status_code == ok_status:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{url} not {ok_status} after {timeout}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(5)
        self._log.close()


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
