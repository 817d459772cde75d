"""Session fixtures shared by every test package."""

from __future__ import annotations

import os
from collections.abc import Iterator
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


@pytest.fixture(scope="session")
def vllm_alone(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM serving the tiny model alone (no connector, no MTP) with the PD stack's numerics, on
    loopback, once per session: what the PD stack's greedy output is compared with (the
    one-host stack's tests and the multi-node ones share it)."""
    from pd_deploy.commands import VLLM_CPU_ENV, PrefillSpec, vllm_prefill_argv
    from tests.e2e.conftest import MODEL_NAME, make_stack_config
    from tests.procs import free_port, server

    port = free_port()
    same_numerics = make_stack_config(tiny_model_dir, Path("/nonexistent")).prefill_extra_args()
    argv = vllm_prefill_argv(PrefillSpec(model=tiny_model_dir, port=port, mtp=False, connector=False,
                                         max_model_len=4096, served_model_name=MODEL_NAME,
                                         extra_args=same_numerics))
    url = f"http://127.0.0.1:{port}"
    with server(argv, tmp_path_factory.mktemp("vllm-alone") / "vllm.log", f"{url}/health", 300, VLLM_CPU_ENV):
        yield url
