"""``/v1/responses`` at the router's edge (issue 59): the request as the chat request vLLM's
Responses serving makes of it, and the chat answer (whole, or streamed) as vLLM's Responses
answer and events. Pure translation; the real stack against vLLM alone is
``tests/e2e/agents/test_tools.py``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pd_router.apis.responses import parse
from pd_router.apis.responses_out import Translator
from pd_router.errors import InvalidRequest, UnknownResponse

pytestmark = pytest.mark.timeout(30)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _parse(body: dict[str, Any]):
    return parse(json.dumps({"model": "m", **body}).encode())


def test_an_agents_turn_becomes_the_chat_request_vllm_makes_of_it():
    """What Codex sends back after a tool ran: developer instructions, the user's message, the
    model's reasoning and call, the call's output."""
    req = _parse({
        "instructions": "Be brief.", "tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": False,
        "store": False, "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "low", "summary": "auto"},
        "prompt_cache_key": "k", "client_metadata": {"a": "b"}, "stream": True,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                          "text": "I call it."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]})
    body = req.chat_body()
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning": "I call it.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER["parameters"]}}]
    assert body["tool_choice"] == "auto" and body["parallel_tool_calls"] is False
    assert body["chat_template_kwargs"] == {"reasoning_effort": "low", "enable_thinking": True}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "max_tokens" not in body  # absent: the context's room, as vLLM


def test_a_named_tool_choice_and_a_json_schema_map_to_their_chat_fields():
    named = _parse({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
                    "max_output_tokens": 9}).chat_body()
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert named["max_tokens"] == 9
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = _parse({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": schema,
                                                    "strict": True}}}).chat_body()
    assert fmt["response_format"] == {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                             "strict": True}}


def test_codexs_tools_are_the_functions_vllm_shows_the_model():
    """Codex's default tools: functions, a namespace of functions (shown as <namespace>__<name>,
    as vLLM flattens them), hosted tools the model is never shown (left out, as vLLM leaves
    them); a call of a namespaced function comes back with its namespace, and goes back so."""
    agents = {"type": "namespace", "name": "multi_agent_v1", "description": "agents", "tools": [
        {"type": "function", "name": "spawn", "parameters": {"type": "object", "properties": {}}},
        {"type": "web_search"}]}
    req = _parse({"input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "spawn", "namespace": "multi_agent_v1", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
        "tools": [WEATHER, agents, {"type": "web_search", "external_web_access": False}]})
    body = req.chat_body()
    assert [t["function"]["name"] for t in body["tools"]] == ["get_weather", "multi_agent_v1__spawn"]
    assert body["messages"][1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn"
    client = _Client()
    translator = Translator(client.send, req)
    chat = {"id": "c", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "multi_agent_v1__spawn", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4}}

    async def run() -> None:
        await translator.send({"type": "http.response.start", "status": 200, "headers": []})
        await translator.send({"type": "http.response.body", "body": json.dumps(chat).encode(), "more_body": False})

    asyncio.run(run())
    call = json.loads(client.messages[-1]["body"])["output"][0]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "spawn", "multi_agent_v1")


@pytest.mark.parametrize(("body", "error", "param"), [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, InvalidRequest, "input.0.type"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, InvalidRequest,
     "input.0.encrypted_content"),
    ({"input": [{"type": "function_call", "name": "f"}]}, InvalidRequest, "input.0.call_id"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}]}, InvalidRequest,
     "tools"),
    ({"input": "x", "tools": [{"type": "function"}]}, InvalidRequest, "tools.0"),
    ({"input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]}, InvalidRequest, "tools.0"),
    ({"input": "x", "tools": [{"type": "namespace", "name": f"n{i}", "tools": [
        {"type": "function", "name": f"f{j}"} for j in range(300)]} for i in range(2)]}, InvalidRequest, "tools"),
    ({"input": "x", "previous_response_id": "resp_1"}, UnknownResponse, "response_id"),
    ({"input": "x", "background": True}, InvalidRequest, "background"),
])
def test_what_this_server_cannot_serve_is_refused_naming_it(body, error, param):
    with pytest.raises(error) as got:
        _parse(body)
    assert got.value.param is not None and got.value.param.startswith(param), (got.value.param, got.value.message)


class _Client:
    """The client side of a translated answer: what the Translator sends."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    def events(self) -> list[dict[str, Any]]:
        data = b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")
        out = []
        for block in data.decode().split("\n\n"):
            if block.strip():
                kind, payload = block.split("\n", 1)
                event = json.loads(payload.removeprefix("data: "))
                assert kind == f"event: {event['type']}"
                out.append(event)
        return out


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, usage: dict | None = None) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return b"data: " + json.dumps({"id": "c", "choices": choices, "usage": usage}).encode() + b"\n\n"


def _translate(req_body: dict[str, Any], chunks: list[bytes]) -> _Client:
    client = _Client()
    translator = Translator(client.send, _parse(req_body))

    async def run() -> None:
        await translator.send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in chunks:
            await translator.send({"type": "http.response.body", "body": chunk, "more_body": True})
        await translator.send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    asyncio.run(run())
    return client


def test_a_streamed_answer_with_reasoning_text_and_two_calls_is_vllms_event_sequence():
    call = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning": "Think"}), _chunk({"reasoning": "ing."}),
        _chunk({"content": "Let me look."}),
        _chunk({"tool_calls": [call]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "get_weather",
                                                                           "arguments": '{"city": "Oslo"}'}}]},
               finish="tool_calls"),
        _chunk(usage={"prompt_tokens": 10, "completion_tokens": 7, "completion_tokens_details": {
            "reasoning_tokens": 2}}),
    ]
    events = _translate({"input": "x", "tools": [WEATHER], "stream": True}, chunks).events()
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["incomplete_details"] is None
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Thinking."
    assert final["output"][1]["content"][0]["text"] == "Let me look."
    assert [(o["call_id"], o["arguments"]) for o in final["output"][2:]] == [
        ("call_a", '{"city": "Paris"}'), ("call_b", '{"city": "Oslo"}')]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2, 3]
    assert final["usage"]["input_tokens"] == 10 and final["usage"]["output_tokens"] == 7
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 2


def test_a_stream_cut_by_max_output_tokens_completes_as_incomplete():
    events = _translate({"input": "x", "stream": True, "max_output_tokens": 2},
                        [_chunk({"content": "a b"}, finish="length")]).events()
    assert events[-1]["type"] == "response.completed"  # vLLM's event, whatever the status
    assert events[-1]["response"]["status"] == "incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_whole_answer_becomes_the_output_items_in_vllms_order():
    client = _Client()
    translator = Translator(client.send, _parse({"input": "x", "tools": [WEATHER]}))
    chat = {"id": "c", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "reasoning": "Hm.",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4}}

    async def run() -> None:
        await translator.send({"type": "http.response.start", "status": 200, "headers": []})
        await translator.send({"type": "http.response.body", "body": json.dumps(chat).encode(), "more_body": False})

    asyncio.run(run())
    answer = json.loads(client.messages[-1]["body"])
    assert [o["type"] for o in answer["output"]] == ["reasoning", "function_call"]
    assert answer["output"][1]["call_id"] == "call_1" and answer["output"][1]["name"] == "get_weather"
    assert answer["status"] == "completed" and answer["usage"]["total_tokens"] == 7
    assert answer["tools"] == [WEATHER] and answer["tool_choice"] == "auto"
