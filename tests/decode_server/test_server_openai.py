"""The decode server on a real loopback socket (fake engine + fake receiver), driven by
the official openai SDK and by raw HTTP: output shape and content."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pd_wire.handoff import PROTOCOL_VERSION
from tests.decode_server.helpers import client, handoff, script_for, sse_events
from tests.fakes.fake_engine import FakeEngineConfig, fake_logprob

pytestmark = pytest.mark.timeout(60)

TEXT = "hello wörld, café the quick brown fox"


def test_completion_full_response_text_usage_and_request_id(make_server, tokenizer):
    first, rest = script_for(tokenizer, TEXT)
    srv = make_server(FakeEngineConfig(script=rest))
    resp = client(srv.url).completions.with_raw_response.create(
        model="fake-model", prompt="ignored", max_tokens=100,
        extra_body={"kv_transfer_params": handoff(first, num_prompt_tokens=11)},
        extra_headers={"X-Request-Id": "req-abc"})
    assert resp.headers["x-request-id"] == "req-abc"
    out = resp.parse()
    assert out.id == "cmpl-req-abc"
    assert out.choices[0].text == TEXT
    assert out.choices[0].finish_reason == "stop"
    # every generated token counts, the first (from prefill) and the EOS included
    assert out.usage.prompt_tokens == 11
    assert out.usage.completion_tokens == len(rest) + 1
    assert out.usage.total_tokens == 11 + len(rest) + 1
    srv.wait_idle()


def test_chat_stream_role_first_and_usage_last(make_server, tokenizer):
    first, rest = script_for(tokenizer, TEXT)
    srv = make_server(FakeEngineConfig(script=rest))
    stream = client(srv.url).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}, extra_body={"kv_transfer_params": handoff(first, 9)})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(rest) + 1
    assert chunks[-1].usage.prompt_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])
    srv.wait_idle()


def test_multibyte_characters_split_across_tokens_never_split_in_output(make_server, tokenizer):
    text = "日本 wörld 🙂 ok"
    ids = tokenizer.encode(text).ids
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the test needs characters split over several tokens"
    first, rest = script_for(tokenizer, text)
    srv = make_server(FakeEngineConfig(script=rest))
    with httpx.stream("POST", srv.url + "/v1/completions", json={
            "prompt": "x", "max_tokens": 64, "stream": True, "kv_transfer_params": handoff(first)}) as r:
        events = sse_events(r)
    texts = [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]]
    assert "".join(texts) == text
    assert all("\ufffd" not in t for t in texts)
    assert events[-1] == "[DONE]"
    srv.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_token_boundaries(make_server, tokenizer, stream):
    first, rest = script_for(tokenizer, TEXT)
    stop = "ld, ca"  # spans the tokens of "ld", ",", " " and "café"
    ids = tokenizer.encode(TEXT).ids
    assert not any(stop in tokenizer.decode([i]) for i in ids)
    srv = make_server(FakeEngineConfig(script=rest))
    c = client(srv.url)
    kw = {"model": "fake-model", "prompt": "x", "max_tokens": 100, "stop": [stop, "never"],
              "extra_body": {"kv_transfer_params": handoff(first)}}
    if stream:
        chunks = list(c.completions.create(stream=True, **kw))
        text = "".join(ch.choices[0].text for ch in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        out = c.completions.create(**kw)
        text, finish = out.choices[0].text, out.choices[0].finish_reason
        stop_tokens = len(tokenizer.encode(TEXT[: TEXT.index(stop) + len(stop)]).ids)
        assert out.usage.completion_tokens <= stop_tokens + 1
    assert text == TEXT[: TEXT.index(stop)]
    assert finish == "stop"
    srv.wait_idle()


def test_stop_token_ids_and_include_stop_str(make_server, tokenizer):
    first, rest = script_for(tokenizer, TEXT)
    comma = tokenizer.token_to_id(",")
    srv = make_server(FakeEngineConfig(script=rest))
    raw = httpx.post(srv.url + "/v1/completions", json={
        "prompt": "x", "max_tokens": 100, "stop_token_ids": [comma], "kv_transfer_params": handoff(first)}).json()
    assert raw["choices"][0]["text"] == "hello wörld"
    assert raw["choices"][0]["stop_reason"] == comma
    raw = httpx.post(srv.url + "/v1/completions", json={
        "prompt": "x", "max_tokens": 100, "stop": "café", "include_stop_str_in_output": True,
        "kv_transfer_params": handoff(first)}).json()
    assert raw["choices"][0]["text"] == "hello wörld, café"
    srv.wait_idle()


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_counts_the_first_token(make_server, tokenizer, max_tokens):
    first, rest = script_for(tokenizer, TEXT)
    srv = make_server(FakeEngineConfig(script=rest))
    out = client(srv.url).chat.completions.create(
        model="fake-model", messages=[], max_completion_tokens=max_tokens,
        extra_body={"kv_transfer_params": handoff(first)})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == max_tokens
    assert out.choices[0].message.content == tokenizer.decode([first, *rest][:max_tokens])
    srv.wait_idle()


def test_ignore_eos_runs_to_max_tokens(make_server, tokenizer):
    first, rest = script_for(tokenizer, "hi")
    srv = make_server(FakeEngineConfig(script=rest, filler_token=tokenizer.token_to_id("o")))
    out = client(srv.url).completions.create(model="m", prompt="x", max_tokens=6,
                                             extra_body={"kv_transfer_params": handoff(first), "ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    srv.wait_idle()


def test_mtp_steps_emit_several_tokens_and_metrics(make_server, tokenizer):
    first, rest = script_for(tokenizer, TEXT)
    srv = make_server(FakeEngineConfig(script=rest, per_step=3))
    out = client(srv.url).completions.create(model="m", prompt="x", max_tokens=100,
                                             extra_body={"kv_transfer_params": handoff(first)})
    assert out.choices[0].text == TEXT
    srv.wait_idle()
    metrics = httpx.get(srv.url + "/metrics").text
    assert "decode_server_mtp_acceptance_rate 1.0" in metrics
    assert f'decode_server_generation_tokens_total{{model_name="fake-model"}} {len(rest) + 1}.0' in metrics
    assert 'decode_server_prompt_tokens_total{model_name="fake-model"} 7.0' in metrics
    # the KV receiver's counters (the fake receiver counts nothing)
    assert 'decode_server_kv_refusals_total{model_name="fake-model",reason="busy"} 0.0' in metrics
    assert 'decode_server_kv_received_bytes_total{model_name="fake-model"} 0.0' in metrics
    assert "decode_server_busy_slots 0.0" in metrics
    assert "decode_server_time_per_output_token_seconds_count" in metrics


def test_completion_logprobs_first_from_prefill(make_server, tokenizer):
    first, rest = script_for(tokenizer, "hello world")
    prefill_lp = {"tokens": ["hello"], "token_logprobs": [-0.125], "top_logprobs": [{"hello": -0.125, "x": -3.0}],
                  "text_offset": [0]}
    srv = make_server(FakeEngineConfig(script=rest))
    out = client(srv.url).completions.create(
        model="m", prompt="x", max_tokens=10, logprobs=1,
        extra_body={"kv_transfer_params": handoff(first, prefill_logprobs=prefill_lp)})
    lp = out.choices[0].logprobs
    assert lp.tokens[0] == "hello" and lp.token_logprobs[0] == -0.125
    assert lp.token_logprobs[1] == pytest.approx(fake_logprob(rest[0]))
    assert len(lp.tokens) == len(rest) + 1
    srv.wait_idle()


def test_chat_logprobs_shape(make_server, tokenizer):
    first, rest = script_for(tokenizer, "hello world")
    prefill_lp = {"content": [{"token": "hello", "logprob": -0.5, "bytes": [104],
                               "top_logprobs": [{"token": "hello", "logprob": -0.5, "bytes": [104]},
                                                {"token": "x", "logprob": -2.0, "bytes": [120]}]}]}
    srv = make_server(FakeEngineConfig(script=rest))
    out = client(srv.url).chat.completions.create(
        model="m", messages=[], logprobs=True, top_logprobs=2,
        extra_body={"kv_transfer_params": handoff(first, prefill_logprobs=prefill_lp)})
    content = out.choices[0].logprobs.content
    assert content[0].token == "hello" and content[0].logprob == -0.5 and len(content[0].top_logprobs) == 2
    assert len(content) == len(rest) + 1
    assert all(len(c.top_logprobs) == 2 for c in content[1:])
    srv.wait_idle()


@pytest.mark.parametrize("text", ["still thinking about it", "thought it through</think>"])
@pytest.mark.parametrize("tools", [False, True])
def test_a_message_with_reasoning_and_no_content_has_null_content(make_server, tokenizer, text, tools):
    """As vLLM's GLM reasoning parser answers: no text after the reasoning (cut off inside it,
    or ending right after ``</think>``) is content null, not an empty string."""
    first, rest = script_for(tokenizer, text)
    srv = make_server(FakeEngineConfig(script=rest), reasoning=True, tools=tools)
    out = client(srv.url).chat.completions.create(model="m", messages=[],
                                                  extra_body={"kv_transfer_params": handoff(first)})
    msg = out.choices[0].message
    assert msg.model_extra["reasoning"] == text.removesuffix("</think>") and msg.content is None
    srv.wait_idle()


def test_glm_reasoning_and_tool_calls(make_server, tokenizer):
    text = ("let me think</think>Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
            "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")
    first, rest = script_for(tokenizer, text)
    srv = make_server(FakeEngineConfig(script=rest), reasoning=True, tools=True)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    c = client(srv.url)
    out = c.chat.completions.create(model="m", messages=[], tools=tools,
                                    extra_body={"kv_transfer_params": handoff(first)})
    msg = out.choices[0].message
    assert msg.model_extra["reasoning"] == "let me think"
    assert msg.content == "Sure."
    assert msg.tool_calls[0].function.name == "get_weather"
    assert msg.tool_calls[0].function.arguments == '{"city": "Paris", "days": 3}'
    assert out.choices[0].finish_reason == "tool_calls"

    chunks = list(c.chat.completions.create(model="m", messages=[], tools=tools, stream=True,
                                            extra_body={"kv_transfer_params": handoff(first)}))
    deltas = [ch.choices[0].delta for ch in chunks]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == "let me think"
    assert "".join(d.content or "" for d in deltas) == "Sure."
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # without tools in the request the markup stays text; thinking off -> no reasoning (as vLLM)
    out = c.chat.completions.create(model="m", messages=[], extra_body={
        "kv_transfer_params": handoff(first), "chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.content == text
    srv.wait_idle()


def test_sampling_params_reach_the_engine(make_server, tokenizer):
    first, rest = script_for(tokenizer, "hi")
    srv = make_server(FakeEngineConfig(script=rest))
    c = client(srv.url)
    c.completions.create(model="m", prompt="x", max_tokens=3, temperature=0, top_p=0.5, seed=7,
                         extra_body={"kv_transfer_params": handoff(first), "top_k": 5})
    c.completions.create(model="m", prompt="x", max_tokens=3, extra_body={"kv_transfer_params": handoff(first)})
    (_, p1), (_, p2) = srv.engine.started
    assert (p1.temperature, p1.top_p, p1.top_k, p1.seed, p1.greedy) == (0.0, 0.5, 5, 7, True)
    # defaults from generation_config.json, as vLLM applies them
    assert (p2.temperature, p2.top_p, p2.top_k) == (0.6, 0.95, 0)
    srv.wait_idle()


def test_capabilities_health_ready_models(make_server):
    srv = make_server(slots=3)
    caps = httpx.get(srv.url + "/v1/pd/capabilities").json()
    assert caps["slots"] == 3 and caps["busy_slots"] == 0 and caps["protocol_version"] == PROTOCOL_VERSION
    assert caps["layout_fingerprint"] == srv.receiver.fingerprint and caps["peers"][0]["state"] == "ok"
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/ready").status_code == 200
    assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == "fake-model"


def test_continuous_usage_stats(make_server, tokenizer):
    first, rest = script_for(tokenizer, "hello world")
    srv = make_server(FakeEngineConfig(script=rest))
    with httpx.stream("POST", srv.url + "/v1/completions", json={
            "prompt": "x", "stream": True, "kv_transfer_params": handoff(first, 5),
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        events = [e for e in sse_events(r) if isinstance(e, dict)]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == len(rest) + 1
    assert all(e["usage"]["prompt_tokens"] == 5 for e in events)
    srv.wait_idle()


def test_the_text_of_a_step_is_made_beside_the_next_step_not_between_steps(make_server, tokenizer, monkeypatch):
    """Issue 50: between two engine steps the slot's worker only cuts the tokens (EOS, stop
    tokens, max_tokens); detokenizing and stop strings run on the event loop's thread. A stop
    string found there ends the steps: what the engine ran meanwhile is dropped, the client
    gets what it got when the worker did it all (the answer up to the stop string)."""
    from decode_server.server.sequence import SequenceProcessor

    on_loop: dict[str, set[bool]] = {"cut": set(), "text": set()}  # called on the event loop's thread?
    for name in on_loop:
        inner = getattr(SequenceProcessor, name)

        def recorded(self, *a, _inner=inner, _name=name, **kw):
            try:
                asyncio.get_running_loop()
                on_loop[_name].add(True)
            except RuntimeError:
                on_loop[_name].add(False)
            return _inner(self, *a, **kw)

        monkeypatch.setattr(SequenceProcessor, name, recorded)
    first, rest = script_for(tokenizer, TEXT)
    srv = make_server(FakeEngineConfig(script=rest))
    out = client(srv.url).completions.create(model="fake-model", prompt="x", max_tokens=100, stop=["wörld"],
                                             extra_body={"kv_transfer_params": handoff(first)})
    assert out.choices[0].text == TEXT[:TEXT.index("wörld")] and out.choices[0].finish_reason == "stop"
    srv.wait_idle()
    assert on_loop == {"cut": {False}, "text": {True}}, on_loop
