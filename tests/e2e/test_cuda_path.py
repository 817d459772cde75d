"""The PD stack with vLLM's CUDA behaviour for GLM-5.1 simulated on CPU: the connector's
``save_kv_layer`` is never called (tests/e2e/cuda_path_connector.py), so every layer is
gathered late, in ``wait_for_save``. Greedy output must still equal vLLM alone's."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd_deploy.stack.launcher import Stack
from tests.e2e.conftest import make_stack_config, running_stack
from tests.e2e.test_equivalence import assert_first_token_with_kv_matches, assert_matches_vllm_alone, poster

pytestmark = pytest.mark.slow
HANDOFF_LINE = re.compile(r"TileRT handoff \S+: \d+ tokens, (\d+) layers \((\d+) early, (\d+) late\)")


@pytest.fixture(scope="module")
def cuda_path_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = make_stack_config(tiny_model_dir, tmp_path_factory.mktemp("pd-stack-cuda-path"),
                            prefill_connector=("tests.e2e.cuda_path_connector", "NoSaveKVLayerConnector"))
    with running_stack(cfg) as stack:
        yield stack


def test_every_layer_gathered_late_matches_vllm_alone(cuda_path_stack, vllm_alone, model_name):
    assert_matches_vllm_alone(poster(cuda_path_stack.config.router_url), poster(vllm_alone), model_name)
    assert_first_token_with_kv_matches(cuda_path_stack.config, poster(vllm_alone), model_name)
    log = (cuda_path_stack.config.log_dir / "prefill.log").read_text(errors="replace")
    counts = [tuple(map(int, m.groups())) for m in HANDOFF_LINE.finditer(log)]
    assert counts, "no handoff line in the prefill log"
    assert all(c == (3, 0, 3) for c in counts), counts  # 2 main layers + the MTP layer, all late
