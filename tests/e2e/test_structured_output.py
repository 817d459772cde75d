"""Structured output through the PD stack (issue 15): the grammar holds from prefill's first
token (vLLM samples it under the same response_format / structural tag) through every
decode step (the reference engine's bitmask, MTP drafts checked against it).

* greedy output under a schema is byte-identical to vLLM alone with the same response_format;
* sampled JSON (temperature 1) always parses and validates against its schema;
* tool_choice required / named: vLLM's own GLM-4.7 tool parser reads the generated text
  as tool calls equal to the decode server's (the call grammar is vLLM's: tests/e2e/agents/test_tools.py
  compares the answers with vLLM alone);
* a bad schema is a 400 naming the problem, and vLLM never saw the request (its request
  counter on /metrics does not move)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from pd_wire.decode import CAPABILITIES_PATH

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                            "admin": {"type": "boolean"}},
          "required": ["name", "age", "admin"], "additionalProperties": False}
CHOICE = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                            "sizes": {"type": "array", "items": {"type": "integer", "maximum": 9},
                                                      "maxItems": 2}},
          "required": ["colour", "sizes"], "additionalProperties": False}
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
         "required": ["ok", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone",
    "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
                   "additionalProperties": False}}}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"}, _schema_format(PERSON), _schema_format(CHOICE)], ids=["json_object", "person", "choice"])
def test_greedy_structured_output_equals_vllm_alone(pd_stack, vllm_alone, model_name, response_format):
    outputs = {}
    for name, url in (("pd", pd_stack.config.router_url), ("vllm", vllm_alone)):
        chat = _client(url).chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=40,
                                                    temperature=0, response_format=response_format)
        completion = _client(url).completions.create(model=model_name, prompt="A record:", max_tokens=40,
                                                     temperature=0, extra_body={"response_format": response_format})
        outputs[name] = (chat.choices[0].message.content, chat.choices[0].finish_reason,
                         completion.choices[0].text, completion.choices[0].finish_reason)
    print(f"\n{response_format['type']}: {outputs['pd']!r}")
    assert outputs["pd"] == outputs["vllm"]
    assert outputs["pd"][0] and outputs["pd"][2]


@pytest.mark.parametrize("structured_outputs", [
    {"choice": ["red", "green", "blue sky"]}, {"json": PERSON}, {"regex": "[a-z]{2,6}( [a-z]{2,6}){1,3}"}],
    ids=["choice", "json", "regex"])
def test_vllms_structured_outputs_field_equals_vllm_alone(pd_stack, vllm_alone, model_name, structured_outputs):
    """vLLM's own field, which its users send (issue 52; a 400 "use response_format" before): the same
    grammar path as response_format, greedy output equal to vLLM alone's, chat and completions."""
    outputs = {}
    for name, url in (("pd", pd_stack.config.router_url), ("vllm", vllm_alone)):
        extra = {"structured_outputs": structured_outputs}
        chat = _client(url).chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=40,
                                                    temperature=0, extra_body=extra)
        completion = _client(url).completions.create(model=model_name, prompt="A record:", max_tokens=40,
                                                     temperature=0, extra_body=extra)
        outputs[name] = (chat.choices[0].message.content, chat.choices[0].finish_reason,
                         completion.choices[0].text, completion.choices[0].finish_reason)
    print(f"\n{structured_outputs}: {outputs['pd']!r}")
    assert outputs["pd"] == outputs["vllm"]
    if "choice" in structured_outputs:
        assert outputs["pd"][0] in structured_outputs["choice"] and outputs["pd"][2] in structured_outputs["choice"]
    if "json" in structured_outputs:
        jsonschema.validate(json.loads(outputs["pd"][0]), PERSON)


def test_sampled_json_always_validates(pd_stack, model_name):
    client = _client(pd_stack.config.router_url)
    finished = 0
    for i in range(100):
        out = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=48, temperature=1.0,
                                             seed=i, response_format=_schema_format(SMALL))
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SMALL)
        finished += 1
    assert finished == 100


TOOL_TOKENS = 200  # the tiny model spells GLM's <arg_key>/<arg_value> tags a character at a time


def _vllm_parse(tokenizer, text: str, tools: list[dict]) -> list[tuple[str, dict]]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.glm47_moe_tool_parser import Glm47MoeModelToolParser

    request = ChatCompletionRequest(model="m", messages=MESSAGES, tools=tools)
    parser = Glm47MoeModelToolParser(tokenizer, request.tools)
    info = parser.extract_tool_calls(text, request)
    assert info.tools_called, text
    return [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]


NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}
TOOL_KIND = {"required": "required", str(NAMED_TIME): "named"}


@pytest.mark.parametrize("tool_choice", ["required", NAMED_TIME], ids=["required", "named"])
def test_tool_calls_parse_with_vllms_parser(pd_stack, model_name, tokenizer, tool_choice):
    tools = [WEATHER, TIME]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    out = _client(pd_stack.config.router_url).chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
        tool_choice=tool_choice, max_tokens=TOOL_TOKENS, temperature=0, logprobs=True,
        extra_body={"return_tokens_as_token_ids": True})
    choice = out.choices[0]
    ids = [int(t.token.split(":", 1)[1]) for t in choice.logprobs.content]
    raw = tokenizer.decode(ids, skip_special_tokens=False)
    print(f"\n{tool_choice}: {raw!r} ({choice.finish_reason}, {len(ids)} tokens)")
    ours = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert ours, raw
    assert _vllm_parse(tokenizer, raw, tools) == ours
    # vLLM's grammar pins a non-strict tool's keys and value types, not its required keys; the tiny
    # model repeats a key until max_tokens (then the call is cut: the arguments completed so far)
    expected = {"required": "tool_calls", "named": "stop"}[TOOL_KIND[str(tool_choice)]]
    assert choice.finish_reason in (expected, "length"), raw
    for name, args in ours:
        props = schemas[name]["properties"]
        assert set(args) <= set(props)
        jsonschema.validate(args, {**schemas[name], "required": []})
    if isinstance(tool_choice, dict):
        assert [name for name, _ in ours] == ["get_time"]


def _vllm_requests(prefill_url: str) -> float:
    total = 0.0
    for line in httpx.get(f"{prefill_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:request_success_total") or line.startswith("vllm:num_requests_running") \
                or line.startswith("vllm:prompt_tokens_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": _schema_format({"type": "object", "properties": {"a": {"type": "strin"}}})},
     "response_format.json_schema.schema", "not a valid JSON schema"),
    ({"response_format": _schema_format({"type": "object", "properties": {"a": {"pattern": "(["}}})},
     "response_format.json_schema.schema", "regex"),
    ({"response_format": _schema_format(json.loads("{\"items\": " * 40 + "{}" + "}" * 40))},
     "response_format.json_schema.schema", "nested"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "nope"),
], ids=["bad-type", "bad-regex", "too-deep", "no-schema", "unknown-tool"])
def test_bad_schema_is_refused_before_prefill(pd_stack, model_name, body, param, words):
    prefill = pd_stack.config.prefill_url
    before = _vllm_requests(prefill)
    with pytest.raises(BadRequestError) as info:
        _client(pd_stack.config.router_url).chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=8, extra_body=body)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == param and words in error["message"], error
    assert _vllm_requests(prefill) == before


@pytest.mark.parametrize("schema", [{"$ref": "#/$defs/missing"}, {"type": "string", "pattern": "(?<=a)b"}],
                         ids=["dangling-ref", "lookbehind"])
def test_a_schema_only_compilation_refuses_is_a_400_from_prefill_and_frees_everything(pd_stack, model_name, schema):
    """The router checks a schema without compiling it (it loads no xgrammar); one that is valid
    JSON schema but cannot be compiled is refused by vLLM's prefill, which compiles it before
    running anything: a 400 to the client, nothing prefilled, and the next request served."""
    router = pd_stack.config.router_url
    before = _vllm_requests(pd_stack.config.prefill_url)
    with pytest.raises(BadRequestError) as info:
        _client(router).chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=8,
                                                response_format=_schema_format(schema))
    assert info.value.status_code == 400, info.value.body
    assert _vllm_requests(pd_stack.config.prefill_url) == before
    caps = [httpx.get(u + CAPABILITIES_PATH, timeout=5).json() for u in pd_stack.config.decode_urls]
    assert [(c["busy_slots"], c["kv_busy_slots"]) for c in caps] == [(0, 0)] * len(caps)
    out = _client(router).chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=8,
                                                  response_format=_schema_format(SMALL))
    assert out.choices[0].message.content
