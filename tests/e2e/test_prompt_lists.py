"""A completion with a list of prompts through the real stack (issue 53): before, vLLM split
it into one request per prompt under one KV handoff id, the decode server admitted the first
and refused the rest, the router retried the handoff hundreds of times, and the request
ended after ~30 s with a 502 (or a single choice), the only decode server marked down.

* served as vLLM serves it: one choice per prompt and sample, indexed as vLLM indexes them,
  greedy text equal to vLLM alone's, streamed and not, strings and token-id lists, usage summed;
* ordinary requests sent beside it are served, the next one after it too, the decode server
  stays healthy, and no handoff was retried;
* a fuzz over the shapes the OpenAI schema allows (lists of prompts, token-id prompts, ``n``,
  ``best_of``, optional fields; the Responses API's input items, tools and fields, issue 59)
  against the real stack: never a 5xx, and the next ordinary request is served after each."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import MODEL_NAME
from tests.metrics import metric_sum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ["Hello", "The sky is", "A short story about the sea:"]
ORDINARY = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}


def _choices(answer: dict) -> dict[int, tuple[str, str]]:
    return {c["index"]: (c["text"], c["finish_reason"]) for c in answer["choices"]}


def _streamed(url: str, body: dict) -> tuple[dict[int, str], dict | None]:
    texts: dict[int, str] = {}
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return texts, usage


def _counts(usage: dict) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def test_a_list_of_prompts_equals_vllm_alones_choices(pd_stack, vllm_alone, tokenizer):
    token_prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
    for prompt in (PROMPTS, token_prompts):
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        answers = [httpx.post(f"{url}/v1/completions", json=body, timeout=120)
                   for url in (pd_stack.config.router_url, vllm_alone)]
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        ours, theirs = (a.json() for a in answers)
        assert _choices(ours) == _choices(theirs) and len(ours["choices"]) == len(prompt)
        assert _counts(ours["usage"]) == _counts(theirs["usage"])
        streamed = [_streamed(url, {**body, "stream_options": {"include_usage": True}})
                    for url in (pd_stack.config.router_url, vllm_alone)]
        assert streamed[0][0] == streamed[1][0] == {i: t for i, (t, _) in _choices(theirs).items()}
        assert streamed[0][1] is not None and _counts(streamed[0][1]) == _counts(streamed[1][1])


def test_a_list_of_prompts_with_n_is_indexed_and_counted_as_vllm_does(pd_stack, vllm_alone):
    """Sampled (vLLM refuses n > 1 with greedy sampling; the router serves it, n equal choices):
    prompt p's sample s is choice p * n + s, usage counts each prompt once and every sample's
    tokens."""
    body = {"model": MODEL_NAME, "prompt": PROMPTS, "n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 3,
            "ignore_eos": True, "echo": True}
    answers = [httpx.post(f"{url}/v1/completions", json=body, timeout=120)
               for url in (pd_stack.config.router_url, vllm_alone)]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    ours, theirs = (a.json() for a in answers)
    assert [c["index"] for c in ours["choices"]] == [c["index"] for c in theirs["choices"]] == list(range(6))
    assert [c["text"].startswith(PROMPTS[c["index"] // 2]) for c in ours["choices"]] == [True] * 6  # echo: its prompt
    assert _counts(ours["usage"]) == _counts(theirs["usage"])


def test_ordinary_requests_beside_a_list_of_prompts_are_served(pd_stack):
    url = pd_stack.config.router_url
    decode = pd_stack.config.decode_urls[0]
    timeouts = metric_sum(decode, "decode_server_errors_total", error_type="kv_timeout")
    stale = metric_sum(url, "pd_router_retries_total", reason="stale_handoff_id")
    listed = {"model": MODEL_NAME, "prompt": PROMPTS, "max_tokens": 16, "temperature": 0}
    with ThreadPoolExecutor(4) as pool:
        big = pool.submit(httpx.post, f"{url}/v1/completions", json=listed, timeout=120)
        beside = [pool.submit(httpx.post, f"{url}/v1/completions", json=ORDINARY, timeout=120) for _ in range(3)]
        assert big.result().status_code == 200, big.result().text
        assert len(big.result().json()["choices"]) == len(PROMPTS)
        assert [f.result().status_code for f in beside] == [200, 200, 200]
    after = httpx.post(f"{url}/v1/completions", json=ORDINARY, timeout=120)
    assert after.status_code == 200, after.text
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    assert metric_sum(url, "pd_router_backend_healthy", role="decode") == len(pd_stack.config.decode_urls)
    assert metric_sum(decode, "decode_server_errors_total", error_type="kv_timeout") == timeouts
    assert metric_sum(url, "pd_router_retries_total", reason="stale_handoff_id") == stale


# ---- fuzz: the shapes the OpenAI schema allows, against the real stack ----

TEXT = st.sampled_from(["Hello", "The sky is", "a", "Once upon a time", "1 2 3"])
TOKEN_IDS = st.lists(st.integers(10, 300), min_size=1, max_size=6)
PROMPT = st.one_of(TEXT, TOKEN_IDS, st.lists(TEXT, min_size=1, max_size=3),
                   st.lists(TOKEN_IDS, min_size=1, max_size=3))
OPTIONAL = {
    "n": st.integers(1, 3), "best_of": st.integers(1, 2), "temperature": st.sampled_from([0, 0.7, 1.0]),
    "top_p": st.sampled_from([0.5, 1.0]), "top_k": st.sampled_from([-1, 5]), "seed": st.integers(0, 99),
    "stop": st.sampled_from(["\n", [".", ","], []]), "logprobs": st.integers(0, 2), "echo": st.booleans(),
    "stream": st.booleans(), "presence_penalty": st.sampled_from([0.0, 0.5]),
    "frequency_penalty": st.sampled_from([0.0, 0.5]), "min_tokens": st.integers(0, 2),
    "ignore_eos": st.booleans(), "user": st.just("fuzz"), "suffix": st.just("!"),
    "logit_bias": st.just({"11": 1.0}), "stop_token_ids": st.just([0]),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
}
CHAT_OPTIONAL = {
    "n": st.integers(1, 3), "temperature": st.sampled_from([0, 1.0]), "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 2), "stream": st.booleans(), "seed": st.integers(0, 99),
    "max_completion_tokens": st.integers(1, 4), "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "parallel_tool_calls": st.booleans(), "stop": st.sampled_from(["\n", ["."]]),
}


FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}
RESPONSES_OPTIONAL = {
    "instructions": st.just("Be brief."), "stream": st.booleans(), "temperature": st.sampled_from([0, 1.0]),
    "tools": st.sampled_from([[FUNCTION], [FUNCTION, {"type": "web_search"}],
                              [{"type": "namespace", "name": "ns", "tools": [FUNCTION]}]]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}]),
    "parallel_tool_calls": st.booleans(), "store": st.just(False), "include": st.just(["reasoning.encrypted_content"]),
    "reasoning": st.sampled_from([{"effort": "low"}, {"summary": "auto"}]),
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
    "prompt_cache_key": st.just("k"),
}
RESPONSES_INPUT = st.one_of(TEXT, st.lists(st.one_of(
    st.builds(lambda t: {"role": "user", "content": t}, TEXT),
    st.builds(lambda t: {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": t}]}, TEXT),
    st.just({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}),
    st.just({"type": "function_call_output", "call_id": "c1", "output": "ok"})), min_size=1, max_size=3))


TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}}}
MESSAGES_OPTIONAL = {
    "system": st.sampled_from(["Be brief.", [
        {"type": "text", "text": "x-anthropic-billing-header: x"},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]]),
    "stream": st.booleans(), "temperature": st.sampled_from([0, 1.0]), "top_k": st.sampled_from([1, 5]),
    "top_p": st.sampled_from([0.5, 1.0]), "stop_sequences": st.sampled_from([["\n"], [], ["a", "b"]]),
    "tools": st.sampled_from([[TOOL], []]),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool", "name": "f"},
                                    {"type": "auto", "disable_parallel_tool_use": True}]),
    "thinking": st.sampled_from([{"type": "adaptive"}, {"type": "disabled"},
                                 {"type": "enabled", "budget_tokens": 1024}]),
    "output_config": st.sampled_from([{"effort": "low"},
                                      {"format": {"type": "json_schema", "schema": {"type": "object"}}}]),
    "metadata": st.just({"user_id": "fuzz"}), "context_management": st.just({"edits": []}),
}
BLOCK = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, TEXT),
    st.just({"type": "thinking", "thinking": "hm", "signature": "s"}),
    st.just({"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": "x"}}),
    st.just({"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "ok"}]}),
    st.just({"type": "redacted_thinking", "data": "x"}))
MESSAGES = st.lists(st.builds(lambda role, content: {"role": role, "content": content},
                              st.sampled_from(["user", "assistant", "system"]),
                              st.one_of(TEXT, st.lists(BLOCK, min_size=1, max_size=3))), min_size=1, max_size=3)


@st.composite
def openai_bodies(draw: Any) -> tuple[str, dict[str, Any]]:
    which = draw(st.integers(0, 4))
    if which == 1:  # Anthropic's Messages API (issue 60)
        body: dict[str, Any] = {"model": MODEL_NAME, "messages": draw(MESSAGES), "max_tokens": draw(st.integers(1, 4))}
        for name in draw(st.lists(st.sampled_from(sorted(MESSAGES_OPTIONAL)), max_size=5, unique=True)):
            body[name] = draw(MESSAGES_OPTIONAL[name])
        if body.get("thinking", {}).get("type") == "enabled":
            body["max_tokens"] = 1025  # its budget below it, as both require
        return "/v1/messages", body
    if which == 0:  # the Responses API (issue 59)
        body = {"model": MODEL_NAME, "input": draw(RESPONSES_INPUT),
                                "max_output_tokens": draw(st.integers(1, 4))}
        for name in draw(st.lists(st.sampled_from(sorted(RESPONSES_OPTIONAL)), max_size=5, unique=True)):
            body[name] = draw(RESPONSES_OPTIONAL[name])
        return "/v1/responses", body
    if draw(st.booleans()):
        body = {"model": MODEL_NAME, "prompt": draw(PROMPT), "max_tokens": draw(st.integers(1, 4))}
        optional, path = OPTIONAL, "/v1/completions"
    else:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": draw(TEXT)}], "max_tokens": 4}
        optional, path = CHAT_OPTIONAL, "/v1/chat/completions"
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)):
        body[name] = draw(optional[name])
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    return path, body


_EXPLORE = int(os.environ.get("PD_FUZZ_EXAMPLES", "0"))  # as tests/reliability/test_router_fuzz.py


@settings(max_examples=_EXPLORE or 50, derandomize=not _EXPLORE, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=openai_bodies())
def test_any_openai_shaped_request_leaves_the_service_serving(pd_stack, case):
    path, body = case
    url = pd_stack.config.router_url
    resp = httpx.post(url + path, json=body, timeout=120)
    assert resp.status_code < 500, (body, resp.status_code, resp.text[:400])
    if resp.status_code == 200 and body.get("stream") and path in ("/v1/responses", "/v1/messages"):
        last = [block for block in resp.text.split("\n\n") if block.strip()][-1]  # their last event, no [DONE]
        assert json.loads(last.split("data: ", 1)[1])["type"] in ("response.completed", "message_stop"), \
            (body, resp.text[-400:])
    elif resp.status_code != 200 and path == "/v1/messages":  # Anthropic's error shape
        assert resp.json()["type"] == "error" and resp.json()["error"]["message"], resp.text
    elif resp.status_code == 200 and body.get("stream"):
        assert resp.text.rstrip().endswith("data: [DONE]") and '"error"' not in resp.text, (body, resp.text[-400:])
    elif resp.status_code != 200:
        assert resp.json()["error"]["message"], resp.text
    after = httpx.post(url + "/v1/completions", json=ORDINARY, timeout=60)
    assert after.status_code == 200, (body, after.text)
