"""Anthropic's Messages API through the real stack (issue 60), against vLLM alone with GLM-5.1's
parser flags on the same tiny model, greedy (``temperature`` 0 as an extra field: the
``anthropic`` SDK has no parameter for it any more).

* the ``anthropic`` SDK's ``messages.create`` and ``messages.stream``: with and without tools,
  a forced tool (``tool`` and ``any``) and the ``tool_result`` turn, thinking on (the model's
  default, ``adaptive``) and off (``disabled``), a system prompt as Claude Code sends it,
  ``stop_sequences``, a cut by ``max_tokens``: the same content blocks, stop reason, stop
  sequence and usage as vLLM alone, and the same stream events;
* ``messages.count_tokens``: vLLM's count;
* refusals: the status vLLM answers, in Anthropic's error shape, naming the field.

Before issue 60 every call got the router's 404 'no route POST /v1/messages'."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                            "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"type": "disabled"}
# what Claude Code sends as its system prompt: its billing header first (vLLM leaves it out)
CLAUDE_CODE_SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=00000;"},
                      {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]
TOOL_TURN = [*ASK, {"role": "assistant", "content": [
    {"type": "thinking", "thinking": "I look it up.", "signature": "sig"},
    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21C"},
                                 {"type": "text", "text": "Thanks."}]}]
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "claude code's system prompt": {"system": CLAUDE_CODE_SYSTEM, "metadata": {"user_id": "u"},
                                    "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
                                    "context_management": {"edits": []}},
    "no thinking": {"thinking": NO_THINKING},
    "tools, auto": {"tools": [WEATHER]},
    "a named tool": {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"},
                     "thinking": NO_THINKING},
    "any tool, after thinking": {"tools": [WEATHER], "tool_choice": {"type": "any"}, "max_tokens": 96},
    "the tool's result": {"tools": [WEATHER], "messages": TOOL_TURN},
    "the tool's result, no thinking": {"tools": [WEATHER], "messages": TOOL_TURN, "thinking": NO_THINKING},
    "a stop sequence": {"stop_sequences": ["the"]},
    "cut by max_tokens": {"max_tokens": 5},
}


def _blocks(content: list[Any]) -> list[dict[str, Any]]:
    """The blocks without what is random (a thinking block's signature, a tool call's id)."""
    out = []
    for block in content:
        fields = block.model_dump(exclude_none=True)
        fields.pop("signature", None)
        if fields.get("type") == "tool_use":
            assert fields.pop("id").startswith("chatcmpl-tool-")
        out.append(fields)
    return out


def _ask(url: str, case: str) -> dict[str, Any]:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    kwargs = {"model": MODEL_NAME, "max_tokens": 64, "messages": ASK, "extra_body": {"temperature": 0}}
    kwargs |= {k: v for k, v in CASES[case].items() if k in ("max_tokens", "messages", "system", "tools",
                                                                 "tool_choice", "thinking", "stop_sequences",
                                                                 "metadata")}
    kwargs["extra_body"] |= {k: v for k, v in CASES[case].items() if k in ("output_config", "context_management")}
    whole = client.messages.create(**kwargs)
    events: list[tuple[str, Any]] = []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            if event.type in ("text", "thinking", "input_json", "signature"):
                continue  # the SDK's own events, made of the deltas
            kind = (event.type, getattr(event, "index", None),
                    event.delta.type if event.type == "content_block_delta" else None)
            if not events or events[-1] != kind or event.type != "content_block_delta":
                events.append(kind)  # a run of deltas as one: how tokens group into chunks may differ
        streamed = stream.get_final_message()
    return {"whole": (_blocks(whole.content), whole.stop_reason, whole.stop_sequence, whole.usage.model_dump()),
            "streamed": (_blocks(streamed.content), streamed.stop_reason, streamed.stop_sequence,
                         streamed.usage.model_dump()),
            "events": events}


@pytest.mark.parametrize("case", list(CASES))
def test_the_anthropic_sdk_gets_what_vllm_gives_it(glm_user_stack, glm_user_vllm, case):
    with ThreadPoolExecutor(2) as pool:  # the two servers at once (2 cores: each waits on its own)
        pd, vllm = pool.map(lambda url: _ask(url, case), (glm_user_stack.config.router_url, glm_user_vllm))
    print(f"\n{case}: {pd['whole']!r}")
    assert pd["whole"] == vllm["whole"]
    blocks = vllm["streamed"][0]
    if blocks and blocks[-1].get("text", "").startswith("<tool_call>"):
        # vLLM 0.32's streaming GLM parser knows <tool_call> by its token id only: a forced call
        # the grammar spelled in characters (as on the tiny model) it streams as text (docs/router.md,
        # "Tools"); the stack streams the call it and vLLM answer unstreamed
        assert pd["streamed"] == pd["whole"] and pd["whole"][0][-1]["type"] == "tool_use"
    else:
        assert (pd["streamed"], pd["events"]) == (vllm["streamed"], vllm["events"])
    assert pd["whole"][1] in ("end_turn", "max_tokens", "stop_sequence", "tool_use") and pd["whole"][0]
    if "tool_choice" in CASES[case]:
        assert pd["whole"][0][-1]["type"] == "tool_use" and pd["whole"][0][-1]["name"] == "get_weather"


COUNTED = {"plain": {"messages": ASK}, "system": {"messages": ASK, "system": CLAUDE_CODE_SYSTEM},
           "tools": {"messages": TOOL_TURN, "tools": [WEATHER], "tool_choice": {"type": "auto"}},
           "no thinking": {"messages": ASK, "thinking": NO_THINKING}}


def test_count_tokens_is_vllms(glm_user_stack, glm_user_vllm):
    counts = {}
    for name, url in (("pd", glm_user_stack.config.router_url), ("vllm", glm_user_vllm)):
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
        counts[name] = {case: client.messages.count_tokens(model=MODEL_NAME, **body).input_tokens
                        for case, body in COUNTED.items()}
    assert counts["pd"] == counts["vllm"]
    assert counts["pd"]["system"] > counts["pd"]["plain"] and counts["pd"]["tools"] > counts["pd"]["plain"]
    # what Claude Code asks first: HEAD / answered as vLLM answers it
    assert httpx.head(glm_user_stack.config.router_url + "/", timeout=10).status_code == \
        httpx.head(glm_user_vllm + "/", timeout=10).status_code


REFUSED = {
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "a block type": ({"messages": [{"role": "user", "content": [{"type": "video", "text": "x"}]}]}, "type"),
    "a budget above max_tokens": ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "budget_tokens"),
    "an undeclared named tool": ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    "an unknown model": ({"model": "gpt-9"}, "gpt-9"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refusal_has_vllms_status_in_anthropics_shape(glm_user_stack, glm_user_vllm, case):
    body, named = REFUSED[case]
    sent = {"model": MODEL_NAME, "max_tokens": 1024, "messages": ASK, **body}
    ours = httpx.post(glm_user_stack.config.router_url + "/v1/messages?beta=true", json=sent, timeout=60,
                      headers={"anthropic-version": "2023-06-01", "x-api-key": "unused"})
    theirs = httpx.post(glm_user_vllm + "/v1/messages?beta=true", json=sent, timeout=60)
    assert ours.status_code == theirs.status_code and 400 <= ours.status_code < 500, (ours.text, theirs.text)
    answer = ours.json()
    assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}, answer
    assert answer["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[ours.status_code]
    assert named in answer["error"]["message"], answer
