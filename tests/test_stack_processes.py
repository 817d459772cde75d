"""The launcher's guards on plain processes (no vLLM): a taken port stops it before anything
starts, a readiness probe answered by a process that is not its child does not pass, and
no child outlives a launcher killed by SIGKILL (issue 17)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pd_deploy.commands import decode_server_argv, router_argv, vllm_prefill_argv
from pd_deploy.stack.launcher import StackConfig
from pd_deploy.stack.ports import PortInUse, PortNeed, check_free
from pd_deploy.stack.process import ManagedProcess, NotOurServer
from tests.procs import REPO, ephemeral_ports, free_port
from tests.waits import wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.integration]  # integration: real process trees, kill -9, the reaper


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_taken_port_is_named_with_its_process():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortInUse) as exc:
            check_free([PortNeed("127.0.0.1", free_port(), "router (--router-port)"),
                        PortNeed("127.0.0.1", port, "decode-0 HTTP (--decode-port)")])
    message = str(exc.value)
    assert f"port {port} for the decode-0 HTTP (--decode-port)" in message and "already in use" in message
    assert f"pid {os.getpid()}" in message, message


def test_ports_two_servers_would_share_are_refused():
    cfg = StackConfig(model_dir=Path("/m"), log_dir=Path("/l"), decode_port=8200, kv_port=8201, num_decode=2)
    with pytest.raises(PortInUse, match="port 8201 would serve both the decode-0 KV control"):
        check_free(cfg.port_needs())


def test_a_probe_answered_by_a_process_not_its_own_does_not_pass(tmp_path):
    port = free_port()
    stale = ManagedProcess("stale", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                           tmp_path / "stale.log")
    impostor = ManagedProcess("decode-0", [sys.executable, "-c", "import time; time.sleep(60)"],
                              tmp_path / "decode.log")
    try:
        stale.wait_http(f"http://127.0.0.1:{port}/", 30)  # its own answer passes
        with pytest.raises(NotOurServer) as exc:
            impostor.wait_http(f"http://127.0.0.1:{port}/", 30)
        assert f"port {port}" in str(exc.value) and f"pid {stale.pid}" in str(exc.value), str(exc.value)
    finally:
        impostor.stop()
        stale.stop()


# A stand-in launcher: a reaper and two children in their own groups; the first starts a
# grandchild that ignores SIGTERM (as an engine core busy elsewhere might), the second
# ignores SIGTERM itself. It prints their pids, then waits to be killed.
LAUNCHER = """
import json, sys, time
from pathlib import Path
from pd_deploy.stack.process import ManagedProcess, Reaper

IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
SPAWNER = ("import subprocess, sys, time; "
           f"g = subprocess.Popen([sys.executable, '-c', {IGNORE_TERM!r}]); "
           "print(g.pid, flush=True); time.sleep(120)")
logs = Path(sys.argv[1])
reaper = Reaper()
children = [ManagedProcess("spawner", [sys.executable, "-c", SPAWNER], logs / "spawner.log"),
            ManagedProcess("stubborn", [sys.executable, "-c", IGNORE_TERM], logs / "stubborn.log")]
for child in children:
    reaper.watch(child)
deadline = time.monotonic() + 30
while not (logs / "spawner.log").read_text().strip() and time.monotonic() < deadline:
    time.sleep(0.05)
grandchild = int((logs / "spawner.log").read_text())
print(json.dumps({"children": [c.pid for c in children], "grandchild": grandchild, "reaper": reaper.proc.pid}),
      flush=True)
time.sleep(120)
"""


def test_nothing_outlives_a_launcher_killed_by_sigkill(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], stdout=subprocess.PIPE,
                                env=env, cwd=REPO, text=True)
    pids: dict = {}
    try:
        pids = json.loads(launcher.stdout.readline())
        started = [*pids["children"], pids["grandchild"]]
        assert all(_alive(p) for p in started)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        took = wait_until(lambda: not any(_alive(p) for p in started), 5.0, "every child and grandchild gone", 0.05)
        print(f"stack gone {took:.2f}s after the launcher's SIGKILL")
        wait_until(lambda: not _alive(pids["reaper"]), 5.0, "the reaper gone", 0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in [*pids.get("children", []), pids.get("grandchild"), pids.get("reaper")]:
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_one_otlp_endpoint_reaches_every_process():
    cfg = StackConfig(model_dir=Path("/m"), log_dir=Path("/l"), num_decode=2,
                      otlp_traces_endpoint="http://127.0.0.1:4317")
    argvs = [vllm_prefill_argv(cfg.prefill_spec()), router_argv(cfg.router_spec()),
             *(decode_server_argv(d) for d in cfg.decode_specs())]
    for argv in argvs:
        i = argv.index("--otlp-traces-endpoint")
        assert argv[i + 1] == "http://127.0.0.1:4317", argv
    plain = StackConfig(model_dir=Path("/m"), log_dir=Path("/l"))
    assert "--otlp-traces-endpoint" not in router_argv(plain.router_spec())


def test_free_ports_are_outside_the_ephemeral_range():
    """An outgoing connection takes its local port from the ephemeral range: a test server's
    port chosen there can be taken before the server binds it."""
    ephemeral = ephemeral_ports()
    ports = {free_port() for _ in range(50)}
    assert not any(p in ephemeral for p in ports), sorted(p for p in ports if p in ephemeral)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free indeed
