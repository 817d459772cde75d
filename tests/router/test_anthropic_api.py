"""Anthropic's Messages API at the router's edge (issue 60), against vLLM 0.32's own
Messages serving as the oracle (``vllm.entrypoints.anthropic``, in this venv): hypothesis
writes Messages requests, and the chat request the router makes of each must be the one
vLLM makes (what reaches the chat template: messages, tools, tool choice, template kwargs,
sampling fields); it writes chat answers and chat streams, and the router's Messages answer
and events must be vLLM's (the random thinking signatures aside). The real stack against
vLLM alone is ``tests/e2e/agents/test_messages.py``."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_router.apis.messages import parse_count_tokens, parse_messages
from pd_router.apis.messages_out import Translator, error_body
from pd_router.errors import InvalidRequest

pytestmark = pytest.mark.timeout(120)
_EXPLORE = int(os.environ.get("PD_FUZZ_EXAMPLES", "0"))  # as tests/reliability/test_router_fuzz.py

NAMES = st.sampled_from(["get_weather", "read_file", "Bash"])
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
SCHEMA = st.sampled_from([{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                          {"properties": {"path": {"type": "string"}}}, {"type": "object"}])
JSONISH = st.dictionaries(st.sampled_from(["city", "path", "n"]), st.one_of(TEXT, st.integers(0, 9)), max_size=2)


def _block(role: str) -> st.SearchStrategy[dict[str, Any]]:
    kinds = [
        st.builds(lambda t: {"type": "text", "text": t}, st.one_of(TEXT, st.just("x-anthropic-billing-header: h"))),
        st.builds(lambda t: {"type": "text", "text": t, "cache_control": {"type": "ephemeral"}}, TEXT),
        st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": "s"}, TEXT),
        st.just({"type": "redacted_thinking", "data": "abc"}),
        st.builds(lambda i, n, a: {"type": "tool_use", "id": f"toolu_{i}", "name": n, "input": a},
                  st.integers(0, 9), NAMES, JSONISH),
        st.builds(lambda i, c, e: {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": c, "is_error": e},
                  st.integers(0, 9), st.one_of(TEXT, st.lists(st.one_of(
                      st.builds(lambda t: {"type": "text", "text": t}, TEXT),
                      st.just({"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/i.png"}}),
                      st.builds(lambda n: {"type": "tool_reference", "tool_name": n}, NAMES)), max_size=3)),
                  st.booleans()),
        st.just({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}),
        st.just({"type": "tool_reference", "tool_name": "Bash"}),
    ]
    if role == "system":
        kinds.append(st.builds(lambda n: {"type": "tool_addition", "tool": {"type": "tool_reference", "name": n}},
                               st.just("get_weather")))
        kinds.append(st.builds(lambda n: {"type": "tool_removal", "tool": {"type": "tool_reference", "name": n}},
                               st.just("get_weather")))
    return st.one_of(kinds)


MESSAGE = st.sampled_from(["user", "assistant", "system"]).flatmap(
    lambda role: st.builds(lambda c: {"role": role, "content": c}, st.one_of(TEXT, st.lists(_block(role), max_size=4))))
TOOL = st.builds(lambda n, d, s, strict: {"name": n, "input_schema": s, **({"description": d} if d else {}),
                                          **({} if strict is None else {"strict": strict})},
                 NAMES, st.one_of(st.none(), TEXT), SCHEMA, st.one_of(st.none(), st.booleans()))
TOOL_CHOICE = st.one_of(
    st.none(), st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                {"type": "tool", "name": "get_weather"},
                                {"type": "auto", "disable_parallel_tool_use": True},
                                {"type": "any", "disable_parallel_tool_use": False}]))
THINKING = st.sampled_from([None, {"type": "disabled"}, {"type": "adaptive"},
                            {"type": "adaptive", "display": "omitted"}, {"type": "enabled", "budget_tokens": 1024}])
OUTPUT_CONFIG = st.sampled_from([None, {"effort": "low"}, {"effort": "max"},
                                 {"format": {"type": "json_schema", "schema": {"type": "object"}}}])


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny-glm", "max_tokens": draw(st.integers(2048, 4096)),
                            "messages": draw(st.lists(MESSAGE, min_size=1, max_size=4))}
    system = draw(st.one_of(st.none(), TEXT, st.lists(_block("system").filter(
        lambda b: b["type"] not in ("tool_addition", "tool_removal")), max_size=3)))
    tools = draw(st.one_of(st.none(), st.lists(TOOL, max_size=3, unique_by=lambda t: t["name"])))
    # a tool change names a declared tool (else both refuse it)
    if not any(t["name"] == "get_weather" for t in tools or []):
        for message in body["messages"]:
            if isinstance(message["content"], list):
                message["content"] = [b for b in message["content"]
                                      if b["type"] not in ("tool_addition", "tool_removal")]
    choice = draw(TOOL_CHOICE)
    if choice is not None and choice.get("name") and not any(t["name"] == choice["name"] for t in tools or []):
        choice = None  # a named tool that is not declared: both refuse it (tests/e2e/agents/test_messages.py)
    for name, value in (("system", system), ("tools", tools), ("tool_choice", choice),
                        ("thinking", draw(THINKING)), ("output_config", draw(OUTPUT_CONFIG)),
                        ("stop_sequences", draw(st.one_of(st.none(), st.lists(TEXT.filter(bool), max_size=2)))),
                        ("temperature", draw(st.one_of(st.none(), st.floats(0, 1)))),
                        ("top_p", draw(st.one_of(st.none(), st.floats(0.1, 1)))),
                        ("top_k", draw(st.one_of(st.none(), st.integers(1, 50)))),
                        ("stream", draw(st.booleans())),
                        ("metadata", draw(st.sampled_from([None, {"user_id": "u"}]))),
                        ("context_management", draw(st.sampled_from([None, {"edits": []}])))):
        if value is not None:
            body[name] = value
    return body


def _vllm_chat(body: dict[str, Any]) -> Any:
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    # GLM's templates take a system message anywhere (vLLM's probe: no merge); a template that reads
    # enable_thinking (GLM's) makes vLLM's probe choose "none" for a disabled thinking
    return AnthropicServingMessages.to_chat_completion_request(
        AnthropicMessagesRequest.model_validate(body), merge_inline_system=False, disabled_thinking_effort="none")


def _what_the_template_and_sampler_get(chat: Any) -> dict[str, Any]:
    kwargs = chat.build_chat_params(None, "auto").chat_template_kwargs
    return {
        "messages": chat.messages, "tools": [t.model_dump() for t in chat.tools or []],
        "tool_choice": chat.tool_choice if chat.tools else None,
        "parallel_tool_calls": chat.parallel_tool_calls if chat.tools else None,
        "template_kwargs": {k: v for k, v in kwargs.items() if v is not None},
        "max_tokens": chat.max_completion_tokens or chat.max_tokens, "stop": chat.stop or None,
        "temperature": chat.temperature, "top_p": chat.top_p, "top_k": chat.top_k, "stream": chat.stream,
        "stream_options": chat.stream_options.model_dump() if chat.stream_options else None,
        "response_format": chat.response_format.model_dump() if chat.response_format else None,
        "thinking_token_budget": chat.thinking_token_budget,
    }


@settings(max_examples=_EXPLORE or 150, derandomize=not _EXPLORE, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_a_messages_request_becomes_the_chat_request_vllm_makes_of_it(body):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    ours = parse_messages(json.dumps(body).encode()).chat_body()
    vllm = _vllm_chat(body)
    named = vllm.tool_choice.function.name if hasattr(vllm.tool_choice, "function") else None
    if named is not None and named not in {t.function.name for t in vllm.tools or []}:
        # the named tool was removed by a tool_removal block: vLLM's serving refuses it, and so
        # does the chat request the router makes (its check is vLLM's)
        with pytest.raises(ValueError, match="tool_choice"):
            ChatCompletionRequest.model_validate(ours)
        return
    assert _what_the_template_and_sampler_get(ChatCompletionRequest.model_validate(ours)) == \
        _what_the_template_and_sampler_get(vllm)


@settings(max_examples=_EXPLORE or 60, derandomize=not _EXPLORE, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_count_tokens_renders_what_vllm_counts(body):
    """The ``/tokenize`` body the router sends renders vLLM's count_tokens prompt: the same
    messages, tools and template kwargs."""
    from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest

    counted = {k: v for k, v in body.items() if k in AnthropicCountTokensRequest.model_fields}
    vllm = AnthropicServingMessages.to_chat_completion_request(
        AnthropicCountTokensRequest.model_validate(counted), merge_inline_system=False, disabled_thinking_effort="none")
    ours = TokenizeChatRequest.model_validate(parse_count_tokens(json.dumps(counted).encode()).tokenize_body())
    assert ours.messages == vllm.messages
    assert [t.model_dump() for t in ours.tools or []] == [t.model_dump() for t in vllm.tools or []]
    kwargs = {k: v for k, v in vllm.build_chat_params(None, "auto").chat_template_kwargs.items() if v is not None}
    assert {k: v for k, v in (ours.chat_template_kwargs or {}).items()} == \
        {k: v for k, v in kwargs.items() if k not in ("add_generation_prompt", "continue_final_message")}
    assert ours.add_generation_prompt


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.enabled.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, None),  # not below max_tokens
    ({"messages": [{"role": "user", "content": [{"type": "tool_addition",
                                                 "tool": {"type": "tool_reference", "name": "x"}}]}]},
     "messages.0"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_removal",
                                                   "tool": {"type": "tool_reference", "name": "nope"}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "x"}] * 16385}, "messages"),
    ({"tools": [{"name": "t", "input_schema": {}}] * 600}, "tools"),
    ({"stop_sequences": ["a"] * 100}, "stop_sequences"),
])
def test_what_vllm_refuses_is_a_400_naming_the_field(body, param):
    base = {"model": "tiny-glm", "max_tokens": 1024, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InvalidRequest) as refused:
        parse_messages(json.dumps({**base, **body}).encode())
    assert refused.value.param == param, refused.value.message


# ---- the answer ----

def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, stop: Any = None,
           usage: dict[str, int] | None = None) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "stop_reason": stop}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny-glm",
            "choices": choices, **({"usage": usage} if usage is not None else {})}


def _ours(chunks: list[dict[str, Any]] | dict[str, Any], stream: bool) -> list[Any]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> None:
        out = Translator(send)
        out.stream = stream
        await out.send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"x")]})
        if stream:
            for chunk in chunks:
                await out.send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                                "more_body": True})
            await out.send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        else:
            await out.send({"type": "http.response.body", "body": json.dumps(chunks).encode(), "more_body": False})

    asyncio.run(run())
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    if not stream:
        return json.loads(body)
    return _events(body)


def _events(text: str) -> list[tuple[str, Any]]:
    out = []
    for event in text.strip().split("\n\n"):
        name, data = event.split("\n", 1)
        out.append((name.removeprefix("event: "), _no_signature(json.loads(data.removeprefix("data: ")))))
    return out


def _no_signature(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: ("<sig>" if k == "signature" else _no_signature(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_signature(v) for v in value]
    return value


def _vllms(chunks: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    async def chat() -> Any:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    async def run() -> str:
        return "".join([e async for e in AnthropicServingMessages.message_stream_converter(None, chat())])

    return _events(asyncio.run(run()))


PIECE = st.one_of(
    st.builds(lambda t: {"reasoning": t}, TEXT.filter(bool)),
    st.builds(lambda t: {"content": t}, TEXT.filter(bool)),
    st.builds(lambda t: {"content": t}, st.just("")),
    st.builds(lambda i, n: {"tool_calls": [{"index": i, "id": f"chatcmpl-tool-{i}", "type": "function",
                                            "function": {"name": n, "arguments": ""}}]}, st.integers(0, 2), NAMES),
    st.builds(lambda i, a: {"tool_calls": [{"index": i, "function": {"arguments": a}}]},
              st.integers(0, 2), st.sampled_from(['{"city": ', '"Paris"}', "{}", "{"])),
)


@settings(max_examples=_EXPLORE or 200, derandomize=not _EXPLORE, deadline=None)
@given(st.lists(PIECE, max_size=8), st.sampled_from(["stop", "length", "tool_calls"]),
       st.sampled_from([None, "the", 151336]))
def test_a_chat_stream_becomes_vllms_message_events(pieces, finish, stop):
    chunks = [_chunk({"role": "assistant", "content": ""}, usage={"prompt_tokens": 9, "completion_tokens": 0}),
              *(_chunk(p, usage={"prompt_tokens": 9, "completion_tokens": i + 1}) for i, p in enumerate(pieces)),
              _chunk({}, finish=finish, stop=stop if finish == "stop" else None,
                     usage={"prompt_tokens": 9, "completion_tokens": len(pieces)}),
              _chunk(None, usage={"prompt_tokens": 9, "completion_tokens": len(pieces), "total_tokens": 9})]
    assert _ours(chunks, stream=True) == _vllms(chunks)


@settings(max_examples=_EXPLORE or 100, derandomize=not _EXPLORE, deadline=None)
@given(st.one_of(st.none(), TEXT), st.one_of(st.none(), TEXT),
       st.lists(st.tuples(NAMES, JSONISH), max_size=2), st.sampled_from(["stop", "length", "tool_calls"]),
       st.sampled_from([None, "the", 151336]))
def test_a_chat_answer_becomes_vllms_message(reasoning, content, calls, finish, stop):
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    message = {"role": "assistant", "content": content, "reasoning": reasoning,
               "tool_calls": [{"id": f"chatcmpl-tool-{i}", "type": "function",
                               "function": {"name": n, "arguments": json.dumps(a)}} for i, (n, a) in enumerate(calls)]}
    chat = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "tiny-glm",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "stop_reason": stop}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}
    vllm = AnthropicServingMessages.messages_full_converter(None, ChatCompletionResponse.model_validate(chat))
    assert _no_signature(_ours(chat, stream=False)) == _no_signature(vllm.model_dump(exclude_none=True))


def test_an_error_is_anthropics_shape_before_the_stream_and_an_error_event_after():
    assert json.loads(error_body(400, b'{"error": {"message": "bad", "type": "invalid_request_error"}}')) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert json.loads(error_body(503, b'{"error": {"message": "busy"}}'))["error"]["type"] == "overloaded_error"
    assert json.loads(error_body(404, b"not json"))["error"] == {"type": "not_found_error", "message": "not json"}
    events = _ours([_chunk({"role": "assistant", "content": ""}), _chunk({"content": "a"}),
                    {"error": {"message": "decode server lost", "type": "upstream_error", "code": 502}}], stream=True)
    assert [name for name, _ in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "decode server lost"}}
