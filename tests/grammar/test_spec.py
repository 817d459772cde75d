"""pd_grammar.spec: what a request's structured-output fields become, every refusal a
StructuredOutputError naming the parameter (the router's 400 before prefill and the
decode server's), schemas bounded; arbitrary JSON in those fields never raises anything else."""

from __future__ import annotations

import json

import pytest
import xgrammar
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_grammar.spec import (
    JSON_OBJECT_SCHEMA,
    SchemaLimits,
    StructuredOutputError,
    asks_for_grammar,
    grammar_param,
    grammar_spec,
    vllm_structured_outputs_args,
)

LIMITS = SchemaLimits()
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]


def _fmt(schema: object) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def _refused(body: dict, chat: bool = True, limits: SchemaLimits = LIMITS) -> StructuredOutputError:
    with pytest.raises(StructuredOutputError) as info:
        grammar_spec(body, limits, chat)
    return info.value


def test_response_formats():
    assert grammar_spec({}, LIMITS, True) is None
    assert grammar_spec({"response_format": {"type": "text"}}, LIMITS, True) is None
    spec = grammar_spec({"response_format": {"type": "json_object"}}, LIMITS, False)
    assert spec is not None and (spec.kind, spec.source) == ("json_object", JSON_OBJECT_SCHEMA)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = grammar_spec(_fmt(schema), LIMITS, False)
    assert spec is not None and spec.kind == "json_schema" and json.loads(spec.source) == schema


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": "json"}, "response_format", "object"),
    ({"response_format": {"type": "regex"}}, "response_format.type", "'regex' is not supported"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "'schema'"),
    (_fmt([1]), "response_format.json_schema.schema", "must be a JSON schema"),
    (_fmt({"type": "strin"}), "response_format.json_schema.schema", "not a valid JSON schema"),
    (_fmt({"properties": {"a": {"pattern": "(["}}}), "response_format.json_schema.schema", "regex"),
    (_fmt({"$schema": "https://example.com/unknown", "type": 3}), "response_format.json_schema.schema", "valid"),
    ({"guided_json": {}}, "guided_json", "not supported"),
    ({"structured_outputs": "a+"}, "structured_outputs", "object"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "(got regex, choice)"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs.regex", "cannot be compiled: Regex parsing error"),
    ({"structured_outputs": {"regex": "a\x00"}}, "structured_outputs.regex", "NUL"),
    ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs.regex", "at most 65536"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list of strings"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice", "non-empty list of strings"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", "cannot be compiled"),
    ({"structured_outputs": {"json": "{"}}, "structured_outputs.json", "not JSON"),
    ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs.json", "not a valid JSON schema"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object", "must be true"),
    ({"structured_outputs": {"structural_tag": "[1]"}}, "structured_outputs.structural_tag", "JSON object"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", "not supported per request"),
    ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs.backend",
     "not a structured-outputs field"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "structured_outputs and response_format cannot be combined"),
    ({"tool_choice": "required"}, "tools", "non-empty"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice", "must be"),
    ({"tool_choice": {"type": "function", "function": {"name": "x"}}, "tools": TOOLS}, "tool_choice.function.name",
     "'x'"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"b": {"type": "nope"}}}}}]}, "tools[0].function.parameters", "valid"),
    ({"tool_choice": "required", "tools": [{"type": "code"}]}, "tools[0]", "function tool"),
])
def test_refusals_name_the_parameter(body, param, words):
    err = _refused(body)
    assert err.param == param and words in err.message, err.message


def test_schema_size_and_depth_are_bounded():
    deep = json.loads('{"items": ' * 5 + "{}" + "}" * 5)
    assert grammar_spec(_fmt(deep), SchemaLimits(max_depth=6), False) is not None
    err = _refused(_fmt(deep), limits=SchemaLimits(max_depth=5))
    assert "nested 6 levels deep; at most 5" in err.message
    big = {"type": "object", "description": "x" * 200}
    assert "bytes; the largest schema allowed is 100" in _refused(_fmt(big), limits=SchemaLimits(max_bytes=100)).message
    with pytest.raises(ValueError):
        SchemaLimits(max_depth=0)


@pytest.mark.parametrize(("so", "kind", "accepts", "refuses"), [
    ({"regex": "(red|blue)[0-9]"}, "regex", "blue7", "green7"),
    ({"choice": ["red", 'say "hi"\n', "a\\b"]}, "ebnf", 'say "hi"\n', "say hi"),
    ({"grammar": 'root ::= "x" rest\nrest ::= "y"+'}, "ebnf", "xyyy", "xz"),
    ({"grammar": 'start: "x" "y"+'}, "lark", "xyy", "x"),
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}, "json_schema",
     '{"a": 1}', '{"b": 1}'),
    ({"json": '{"type": "integer"}'}, "json_schema", "42", '"42"'),
    ({"json_object": True, "disable_fallback": True}, "json_object", '{"x": []}', "[1]"),
    ({"structural_tag": json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}})},
     "structural_tag", "ok", "ko"),
], ids=["regex", "choice", "ebnf", "lark", "json", "json-text", "json_object", "structural_tag"])
def test_structured_outputs_is_the_same_grammar_path(so, kind, accepts, refuses):
    """vLLM's structured_outputs: one grammar of each kind, the language vLLM's xgrammar backend
    compiles (a choice is the alternation of its strings, verbatim); prefill gets the field as sent."""
    spec = grammar_spec({"structured_outputs": so}, LIMITS, False)
    assert spec is not None and spec.kind == kind
    assert grammar_spec({"structured_outputs": so}, LIMITS, True, compile=False) == spec
    if kind in ("json_schema", "json_object"):
        grammar = xgrammar.Grammar.from_json_schema(spec.source)
    elif kind == "structural_tag":
        grammar = xgrammar.Grammar.from_structural_tag(spec.source)
    else:
        grammar = {"regex": xgrammar.Grammar.from_regex, "ebnf": xgrammar.Grammar.from_ebnf,
                   "lark": xgrammar.Grammar.from_lark}[kind](spec.source)
    assert xgrammar.testing._is_grammar_accept_string(grammar, accepts)
    assert not xgrammar.testing._is_grammar_accept_string(grammar, refuses)


def test_tools_make_glm_tool_call_tags():
    """Every tool_choice but none makes the calls' grammar (tests/grammar/test_tool_calls.py: the
    same as vLLM's); a completion has no tools; a forced call ignores a structured output, as vLLM."""
    assert grammar_spec({"tools": TOOLS, "tool_choice": "none"}, LIMITS, True) is None
    assert grammar_spec({"tools": TOOLS, "tool_choice": "required"}, LIMITS, False) is None  # completions: no tools
    auto = grammar_spec({"tools": TOOLS}, LIMITS, True)
    required = grammar_spec({"tools": TOOLS, "tool_choice": "required"}, LIMITS, True)
    named = grammar_spec({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get"}},
                          "response_format": {"type": "json_object"}}, LIMITS, True)
    assert auto is not None and required is not None and named is not None
    assert auto.kind == required.kind == named.kind == "structural_tag"
    grammar = xgrammar.Grammar.from_structural_tag(named.source)
    ok = '<tool_call>get<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>' \
         '<arg_value>3</arg_value></tool_call>'
    assert xgrammar.testing._is_grammar_accept_string(grammar, ok)
    assert not xgrammar.testing._is_grammar_accept_string(grammar, ok.replace(">3<", ">three<"))
    assert not xgrammar.testing._is_grammar_accept_string(grammar, "<tool_call>now</tool_call>")
    assert not xgrammar.testing._is_grammar_accept_string(grammar, ok + ok)  # one call
    both = xgrammar.Grammar.from_structural_tag(required.source)
    assert xgrammar.testing._is_grammar_accept_string(both, "<tool_call>now</tool_call>" + ok)
    assert not xgrammar.testing._is_grammar_accept_string(both, "")  # at least one call
    free = xgrammar.Grammar.from_structural_tag(auto.source)
    assert xgrammar.testing._is_grammar_accept_string(free, "Sunny. " + ok)
    assert not xgrammar.testing._is_grammar_accept_string(free, "<think>again")  # GLM's markers are not text


def test_vllm_flags_follow_the_whitespace_mode():
    flag, value = vllm_structured_outputs_args("compact")
    assert flag == "--structured-outputs-config"
    assert json.loads(value) == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert json.loads(vllm_structured_outputs_args("any")[1])["disable_any_whitespace"] is False


scalars = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "name", "function",
                                                         "json_schema", "schema", "parameters", "$ref"]) | st.text(
                                                             max_size=4), inner, max_size=3), max_leaves=12)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.fixed_dictionaries({}, optional={"response_format": values, "tool_choice": values, "tools": values,
                                           "structured_outputs": values | st.dictionaries(
                                               st.sampled_from(["json", "regex", "choice", "grammar", "json_object",
                                                                "structural_tag", "disable_fallback"]), values,
                                               max_size=2)}))
def test_any_json_is_a_spec_or_a_named_refusal(body):
    """And the router's check (no compilation) gives the same spec, or the same refusal unless
    only xgrammar's compilation refuses it."""
    try:
        spec = grammar_spec(body, LIMITS, True)
    except StructuredOutputError as exc:
        assert exc.param and exc.message
        try:
            grammar_spec(body, LIMITS, True, compile=False)
        except StructuredOutputError as unchecked:
            assert (unchecked.param, unchecked.message) == (exc.param, exc.message)
        else:
            assert "compiled" in exc.message or "not supported for structured output" in exc.message, exc.message
        return
    assert grammar_spec(body, LIMITS, True, compile=False) == spec


@pytest.mark.parametrize("schema", [{"$ref": "#/$defs/missing"}, {"type": "string", "pattern": "(?<=a)b"}],
                         ids=["dangling-ref", "lookbehind"])
def test_what_only_compilation_refuses_is_left_to_the_decode_server(schema):
    """Valid JSON schemas xgrammar cannot compile: the router's check lets them through
    (vLLM's prefill and the decode server, which compile, refuse them), the decode server's refuses."""
    assert grammar_spec(_fmt(schema), LIMITS, False, compile=False) is not None
    assert "not supported for structured output" in _refused(_fmt(schema)).message


def test_schema_bounds_are_settings_checked_at_start(tmp_path):
    from decode_server.settings import SettingsError as DecodeSettingsError
    from decode_server.settings import load_settings as decode_settings
    from pd_router.settings import SettingsError, load_settings
    from tests.fakes.fake_glm51_checkpoint import write_fake_glm51_checkpoint

    base = ["--prefill", "http://a:1", "--decode", "http://b:1"]
    router = load_settings([*base, "--max-schema-bytes", "1000", "--max-schema-depth", "4"], {})
    assert (router.max_schema_bytes, router.max_schema_depth) == (1000, 4)
    with pytest.raises(SettingsError, match=r"^--max-schema-depth='0': Input should be greater than or equal to 1"):
        load_settings([*base, "--max-schema-depth", "0"], {})
    with pytest.raises(SettingsError, match=r"^PD_ROUTER_MAX_SCHEMA_BYTES='1'"):
        load_settings(base, {"PD_ROUTER_MAX_SCHEMA_BYTES": "1"})
    model = ["--engine", "reference", "--model", str(write_fake_glm51_checkpoint(tmp_path / "m"))]
    decode = decode_settings([*model, "--json-whitespace", "compact", "--max-schema-depth", "3"], env={})
    assert (decode.json_whitespace, decode.max_schema_depth) == ("compact", 3)
    with pytest.raises(DecodeSettingsError, match=r"^--json-whitespace='tight'"):
        decode_settings([*model, "--json-whitespace", "tight"], env={})
    with pytest.raises(DecodeSettingsError, match=r"^--max-schema-bytes='99999999999'"):
        decode_settings([*model, "--max-schema-bytes", "99999999999"], env={})


@pytest.mark.parametrize(("body", "chat", "param"), [
    ({}, True, None), ({"response_format": {"type": "text"}}, True, None),
    ({"response_format": {"type": "json_object"}}, False, "response_format"),
    ({"response_format": "x"}, True, "response_format"), ({"guided_regex": "a"}, True, "guided_regex"),
    ({"tool_choice": "auto", "tools": TOOLS}, True, None), ({"tool_choice": "required"}, True, "tool_choice"),
    ({"tool_choice": "required"}, False, None),
])
def test_grammar_param_names_what_asks_for_a_grammar(body, chat, param):
    assert grammar_param(body, chat) == param
    if param is None and not body.get("tools"):  # auto calls: constrained where the engine can
        assert grammar_spec(body, LIMITS, chat) is None


def test_the_router_checks_forced_calls_and_outputs_not_an_agents_every_turn():
    """asks_for_grammar: what the router checks before prefill; tools with tool_choice auto (every
    agent turn) are left to vLLM's prefill and the decode server, which build the same grammar."""
    assert not asks_for_grammar({"tools": TOOLS}) and not asks_for_grammar({"tools": TOOLS, "tool_choice": "auto"})
    assert not asks_for_grammar({"tools": TOOLS, "tool_choice": "none"})
    assert asks_for_grammar({"tools": TOOLS, "tool_choice": "required"})
    assert asks_for_grammar({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get"}}})
    assert asks_for_grammar({"tools": TOOLS, "response_format": {"type": "json_object"}})
    assert asks_for_grammar({"structured_outputs": {"regex": "a"}})
