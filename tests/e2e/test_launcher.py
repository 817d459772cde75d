"""`make run`'s launcher as a user runs it: prints working calls, Ctrl-C leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, _ports
from tests.procs import REPO

pytestmark = pytest.mark.slow


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_launcher_prints_calls_that_work_and_ctrl_c_stops_everything(tiny_model_dir, tmp_path):
    router, prefill, decode, kv = _ports(4)
    argv = [sys.executable, "-m", "pd_deploy.stack", "--model-dir", str(tiny_model_dir),
            "--served-model-name", MODEL_NAME, "--log-dir", str(tmp_path / "logs"),
            "--router-port", str(router), "--prefill-port", str(prefill), "--decode-port", str(decode),
            "--kv-port", str(kv)]
    out_path = tmp_path / "stdout.txt"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 400
        while "Press Ctrl-C" not in out_path.read_text(errors="replace"):
            assert proc.poll() is None, out_path.read_text(errors="replace")
            assert time.monotonic() < deadline, out_path.read_text(errors="replace")
            time.sleep(0.5)
        printed = out_path.read_text()
        assert f"http://127.0.0.1:{router}/v1/chat/completions" in printed
        assert "from openai import OpenAI" in printed
        assert f'"model": "{MODEL_NAME}"' in printed and f'model="{MODEL_NAME}"' in printed  # as the README says
        # the printed curl command, run as printed
        curl = printed.split("curl:\n", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
        result = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and '"choices"' in result.stdout, result.stdout + result.stderr
        # the printed SDK snippet, run as printed
        snippet = printed.split("OpenAI SDK (pip install openai):\n", 1)[1].split("\n\n", 1)[0]
        code = "\n".join(line[2:] for line in snippet.splitlines())
        # the tiny model's text may be only whitespace: the answer's token count says it decoded
        code += "\nprint('completion_tokens', out.usage.completion_tokens)"
        sdk = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert sdk.returncode == 0, sdk.stderr
        assert int(sdk.stdout.rsplit("completion_tokens ", 1)[1]) > 0, sdk.stdout
        assert httpx.get(f"http://127.0.0.1:{router}/ready", timeout=5).status_code == 200

        started = _descendants(proc.pid)
        assert len(started) >= 3, started
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in started if _alive(p)], "processes left behind after Ctrl-C"
    finally:
        leftover = _descendants(proc.pid)  # before the kill: orphans are no longer its descendants
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
