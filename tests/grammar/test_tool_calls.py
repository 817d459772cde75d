"""pd_grammar.tool_calls against vLLM 0.32's own builder (``--tool-call-parser glm47``): for the
same tools, tool_choice, parallel_tool_calls and structured output, both structural tags compile
to the same grammar (xgrammar's printed form). vLLM's builder runs in this process, from the
installed vLLM."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_grammar.spec import SchemaLimits, grammar_spec

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": ["integer", "null"]},
                                     "unit": {"enum": ["c", "f"]}, "hourly": {"type": "boolean"}},
    "required": ["city"]}}}
NO_ARGS = {"type": "function", "function": {"name": "now"}}
STRICT = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}
LOOSE = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "additionalProperties": True}}}
NESTED = {"type": "function", "function": {"name": "plan", "parameters": {
    "type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string"}},
                                     "meta": {"type": "object"}, "one": {"enum": ["x"]}}}}}
REF = {"type": "function", "function": {"name": "ref", "parameters": {
    "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": "string"}},
    "anyOf": [{"required": ["a"]}]}}}
ALL = [WEATHER, NO_ARGS, STRICT, LOOSE, NESTED, REF]


def _vllm(body: dict[str, Any]) -> str:
    """vLLM's structural tag for ``body`` as its chat serving applies it (abstract_parser's
    _apply_structural_tag with glm47's default strict level)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.abstract_parser import structured_outputs_to_format
    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag, limit_to_single_tool_call
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel
    from xgrammar.structural_tag import OrFormat, StructuralTag

    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                    **body})
    structured = request.extract_structured_outputs() if hasattr(request, "extract_structured_outputs") else None
    is_auto = request.tool_choice == "auto"
    output = structured_outputs_to_format(structured) if is_auto and structured is not None else None
    tag = get_model_structural_tag("glm_4_7", request.tools, "required" if output is not None else request.tool_choice,
                                   False, strict_level=ToolStrictLevel.FUNCTION)
    assert tag is not None
    if request.parallel_tool_calls is False:
        limit_to_single_tool_call(tag)
    if output is not None:
        tag = StructuralTag(format=OrFormat(elements=[tag.format, output]))
    return json.dumps(tag.model_dump())


def _same(body: dict[str, Any]) -> None:
    ours = grammar_spec(body, SchemaLimits(), chat=True)
    assert ours is not None and ours.kind == "structural_tag"
    # a Lark output beside auto calls is turned into EBNF by xgrammar, which the router does not import
    lark = "start:" in json.dumps(body) and body.get("tool_choice", "auto") == "auto"
    assert (grammar_spec(body, SchemaLimits(), chat=True, compile=False) == ours) is not lark  # the router's text
    expected = str(xgrammar.Grammar.from_structural_tag(_vllm(body)))
    assert str(xgrammar.Grammar.from_structural_tag(ours.source)) == expected


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tools", [[WEATHER, NO_ARGS], [STRICT], [WEATHER, STRICT], ALL, [NO_ARGS], [REF, LOOSE]],
                         ids=["plain", "strict", "mixed", "all", "no-args", "not-plain"])
@pytest.mark.parametrize("choice", [None, "auto", "required", "named"])
@pytest.mark.parametrize("parallel", [None, False])
def test_the_same_grammar_as_vllm(tools, choice, parallel):
    body: dict[str, Any] = {"tools": tools}
    if choice == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": tools[-1]["function"]["name"]}}
    elif choice is not None:
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    _same(body)


@pytest.mark.parametrize("output", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}},
    {"structured_outputs": {"regex": "[0-9]+"}},
    {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
    {"structured_outputs": {"grammar": 'start: "x" "y"+'}},
    {"structured_outputs": {"json": {"type": "integer"}}},
    {"structured_outputs": {"structural_tag": json.dumps(
        {"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}})}},
], ids=["json_object", "json_schema", "regex", "ebnf", "lark", "json", "structural_tag"])
def test_auto_with_a_structured_output_is_either(output):
    """tool_choice auto with a structured output: calls (as required) or the output, as vLLM's
    ``or``; a forced call ignores the output."""
    _same({"tools": [WEATHER, NO_ARGS], **output})
    _same({"tools": [WEATHER], "tool_choice": "required", **output})


_names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
_props = st.dictionaries(_names, st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "array", "object"])}),
    st.fixed_dictionaries({"enum": st.lists(st.one_of(st.text(max_size=4), st.integers()), min_size=1, max_size=3,
                                            unique=True)}),
    st.fixed_dictionaries({"type": st.lists(st.sampled_from(["string", "integer", "null"]), min_size=1, max_size=3,
                                            unique=True)})), max_size=4)
_tool = st.builds(lambda name, props, strict: {"type": "function", "function": {
    "name": name, **({"strict": strict} if strict is not None else {}),
    **({"parameters": {"type": "object", "properties": props}} if props is not None else {})}},
    _names, st.one_of(st.none(), _props), st.one_of(st.none(), st.booleans()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tools=st.lists(_tool, min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"]),
       choice=st.sampled_from(["auto", "required", "named"]), parallel=st.sampled_from([None, True, False]))
def test_generated_tools_make_the_same_grammar_as_vllm(tools, choice, parallel):
    body: dict[str, Any] = {"tools": tools, "tool_choice": choice if choice != "named" else {
        "type": "function", "function": {"name": tools[0]["function"]["name"]}}}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    _same(body)
