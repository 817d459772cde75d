"""What the agent API tests share, started once for the package (torn down after its last
test): the stack as a GLM-5.1 user runs it (the decode server and prefill with GLM's
reasoning and tool-call parsers) and vLLM alone with GLM-5.1's parser flags, on the same
tiny model and numerics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pd_deploy.stack.launcher import Stack
from tests.e2e.conftest import MODEL_NAME, make_stack_config, running_stack

GLM51_PARSER_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "glm47", "--reasoning-parser", "glm45")


@pytest.fixture(scope="package")
def glm_user_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = make_stack_config(tiny_model_dir, tmp_path_factory.mktemp("glm-user-stack"), reasoning_parser="glm45")
    with running_stack(cfg) as stack:
        yield stack


@pytest.fixture(scope="package")
def glm_user_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM alone with the stack's numerics and GLM-5.1's parser flags (its tool-call structural
    tags on, vLLM's default)."""
    from pd_deploy.commands import VLLM_CPU_ENV, PrefillSpec, vllm_prefill_argv
    from tests.procs import free_port, server

    port = free_port()
    same_numerics = make_stack_config(tiny_model_dir, Path("/nonexistent")).prefill_extra_args()
    argv = vllm_prefill_argv(PrefillSpec(model=tiny_model_dir, port=port, mtp=False, connector=False,
                                         max_model_len=4096, served_model_name=MODEL_NAME,
                                         extra_args=same_numerics + GLM51_PARSER_FLAGS))
    url = f"http://127.0.0.1:{port}"
    with server(argv, tmp_path_factory.mktemp("glm-user-vllm") / "vllm.log", f"{url}/health", 300, VLLM_CPU_ENV):
        yield url
