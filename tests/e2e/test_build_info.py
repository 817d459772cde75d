"""``*_build_info`` on every ``/metrics`` of the CPU stack (router, vLLM prefill through the
connector's stats, decode server), with the versions ``pip show`` gives for this venv, the
same KV layout on both sides of the handoff, and the router's ``/version`` and ``/v1/models``
gathering its backends' build info."""

from __future__ import annotations

from pathlib import Path

import httpx

from pd_build.info import BuildInfo, config_checksum
from pd_build.prometheus import parse
from pd_deploy.stack.launcher import Stack
from pd_router.answers import ModelList, VersionReport
from tests.test_build_info import assert_matches_this_venv


def _build_info(url: str, metric: str) -> BuildInfo:
    (info,) = parse(httpx.get(f"{url}/metrics", timeout=10).text)[metric]
    return info


def test_build_info_on_every_metrics_endpoint(pd_stack: Stack, tiny_model_dir: Path, model_name: str) -> None:
    cfg = pd_stack.config
    router = _build_info(cfg.router_url, "pd_router_build_info")
    prefill = _build_info(cfg.prefill_url, "vllm:tilert_build_info")
    (decode_url,) = cfg.decode_urls
    decode = _build_info(decode_url, "decode_server_build_info")
    for info, component in ((router, "router"), (prefill, "prefill"), (decode, "decode")):
        assert info.component == component
        assert_matches_this_venv(info)
    checksum = config_checksum(tiny_model_dir)
    assert prefill.model == decode.model == model_name
    assert prefill.model_config_sha256 == decode.model_config_sha256 == checksum
    assert prefill.kv_layout == decode.kv_layout and prefill.kv_layout.startswith("tiny")

    report = VersionReport.model_validate(httpx.get(f"{cfg.router_url}/version", timeout=30).json())
    assert report.router == router
    assert [(b.role, b.build, b.error) for b in report.backends] == [("prefill", [prefill], None),
                                                                     ("decode", [decode], None)]
    models = ModelList.model_validate(httpx.get(f"{cfg.router_url}/v1/models", timeout=30).json())
    assert [(m.id, m.build) for m in models.data] == [(model_name, [prefill, decode])]
