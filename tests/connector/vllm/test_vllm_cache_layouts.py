"""GLM-5.1's cache layout (our profile, the decode layout, TileRT's conversion) checked
against the numbers vLLM 0.32's own classes produce, not against our constants:
``vllm_cache_layouts.py`` computes them with the installed vllm in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from connector.profiles import cache_row_hint, glm51_profile
from decode_server.engine import tilert_kv
from tests.procs import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
HELPER = Path(__file__).with_name("vllm_cache_layouts.py")


@pytest.fixture(scope="module")
def vllm_says() -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "WARNING"}
    out = subprocess.run([sys.executable, str(HELPER)], capture_output=True, text=True, timeout=280, cwd=REPO,
                         env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _planes() -> dict:
    return {p.name: p for p in glm51_profile().layout.planes}


def test_mla_rows_per_kv_cache_dtype(vllm_says: dict) -> None:
    glm, planes = glm51_profile(), _planes()
    rows = vllm_says["mla"]
    assert rows["fp8_ds_mla"]["row_bytes"] == glm.mla_row_bytes == 656
    assert rows["fp8_ds_mla"]["dtype"] == "uint8"
    # the row is our kv plane (fp8 latent + scales) then the rope plane (FlashMLA's bf16 tail)
    assert planes["rope"].bytes_per_token == vllm_says["flashmla_sparse"]["rope_bytes"]
    assert planes["kv"].bytes_per_token + planes["rope"].bytes_per_token == rows["fp8_ds_mla"]["row_bytes"]
    assert tilert_kv.KV_ROW_BYTES == planes["kv"].bytes_per_token
    # the other dtypes give the sizes the start-up hint recognises, and it names the flag
    fp8, auto = rows["fp8"]["row_bytes"], rows["auto"]["row_bytes"]
    assert (fp8, auto) == (576, 1152)
    assert "plain fp8" in (cache_row_hint(fp8, glm) or "") and "bf16" in (cache_row_hint(auto, glm) or "")
    for hint in (cache_row_hint(fp8, glm), cache_row_hint(auto, glm)):
        assert hint is not None and "--kv-cache-dtype fp8_ds_mla" in hint


def test_backends_serving_fp8_ds_mla_on_sm100(vllm_says: dict) -> None:
    flashmla, flashinfer = vllm_says["flashmla_sparse"], vllm_says["flashinfer_sparse"]
    assert "fp8_ds_mla" in flashmla["kv_cache_dtypes"] and flashmla["sm100_fp8_ds_mla_rejected"] is None
    assert flashmla["block_64_supported"] and flashmla["serves_fp8_as"] == "fp8_ds_mla"
    # SM100 prefers FlashInfer for quantized caches: it takes plain fp8 (576-byte rows) but not
    # fp8_ds_mla, which therefore lands on FlashMLA-sparse (656-byte rows)
    assert flashinfer["sm100_rejects"]["fp8"] is None
    assert "fp8_ds_mla" in flashinfer["sm100_rejects"]["fp8_ds_mla"]


def test_indexer_page_and_block_size(vllm_says: dict) -> None:
    glm, planes = glm51_profile(), _planes()
    ix = vllm_says["indexer"]
    assert ix["dtype"] == "uint8" and ix["token_bytes"] == ix["head_dim"] + 4 * (ix["head_dim"] // ix["quant_block"])
    assert ix["page_bytes"] == planes["indexer"].bytes_per_page == tilert_kv.INDEX_PAGE_BYTES == 8448
    assert ix["block_size"] == planes["indexer"].page_tokens == tilert_kv.INDEX_PAGE_TOKENS
    assert ix["kernel_block_sizes"] == [planes["indexer"].page_tokens]
    assert ix["head_dim"] == tilert_kv.INDEX_HEAD_DIM
    # the block size the prefill command pins is the one vLLM's MLA and indexer caches use
    block = glm.vllm_args[glm.vllm_args.index("--block-size") + 1]
    assert int(block) == ix["block_size"] == vllm_says["mla"]["fp8_ds_mla"]["block_size"]


def test_the_tensors_vllm_hands_the_connector_and_our_gathers_over_them(vllm_says: dict) -> None:
    views = vllm_says["views"]
    assert views["mla_shape"][1:] == [1, 64, 656] and views["mla_dtype"] == "uint8" and views["mla_contiguous"]
    assert views["indexer_shape"][1:] == [1, 64, 132] and views["indexer_dtype"] == "uint8"
    assert views["indexer_contiguous"]
    assert views["mla_gather_ok"] and views["indexer_gather_ok"]
