"""Session fixtures shared by every test package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.procs import REPO

TINY_MODEL_ROOT_ENV = "PD_TINY_MODEL_ROOT"
TINY_MODEL_SEED_ENV = "PD_TINY_MODEL_SEED"  # another generated model: the tests hold for any seed


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny GLM-family model (2 main layers + 1 MTP layer, seed ``$PD_TINY_MODEL_SEED`` or
    0), generated once per host under ``$PD_TINY_MODEL_ROOT`` or ``REPO/.cache/tiny-model``
    and reused. Its directory name is the served model name."""
    from decode_server.tiny_model import ensure_tiny_model

    root = Path(os.environ.get(TINY_MODEL_ROOT_ENV) or REPO / ".cache" / "tiny-model")
    return ensure_tiny_model(root, seed=int(os.environ.get(TINY_MODEL_SEED_ENV) or 0))
