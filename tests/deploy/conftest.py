"""Fixtures of the deploy tests: a real single-node Slurm cluster (the multi-node one is
tests/deploy/test_slurm_multinode_cpu.py's), recipes, stubs."""

from __future__ import annotations

import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.slurm_cluster import SlurmCluster, require_installed
from tests.fakes.fake_glm51_checkpoint import write_fake_glm51_checkpoint
from tests.procs import REPO

DEPLOY = REPO / "deploy"
SLURM_DIR = DEPLOY / "slurm"
STANDIN = REPO / "tests" / "fakes" / "deploy_standin.py"


def write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def recording_stub(bin_dir: Path, name: str, record_dir: Path, exit_code: int = 0, then: str = "") -> Path:
    """An executable NAME that appends its argv (NUL-separated, one file per call) to record_dir,
    runs the bash lines ``then`` (its arguments in "$@") and exits with ``exit_code``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    return write_exe(bin_dir / name, f"""#!/usr/bin/env bash
f=$(mktemp "{record_dir}/{name}.XXXXXX")
printf '%s\\0' "$@" > "$f"
{then}
exit {exit_code}
""")


def read_records(record_dir: Path, name: str) -> list[list[str]]:
    return sorted([p.read_bytes().decode().split("\0")[:-1] for p in record_dir.glob(f"{name}.*")])


def load_recipe_dict(name: str) -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "recipes" / name).read_text())


def dump_recipe(data: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def fake_checkpoint(path: Path, shards: int = 1, **kw: Any) -> Path:
    """A fake GLM-5.1 checkpoint (tests/fakes/fake_glm51_checkpoint.py): stand-in shards and
    the real-looking files the decode server reads (tokenizer, chat template, configs)."""
    return write_fake_glm51_checkpoint(path, shards=shards, **kw)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    require_installed()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def standin_python(tmp_path: Path) -> Path:
    """A 'python' that runs the stand-in servers whatever module it is asked for."""
    return write_exe(tmp_path / "standin-python", f'#!/usr/bin/env bash\nexec {sys.executable} {STANDIN} "$@"\n')
