"""Child processes of the local stack: own process group, log file, readiness wait, stop,
and no life after the launcher's.

Each child runs in its own session and process group (a terminal's Ctrl-C reaches only the
launcher, which stops them in order). So that none outlives the launcher, however it dies:

* the kernel sends each child SIGTERM when the launcher dies (Linux ``PR_SET_PDEATHSIG``,
  set between fork and exec; Linux ties it to the thread that started the child, so it is
  set only for children started from the main thread);
* :class:`Reaper` (:mod:`pd_deploy.stack.reaper`) then stops each child's whole process
  group, which holds what the child started itself (vLLM's engine core, which does not
  watch its parent: on SIGTERM vLLM's API server shuts it down, on SIGKILL it would stay).

A readiness probe counts only when the listening socket that answered belongs to the child
or one of its descendants, so a stale server on the same port cannot pass for it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import httpx

from pd_deploy.stack import reaper
from pd_deploy.stack.ports import owner_text, tree_listens

_PR_SET_PDEATHSIG = 1


class ProcessExited(RuntimeError):
    pass


class NotOurServer(RuntimeError):
    """A readiness probe was answered by a process that is not the child (nor its descendant)."""


def _parent_death_signal(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` giving the child ``sig`` when this process dies (Linux), or None.
    Everything it needs is looked up here, before the fork."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    getppid, kill, getpid = os.getppid, os.kill, os.getpid

    def set_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if getppid() != parent:  # the launcher died before the signal was set
            kill(getpid(), sig)

    return set_signal


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
                                     env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True,
                                     preexec_fn=_parent_death_signal(signal.SIGTERM))

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
        """Wait until ``url`` answers ``status`` from this process (or a descendant)."""
        port = urlsplit(url).port
        if port is None:
            raise ValueError(f"{url}: the readiness URL must name its port")

        def answered() -> bool:
            if httpx.get(url, timeout=2.0).status_code != status:
                return False
            if not tree_listens(self.pid, port):
                raise NotOurServer(
                    f"{url} answered {status}, but port {port} is held by {owner_text(port)}, not by "
                    f"{self.name} (pid {self.pid}) or a process it started: a stale server from an earlier "
                    f"run, or another program that took the port? Stop it and start again")
            return True

        self.wait_until(answered, timeout, f"{url} -> {status}")

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


class Reaper:
    """The :mod:`pd_deploy.stack.reaper` process: stops every registered process group once
    this process is gone (or :meth:`close` is called)."""

    def __init__(self) -> None:
        # -I: nothing from the environment or the current directory; the script needs
        # only the standard library. Its own session: a terminal's signals do not reach it.
        self.proc = subprocess.Popen([sys.executable, "-I", reaper.__file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, start_new_session=True)
        self._pipe: IO[bytes] | None = self.proc.stdin

    def watch(self, proc: ManagedProcess) -> None:
        """Register ``proc``'s process group (it leads its own session, so its pgid is its pid)."""
        if self._pipe is None:
            return
        try:
            self._pipe.write(f"{proc.pid}\n".encode())
            self._pipe.flush()
        except BrokenPipeError:  # the reaper died: the parent-death signal still applies
            self._pipe = None

    def close(self, timeout: float = 10.0) -> None:
        """After the stack stopped: let the reaper check the groups and exit."""
        if self._pipe is not None:
            try:
                self._pipe.close()
            except BrokenPipeError:
                pass
            self._pipe = None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
