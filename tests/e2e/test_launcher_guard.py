"""`make run` twice, and a launcher killed by SIGKILL (issue 17): a second launcher while one
runs fails fast naming the busy port (never "The PD stack is up" on the first one's
servers), and `kill -9` of the launcher leaves no process of its stack alive within 5 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import MODEL_NAME, _ports
from tests.e2e.test_launcher import _alive, _descendants
from tests.procs import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _launcher_argv(model_dir: Path, log_dir: Path, ports: list[int]) -> list[str]:
    router, prefill, decode, kv = ports
    return [sys.executable, "-m", "pd_deploy.stack", "--model-dir", str(model_dir), "--served-model-name", MODEL_NAME,
            "--log-dir", str(log_dir), "--router-port", str(router), "--prefill-port", str(prefill),
            "--decode-port", str(decode), "--kv-port", str(kv)]


def test_second_launcher_fails_fast_and_kill_9_leaves_nothing(tiny_model_dir, tmp_path):
    ports = _ports(4)
    out_path = tmp_path / "first.txt"
    with open(out_path, "wb") as out:
        first = subprocess.Popen(_launcher_argv(tiny_model_dir, tmp_path / "logs1", ports), stdout=out,
                                 stderr=subprocess.STDOUT, cwd=REPO)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 400
        while "Press Ctrl-C" not in out_path.read_text(errors="replace"):
            assert first.poll() is None, out_path.read_text(errors="replace")
            assert time.monotonic() < deadline, out_path.read_text(errors="replace")
            time.sleep(0.5)

        t0 = time.monotonic()
        second = subprocess.run(_launcher_argv(tiny_model_dir, tmp_path / "logs2", ports), capture_output=True,
                                text=True, cwd=REPO, timeout=120)
        took = time.monotonic() - t0
        said = second.stdout + second.stderr
        print(f"second launcher exited {second.returncode} after {took:.1f}s:\n{said}")
        assert second.returncode != 0, said
        assert "The PD stack is up" not in said, said
        assert f"port {ports[0]} for the router (--router-port)" in said and "already in use" in said, said
        assert took < 30, f"the second launcher took {took:.0f}s to fail"
        assert first.poll() is None, "the second launcher disturbed the first"

        started = _descendants(first.pid)
        assert len(started) >= 4, started  # reaper, decode, vLLM (+ its engine core), router
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        t_kill = time.monotonic()
        while any(_alive(p) for p in started) and time.monotonic() - t_kill < 5.0:
            time.sleep(0.1)
        left = [p for p in started if _alive(p)]
        print(f"after kill -9: {len(started)} processes, all gone within {time.monotonic() - t_kill:.1f}s"
              if not left else f"left: {left}")
        assert not left, f"processes of the stack alive 5 s after kill -9 of the launcher: {left}"
    finally:
        leftover = started | _descendants(first.pid)
        if first.poll() is None:
            first.kill()
            first.wait(10)
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
