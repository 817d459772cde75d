"""Submitting deploy/slurm/submit.sh jobs and watching them, for the Slurm tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.deploy.conftest import SLURM_DIR
from tests.deploy.slurm_cluster import SlurmCluster


def submit_job(cluster: SlurmCluster, recipe: Path, job_dir: Path, env: dict[str, str]) -> str:
    out = subprocess.run(cluster.on_login_node([str(SLURM_DIR / "submit.sh"), "--job-dir", str(job_dir), str(recipe)]),
                         capture_output=True, text=True, timeout=60,
                         env={**cluster.env, "PYTHON": sys.executable, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def wait_state(job_dir: Path, want: str, cluster: SlurmCluster, job_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = (job_dir / "state").read_text().strip() if (job_dir / "state").exists() else ""
        if state == want:
            return
        if state in ("failed", "done"):
            break
        time.sleep(0.5)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((job_dir / "logs").glob("*")))
    raise AssertionError(f"job {job_id} state {state!r}, wanted {want!r} ({cluster.job_state(job_id)})\n{logs}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
