"""The decode server's plan of a structured-output request (decode_server/server/request_plan.py):
the same pd_grammar refusals as the router's, the grammar in the plan, forced tool calls parsed
whatever --tool-call-parser says, a grammar after the reasoning block with a reasoning parser and
from the first token without one or with thinking off (as vLLM), GLM's special tokens kept for
the parser."""

from __future__ import annotations

import pytest

from decode_server.server.api_errors import InvalidRequest
from decode_server.server.request_plan import ServerLimits, build_plan
from decode_server.server.text import GenerationDefaults
from pd_grammar.spec import SchemaLimits
from pd_grammar.tool_calls import MARKERS
from pd_wire.decode import EngineFeatures
from pd_wire.requests import ChatCompletionRequest
from tests.decode_server.helpers import handoff

LIMITS = ServerLimits(max_seq_len=100, features=EngineFeatures(logprobs=True, structured_output=True),
                      engine="reference", model_name="m", reasoning_parser=True,
                      schema_limits=SchemaLimits(max_depth=3))
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {}}}}]


def _plan(limits: ServerLimits = LIMITS, **body):
    req = ChatCompletionRequest.model_validate({"kv_transfer_params": handoff(5, num_prompt_tokens=10), **body})
    return build_plan("chat", req, "r", limits, GenerationDefaults(eos_token_ids=frozenset({9})))


def test_structured_plans():
    plain = _plan()
    # reasoning: GLM's markers kept, no other special token (as vLLM's parser reads them)
    assert plain.grammar is None and plain.reasoning and plain.stop.keep_special == frozenset(MARKERS)
    fmt = _plan(response_format={"type": "json_object"})
    assert fmt.grammar is not None and fmt.grammar.kind == "json_object" and fmt.tools is None
    assert fmt.reasoning and fmt.grammar.after_reasoning  # the reasoning first, then the JSON
    forced = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get"}})
    assert forced.grammar is not None and forced.grammar.kind == "structural_tag" and forced.grammar.after_reasoning
    assert forced.tools == TOOLS and forced.reasoning and forced.stop.keep_special == frozenset(MARKERS)
    off = _plan(tools=TOOLS, tool_choice="required", chat_template_kwargs={"enable_thinking": False})
    assert off.grammar is not None and not off.grammar.after_reasoning and not off.reasoning
    parsed = ServerLimits(max_seq_len=100, features=LIMITS.features, engine="reference", model_name="m",
                          schema_limits=LIMITS.schema_limits, tool_call_parser=True, reasoning_parser=True)
    auto = _plan(parsed, tools=TOOLS)
    assert auto.grammar is not None and auto.grammar.after_reasoning and auto.tools == TOOLS
    bare = ServerLimits(max_seq_len=100, features=LIMITS.features, engine="reference", model_name="m",
                        schema_limits=LIMITS.schema_limits)
    assert _plan(bare, tools=TOOLS).grammar is None  # no parser: auto calls are not constrained
    named = _plan(bare, tools=TOOLS, tool_choice="required")
    assert named.grammar is not None and not named.grammar.after_reasoning and named.tools == TOOLS
    assert _plan(bare, response_format={"type": "json_object"}).stop.keep_special == frozenset()


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "items": {"items": {"items": {"items": {}}}}}}}}, "response_format.json_schema.schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice.function.name"),
])
def test_structured_refusals_name_the_parameter(body, param):
    with pytest.raises(InvalidRequest) as info:
        _plan(**body)
    assert info.value.param == param


def test_an_engine_without_grammars_refuses_them():
    limits = ServerLimits(max_seq_len=100, features=EngineFeatures(), engine="tilert", model_name="m")
    with pytest.raises(InvalidRequest, match="constrained decoding is not supported by the tilert engine") as info:
        _plan(limits, tools=TOOLS, tool_choice="required")
    assert info.value.param == "tool_choice"
    assert _plan(limits, response_format={"type": "text"}).grammar is None


@pytest.mark.parametrize(("body", "thinking"), [
    ({}, True), ({"reasoning_effort": "none"}, False), ({"reasoning_effort": "low"}, True),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, True),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}, False),
    ({"chat_template_kwargs": {"thinking": False}}, False),
])
def test_thinking_is_on_or_off_as_vllm_renders_the_template(body, thinking):
    """vLLM passes ``reasoning_effort`` to the template, and ``enable_thinking`` false for
    ``none`` unless ``chat_template_kwargs`` gives it: the reasoning parser reads the output so."""
    assert _plan(**body).reasoning is thinking
