"""Real clients (openai SDK sync/async, raw HTTP) through the router to fake backends."""

from __future__ import annotations

import http.client
import json
import threading

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)
MESSAGES = [{"role": "user", "content": "hello"}]


def _client(rig, **kw) -> OpenAI:
    return OpenAI(base_url=rig.url + "/v1", api_key="unused", timeout=20, max_retries=0, **kw)


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_sync_chat(make_rig, stream):
    rig = make_rig()
    client = _client(rig)
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 5
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    else:
        out = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=5,
            extra_body={"ignore_eos": True, "min_tokens": 2, "custom_field": [1, 2]},
        )
        text = out.choices[0].message.content
        assert out.usage.completion_tokens == 5
    assert text == "t0 t1 t2 t3 t4 "
    prefill_req = rig.records(rig.prefills[0])["requests"][0]
    decode_req = rig.records(rig.decodes[0])["requests"][0]
    assert prefill_req["request_id"] == decode_req["request_id"]
    if not stream:  # extra fields reach both legs; the client's token-limit key is the one rewritten
        assert prefill_req["body"]["custom_field"] == decode_req["body"]["custom_field"] == [1, 2]
        assert prefill_req["body"]["max_completion_tokens"] == 1 and "max_tokens" not in prefill_req["body"]
        assert decode_req["body"]["max_completion_tokens"] == 5 and decode_req["body"]["min_tokens"] == 2
    else:
        assert decode_req["body"]["stream_options"] == {"include_usage": True}
    rig.assert_no_leaks()


@pytest.mark.parametrize("stream", [False, True])
async def test_sdk_async_completions(make_rig, stream):
    rig = make_rig()
    client = AsyncOpenAI(base_url=rig.url + "/v1", api_key="unused", timeout=20, max_retries=0)
    if stream:
        text = ""
        async for chunk in await client.completions.create(
            model=MODEL, prompt="hi", max_tokens=3, stream=True
        ):
            text += chunk.choices[0].text
    else:
        out = await client.completions.create(model=MODEL, prompt=["hi"], max_tokens=3, logprobs=2)
        text = out.choices[0].text
        # (the decode request holds its slot; the result read from vLLM's answer is posted to it)
        assert rig.records(rig.decodes[0])["requests"][0]["body"]["kv_transfer_params"]["result"] == "posted"
        handoff = rig.records(rig.decodes[0])["posted"][0]
        assert handoff["prefill_logprobs"] == {
            "content": [{"token": "t7", "logprob": -0.5, "top_logprobs": []}]
        }
    await client.close()
    assert text == "t0 t1 t2 "
    rig.assert_no_leaks()


async def test_sdk_async_chat_stream_and_models(make_rig):
    rig = make_rig()
    client = AsyncOpenAI(base_url=rig.url + "/v1", api_key="unused", timeout=20, max_retries=0)
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, stream=True, logprobs=True, top_logprobs=1
    )
    parts = [c.choices[0].delta.content async for c in stream]
    await client.close()
    assert "".join(parts) == "t0 t1 t2 t3 "
    rig.assert_no_leaks()


def test_raw_http_request_id_and_sse_bytes(make_rig):
    rig = make_rig()
    conn = http.client.HTTPConnection("127.0.0.1", rig.server.port, timeout=10)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True})
    conn.request(
        "POST", "/v1/completions", body, {"Content-Type": "application/json", "X-Request-Id": "my-id-1"}
    )
    resp = conn.getresponse()
    raw = resp.read()
    assert resp.status == 200 and resp.getheader("X-Request-Id") == "my-id-1"
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    events = [line for line in raw.split(b"\n\n") if line]
    assert events[-1] == b"data: [DONE]" and len(events) == 3
    assert json.loads(events[0][6:])["choices"][0]["text"] == "t0 "
    assert [r["request_id"] for r in rig.records(rig.prefills[0])["requests"]] == ["my-id-1"]
    assert rig.records(rig.decodes[0])["requests"][0]["body"]["kv_transfer_params"]["handoff_id"] == "my-id-1"
    prefill_body = rig.records(rig.prefills[0])["requests"][0]["body"]
    assert prefill_body["kv_transfer_params"]["handoff_id"] == "my-id-1"
    assert prefill_body["stream"] is False and prefill_body["max_tokens"] == 1
    conn.close()
    rig.assert_no_leaks()


def test_plain_vllm_decode_gets_vllm_kv_params(make_rig):
    rig = make_rig(decode={"plain": True}, decode_slots=2)
    out = _client(rig).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert out.choices[0].text == "t0 t1 "
    prefill_params = rig.records(rig.prefills[0])["requests"][0]["body"]["kv_transfer_params"]
    assert prefill_params["do_remote_decode"] is True
    decode_params = rig.records(rig.decodes[0])["requests"][0]["body"]["kv_transfer_params"]
    assert decode_params["remote_engine_id"] == "fake-engine"  # as prefill returned them
    ready = httpx.get(rig.url + "/ready").json()
    assert ready["decode"][0]["slots"] == 2 and ready["decode"][0]["engine"] == "plain"
    rig.assert_no_leaks()


def test_api_key(make_rig):
    rig = make_rig(api_key="sekrit")
    out = OpenAI(base_url=rig.url + "/v1", api_key="sekrit", max_retries=0).completions.create(
        model=MODEL, prompt="a", max_tokens=1
    )
    assert out.choices[0].text == "t0 "
    for path, method in (
        ("/v1/completions", "POST"),
        ("/v1/chat/completions", "POST"),
        ("/v1/models", "GET"),
    ):
        r = httpx.request(
            method,
            rig.url + path,
            json={"model": MODEL, "prompt": "a"},
            headers={"Authorization": "Bearer wrong"},
        )
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, r.text)
    assert httpx.get(rig.url + "/health").status_code == 200  # probes need no key
    rig.assert_no_leaks()


def test_an_anthropic_client_is_served_with_its_key_in_x_api_key(make_rig):
    """The ``anthropic`` SDK sends its key as ``x-api-key``: taken as a bearer token; a wrong one
    is a 401 in Anthropic's error shape, on ``/v1/messages`` and ``count_tokens`` alike."""
    import anthropic

    rig = make_rig(api_key="sekrit")
    client = anthropic.Anthropic(base_url=rig.url, api_key="sekrit", max_retries=0, timeout=20)
    message = client.messages.create(model=MODEL, max_tokens=3, messages=MESSAGES)
    assert [b.type for b in message.content] == ["text"] and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 3
    with client.messages.stream(model=MODEL, max_tokens=3, messages=MESSAGES) as stream:
        assert stream.get_final_text() == message.content[0].text
    wrong = anthropic.Anthropic(base_url=rig.url, api_key="wrong", max_retries=0, timeout=20)
    for call in (lambda: wrong.messages.create(model=MODEL, max_tokens=3, messages=MESSAGES),
                 lambda: wrong.messages.count_tokens(model=MODEL, messages=MESSAGES)):
        with pytest.raises(anthropic.AuthenticationError) as refused:
            call()
        assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "authentication_error"
    rig.assert_no_leaks()


def test_metrics_exposed(make_rig):
    rig = make_rig()
    _client(rig).completions.create(model=MODEL, prompt="a", max_tokens=3, stream=False)
    list(_client(rig).completions.create(model=MODEL, prompt="a", max_tokens=3, stream=True))
    httpx.post(rig.url + "/v1/completions", json={"model": "nope", "prompt": "a"})
    text = httpx.get(rig.url + "/metrics").text
    for needle in (
        f'pd_router_requests_total{{endpoint="completions",error_type="",model_name="{MODEL}",status="200"}} 2.0',
        'pd_router_requests_total{endpoint="completions",error_type="model_not_found",model_name="",status="404"} 1.0',
        f'pd_router_time_to_first_token_seconds_count{{endpoint="completions",model_name="{MODEL}"}} 2.0',
        "# TYPE pd_router_time_per_output_chunk_seconds histogram",
        f'pd_router_prompt_tokens_total{{endpoint="completions",model_name="{MODEL}"}}',
        "pd_router_inter_token_latency_seconds_count",
        "pd_router_e2e_latency_seconds_count",
        "pd_router_queue_wait_seconds_count",
        "pd_router_prefill_latency_seconds_count",
        "pd_router_queue_depth 0.0",
        "pd_router_in_flight_requests 0.0",
        f'pd_router_decode_free_slots{{backend="{rig.decodes[0].url}"}} 1.0',
        f'pd_router_backend_healthy{{backend="{rig.prefills[0].url}",role="prefill"}} 1.0',
    ):
        assert needle in text, needle
    rig.assert_no_leaks()


def test_request_id_in_flight_twice_is_rejected(make_rig):
    rig = make_rig(decode={"hold": True, "slots": 2})
    first: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: first.append(
            httpx.post(
                rig.url + "/v1/completions",
                json={"model": MODEL, "prompt": "a", "max_tokens": 1},
                headers={"X-Request-Id": "same"},
                timeout=10,
            )
        )
    )
    t.start()
    rig.wait(lambda: rig.records(rig.decodes[0])["active"] == ["same"], what="first in decode")
    again = httpx.post(
        rig.url + "/v1/completions",
        json={"model": MODEL, "prompt": "a"},
        headers={"X-Request-Id": "same"},
        timeout=10,
    )
    assert again.status_code == 400 and again.json()["error"]["param"] == "X-Request-Id"
    httpx.post(rig.decodes[0].url + "/fake/release", json={"n": 1})
    t.join(10)
    assert first[0].status_code == 200
    rig.assert_no_leaks()
