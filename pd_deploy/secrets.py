"""The deployment's two secrets, generated once per job directory (Slurm) and read by the
servers from files, never from a command line:

* ``decode-api-key``: the decode servers' HTTP API key (``--api-key-file``), which the router
  sends (``--decode-api-key-file``);
* ``kv-secret``: the KV control channel's shared secret (decode ``--kv-secret-file``, the
  connector's ``kv_connector_extra_config.kv_secret_file``).

``JOB_DIR/secrets`` is created 0700 and each file 0600, by the user who renders the plan.
Kubernetes gets the same two keys in the Secret ``pd-secrets`` (deploy/k8s/make-secrets.sh).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

SECRETS_DIR = "secrets"
DECODE_API_KEY = "decode-api-key"
KV_SECRET = "kv-secret"


def generate(job_dir: Path) -> Path:
    """Create ``job_dir/secrets`` with a fresh random value per missing file (kept if present,
    so that re-rendering a plan does not change what running servers hold); returns the folder."""
    folder = job_dir / SECRETS_DIR
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    for name in (DECODE_API_KEY, KV_SECRET):
        path = folder / name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")
    return folder
