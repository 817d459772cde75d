"""``python -m decode_server`` as a real process: help, start-up validation, and a clean
failure when the TileRT engine is asked for where TileRT is absent."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pd_deploy.commands import DecodeSpec, decode_server_argv
from tests.procs import REPO, free_port

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]  # integration: the decode server as a process


def _run(argv: list[str], timeout: float = 90, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(argv, check=False, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def test_help_lists_every_option_and_env():
    out = _run([sys.executable, "-m", "decode_server", "--help"])
    assert out.returncode == 0
    for flag in ("--engine", "--model", "--kv-port", "--slots", "--max-seq-len", "--num-mtp", "--kv-timeout",
                 "--served-model-name", "PD_DECODE_KV_TIMEOUT", "--config"):
        assert flag in out.stdout


def test_invalid_settings_exit_2_naming_option_value_reason(model_dir, tmp_path):
    out = _run([sys.executable, "-m", "decode_server", "--engine", "reference", "--model", str(tmp_path / "none")])
    assert out.returncode == 2
    assert "--model" in out.stderr and "none" in out.stderr and "not a directory" in out.stderr
    out = _run([sys.executable, "-m", "decode_server", "--engine", "reference", "--model", str(model_dir)],
               env={"PD_DECODE_SLOTS": "0"})
    assert out.returncode == 2 and "PD_DECODE_SLOTS='0': Input should be greater than or equal to 1" in out.stderr


def test_tilert_engine_missing_fails_clearly(model_dir):
    spec = DecodeSpec(model=model_dir, port=free_port(), kv_port=free_port(), engine="tilert", num_mtp=3)
    out = _run(decode_server_argv(spec))
    assert out.returncode == 1
    assert "tilert==0.1.6.post3" in out.stderr and "--engine reference" in out.stderr
