"""The clients the tests run, each the version they pin, installed into this checkout's
``.cache`` (never globally): a command-line client from the npm registry
(``.cache/clients/<package>-<version>``, installed on first use), the agent SDKs' Python
environment (``make client-tools``: ``.cache/clients-venv``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

CACHE = Path(__file__).resolve().parents[2] / ".cache"
ROOT = CACHE / "clients"
CLIENTS_PYTHON = CACHE / "clients-venv" / "bin" / "python"


def clients_python() -> Path:
    """The agent SDKs' interpreter (openai-agents, langchain-openai, litellm; the Makefile's pins)."""
    if not CLIENTS_PYTHON.exists():
        raise RuntimeError(f"no {CLIENTS_PYTHON}: run `make client-tools`")
    return CLIENTS_PYTHON


def npm_bin(package: str, version: str, binary: str) -> Path:
    """The path of ``binary`` from ``package@version``, installed when missing (npm must be on
    PATH: the machine's Node.js)."""
    prefix = ROOT / f"{package.replace('/', '+')}-{version}"
    path = prefix / "node_modules" / ".bin" / binary
    if path.exists():
        return path
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"npm is needed to install {package}@{version} (Debian's nodejs and npm)")
    prefix.mkdir(parents=True, exist_ok=True)
    subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error",
                    f"{package}@{version}"], check=True, timeout=600)
    if not path.exists():
        raise RuntimeError(f"{package}@{version} installed no {binary}")
    return path
