"""A real Slurm cluster (Debian's slurm-wlm + munge) in a temporary directory: one node on
this host, or one ``slurmd`` per node of tests/nodes.py (each in its node's network
namespace, with its hostname, reaching ``slurmctld`` on node 0 by address).

Everything private to the test: its own munge socket, slurm.conf, ports, state and
spool directories; the commands see it through ``SLURM_CONF``. The daemons are started
by us (no init system here) and stopped by the pids in their pid files. The client
commands (:meth:`SlurmCluster.run`) run on the first node, the login node.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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


def _here(argv: Sequence[str]) -> list[str]:
    return list(argv)


@dataclass(frozen=True)
class ClusterNode:
    """A Slurm node: its name (its hostname), its address, and how a command runs on it."""

    name: str
    address: str
    on_node: Callable[[Sequence[str]], list[str]] = field(default=_here)
    own_sysfs: bool = False  # `ip netns exec` mounts the namespace's own /sys, without the cgroup tree


def _with_cgroups(argv: Sequence[str]) -> list[str]:
    """``argv`` with this host's cgroup tree on /sys/fs/cgroup: slurmd fails to start without
    it, and the ``/sys`` of ``ip netns exec`` is the namespace's own sysfs, in a private mount
    namespace. Each hierarchy mounted here is mounted there again (same type and options:
    the same hierarchy, as on the host)."""
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    script = []
    for _, target, fstype, options, *_ in mounts:
        if target == "/sys/fs/cgroup" or target.startswith("/sys/fs/cgroup/"):
            opts = ",".join(o for o in options.split(",") if o not in ("rw", "relatime", "seclabel"))
            script.append(f"mkdir -p {target} && mount -t {fstype} -o {opts or 'defaults'} {fstype} {target}")
    return ["sh", "-c", " && ".join([*script, 'exec "$@"']), "sh", *argv]


class SlurmCluster:
    def __init__(self, root: Path, nodes: Sequence[ClusterNode] = (), cpus: int = 16) -> None:
        self.root = root
        self.nodes = list(nodes) or [ClusterNode(socket.gethostname().split(".")[0], "127.0.0.1")]
        self.host = self.nodes[0].name
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
        head, names = self.nodes[0], ",".join(n.name for n in self.nodes)
        lines = [
            "ClusterName=pdtest", f"SlurmctldHost={head.name}({head.address})",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}", "SlurmUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={r / 'log' / 'jobcomp.txt'}",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SlurmdParameters=config_overrides",
            "MpiDefault=none", "ReturnToService=2", "KillWait=10", "MinJobAge=600",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            *(f"NodeName={n.name} NodeAddr={n.address} CPUs={self.cpus} RealMemory={_mem_mib() - 1024} "
              "State=UNKNOWN" for n in self.nodes),
            f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP",
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
        head = self.nodes[0]
        subprocess.run(head.on_node(["/usr/sbin/slurmctld", "-i", "-f", str(self.conf)]), check=True, timeout=30,
                       env=self.env)
        for node in self.nodes:
            (self.root / "spool" / node.name).mkdir(exist_ok=True)
            slurmd = ["/usr/sbin/slurmd", "-f", str(self.conf), "-N", node.name]
            subprocess.run(node.on_node(_with_cgroups(slurmd) if node.own_sysfs else slurmd), check=True,
                           timeout=30, env=self.env)
        want = {n.name: "idle" for n in self.nodes}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            if {name: "idle" if state == "mixed" else state for name, state in states.items()} == want:
                return
            time.sleep(0.5)
        raise TimeoutError(f"nodes not idle after {timeout}s (sinfo says {out!r}):\n{self.logs()}")

    def on_login_node(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on the login node (the first): where the client commands reach
        slurmctld (on a multi-node cluster, nothing outside the nodes does)."""
        return self.nodes[0].on_node(argv)

    def run(self, argv: list[str], check: bool = True, timeout: float = 30.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``argv`` on the login node, with this cluster's SLURM_CONF."""
        return subprocess.run(self.on_login_node(argv), check=check, timeout=timeout, capture_output=True,
                              text=True, env={**self.env, **(env or {})})

    def job_state(self, job_id: str) -> str:
        out = self.run(["scontrol", "show", "job", job_id], check=False).stdout
        for word in out.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
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
        for name in ("slurmctld.log", *(f"slurmd-{n.name}.log" for n in self.nodes)):
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
        for pid_file in (*(self.root / "run" / f"slurmd-{n.name}.pid" for n in self.nodes),
                         self.root / "run" / "slurmctld.pid", self.munge_dir / "munged.pid"):
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
