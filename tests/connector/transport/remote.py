"""Start tests.connector.transport.receiver_proc as a child process (always stopped)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.procs import ServerProcess, python_argv

ENV = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}


class RemoteReceiver:
    def __init__(self, proc: ServerProcess, endpoint: str, result_file: Path) -> None:
        self.proc = proc
        self.endpoint = endpoint
        self.result_file = result_file

    def results(self, count: int, timeout: float) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.result_file.read_text().splitlines() if self.result_file.exists() else []
            if len(lines) >= count:
                return [json.loads(line) for line in lines]
            if self.proc.proc.poll() is not None and len(lines) < count:
                raise RuntimeError(f"receiver exited {self.proc.proc.returncode}:\n{self.proc.log_tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"no {count} results after {timeout}s:\n{self.proc.log_tail()}")


@contextmanager
def remote_receiver(tmp: Path, *args: str, start_timeout: float = 60.0, env: dict[str, str] = ENV,
                    on: Callable[[list[str]], list[str]] = list) -> Iterator[RemoteReceiver]:
    """The receiver process with ``env``; ``on``: how its command line runs elsewhere (e.g.
    ``Node.argv``: on a node of tests/nodes.py)."""
    endpoint_file, result_file = tmp / "endpoint", tmp / "results.jsonl"
    argv = python_argv("-m", "tests.connector.transport.receiver_proc", "--endpoint-file", str(endpoint_file),
                       "--result-file", str(result_file), *args)
    proc = ServerProcess(on(argv), tmp / "receiver.log", env)
    try:
        deadline = time.monotonic() + start_timeout
        while not endpoint_file.exists():
            if proc.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"receiver did not start:\n{proc.log_tail()}")
            time.sleep(0.05)
        yield RemoteReceiver(proc, endpoint_file.read_text(), result_file)
    finally:
        proc.stop()
