"""A real single-node Slurm cluster (Debian's slurm-wlm + munge) in a temporary directory.

Everything private to the test: its own munge socket, slurm.conf, ports, state and
spool directories; the commands see it through ``SLURM_CONF``. The daemons are started
by us (no init system here) and stopped by the pids in their pid files.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.procs import free_port

PACKAGES = ("slurm-wlm", "munge")  # installed by `make system-deps` (make test runs it), never here


def require_installed() -> None:
    """Fail, naming the fix, when the Debian packages the cluster runs are missing."""
    if shutil.which("slurmctld", path="/usr/sbin:/usr/bin") and shutil.which("munged", path="/usr/sbin"):
        return
    raise RuntimeError(f"the Slurm tests need the Debian packages {' '.join(PACKAGES)}: run `make system-deps` "
                       "as root (make test does), or apt-get install them")


def _mem_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


class SlurmCluster:
    def __init__(self, root: Path, cpus: int = 16) -> None:
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus
        self.conf = root / "slurm.conf"
        # munged runs as the munge user and checks every directory above its files: keep
        # them in a directory of their own outside the (root-only) pytest temp tree.
        self.munge_dir = Path(tempfile.mkdtemp(prefix="pdtest-munge-"))
        self.munge_socket = self.munge_dir / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        lines = [
            "ClusterName=pdtest", f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}", "SlurmUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={r / 'log' / 'jobcomp.txt'}",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SlurmdParameters=config_overrides",
            "MpiDefault=none", "ReturnToService=2", "KillWait=10", "MinJobAge=600",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={_mem_mib() - 1024} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _start_munge(self) -> None:
        shutil.chown(self.munge_dir, "munge", "munge")
        os.chmod(self.munge_dir, 0o755)
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged", f"--socket={self.munge_socket}",
                        f"--pid-file={self.munge_dir / 'munged.pid'}", f"--log-file={self.munge_dir / 'munged.log'}",
                        f"--seed-file={self.munge_dir / 'munged.seed'}"], check=True, timeout=30)

    def start(self, timeout: float = 180.0) -> None:
        self._write_conf()
        self._start_munge()
        subprocess.run(["/usr/sbin/slurmctld", "-i", "-f", str(self.conf)], check=True, timeout=30, env=self.env)
        subprocess.run(["/usr/sbin/slurmd", "-f", str(self.conf)], check=True, timeout=30, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-o", "%T"], check=False).stdout.strip()
            if out in ("idle", "mixed"):
                return
            time.sleep(0.5)
        raise TimeoutError(f"node not idle after {timeout}s (sinfo says {out!r}):\n{self.logs()}")

    def run(self, argv: list[str], check: bool = True, timeout: float = 30.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, check=check, timeout=timeout, capture_output=True, text=True,
                              env={**self.env, **(env or {})})

    def job_state(self, job_id: str) -> str:
        out = self.run(["scontrol", "show", "job", job_id], check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job_end(self, job_id: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "UNKNOWN"):
                return state
            time.sleep(1)
        raise TimeoutError(f"job {job_id} still {state} after {timeout}s")

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            p = self.root / "log" / name
            if p.exists():
                parts.append(f"--- {name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(parts)

    def stop(self) -> None:
        if self.conf.exists():
            self.run(["scancel", "--user=root"], check=False)
            deadline = time.monotonic() + 30  # let the jobs' steps end before the daemons go
            while self.run(["squeue", "-h"], check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for pid_file in (self.root / "run" / "slurmd.pid", self.root / "run" / "slurmctld.pid",
                         self.munge_dir / "munged.pid"):
            _terminate(pid_file)
        shutil.rmtree(self.munge_dir, ignore_errors=True)
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        """SIGKILL any process still carrying this cluster's SLURM_CONF (started by its jobs)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if marker in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue


def _terminate(pid_file: Path, timeout: float = 15.0) -> None:
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
