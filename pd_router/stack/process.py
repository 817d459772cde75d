"""Child processes of the local stack: own process group, log file, readiness wait, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

import httpx


class ProcessExited(RuntimeError):
    pass


class ManagedProcess:
    """A child process in its own process group, output to a log file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_until(self, check: Callable[[], bool], timeout: float, what: str, interval: float = 0.25) -> None:
        """Poll ``check`` until true; fail early if the process dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ProcessExited(f"{self.name} exited with {self.proc.returncode} while waiting for {what}; "
                                    f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if check():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(interval)
        raise TimeoutError(f"{self.name}: {what} not reached after {timeout:.0f}s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    def wait_http(self, url: str, timeout: float, status: int = 200) -> None:
        self.wait_until(lambda: httpx.get(url, timeout=2.0).status_code == status, timeout, f"{url} -> {status}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the whole group, SIGKILL after ``timeout``; always closes the log."""
        try:
            if self.alive():
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(5)
            # reap stragglers left in the group (e.g. vLLM's engine-core child)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        except ProcessLookupError:
            pass
        finally:
            self._log.close()
