"""The router's side of structured output (pd_grammar): a bad or oversized schema is a 400
naming it before any backend sees the request; a forced tool call reaches prefill as the
same GLM tool-call grammar (structured_outputs.structural_tag, tool_choice none), while the
decode server gets the client's body as it was."""

from __future__ import annotations

import json

import httpx
import pytest

from pd_grammar.spec import SchemaLimits, grammar_spec
from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}]


def _chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "description": "x" * 300}}}}, "response_format.json_schema.schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
])
def test_bad_schema_refused_before_any_backend(make_rig, extra, param):
    rig = make_rig(max_schema_bytes=200)
    resp = httpx.post(rig.url + "/v1/chat/completions", json=_chat(**extra), timeout=10)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert rig.records(rig.prefills[0])["requests"] == [] and rig.records(rig.decodes[0])["requests"] == []
    rig.assert_no_leaks()


def test_forced_tool_call_reaches_prefill_as_the_same_grammar(make_rig):
    rig = make_rig()
    body = _chat(tools=TOOLS, tool_choice="required")
    resp = httpx.post(rig.url + "/v1/chat/completions", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    prefill = rig.records(rig.prefills[0])["requests"][0]["body"]
    spec = grammar_spec(body, SchemaLimits(), chat=True)
    assert spec is not None
    assert prefill["structured_outputs"] == {"structural_tag": spec.source} and prefill["tool_choice"] == "none"
    assert prefill["tools"] == TOOLS
    decode = rig.records(rig.decodes[0])["requests"][0]["body"]
    assert decode["tool_choice"] == "required" and "structured_outputs" not in decode
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    assert httpx.post(rig.url + "/v1/chat/completions", json=_chat(response_format=fmt), timeout=10).status_code == 200
    prefill = rig.records(rig.prefills[0])["requests"][1]["body"]
    assert prefill["response_format"] == fmt and "structured_outputs" not in prefill  # vLLM reads response_format
    assert json.loads(json.dumps(prefill["response_format"]["json_schema"]["schema"])) == schema
    rig.assert_no_leaks()
