"""The router's side of structured output (pd_grammar): a bad or oversized schema is a 400
naming it before any backend sees the request; the grammar's fields (tools, tool_choice,
response_format) reach prefill and the decode server as the client sent them: prefill's vLLM
builds the tools' grammar itself, as the decode server does."""

from __future__ import annotations

import json

import httpx
import pytest

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


def test_tool_calls_reach_prefill_as_the_client_sent_them(make_rig):
    rig = make_rig()
    for i, choice in enumerate(["required", None]):
        body = _chat(tools=TOOLS, **({"tool_choice": choice} if choice else {}))
        resp = httpx.post(rig.url + "/v1/chat/completions", json=body, timeout=10)
        assert resp.status_code == 200, resp.text
        for server in (rig.prefills[0], rig.decodes[0]):
            sent = rig.records(server)["requests"][i]["body"]
            assert sent["tools"] == TOOLS and sent.get("tool_choice") == choice and "structured_outputs" not in sent
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    assert httpx.post(rig.url + "/v1/chat/completions", json=_chat(response_format=fmt), timeout=10).status_code == 200
    prefill = rig.records(rig.prefills[0])["requests"][2]["body"]
    assert prefill["response_format"] == fmt and "structured_outputs" not in prefill  # vLLM reads response_format
    assert json.loads(json.dumps(prefill["response_format"]["json_schema"]["schema"])) == schema
    rig.assert_no_leaks()
