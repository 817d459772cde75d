"""The grammar of a chat's tool calls, as vLLM 0.32 builds it for GLM-4.7 / GLM-5.1
(``--tool-call-parser glm47``, ``VLLM_ENFORCE_STRICT_TOOL_CALLING`` on, the parser's default
strict level ``function``): an xgrammar structural tag over GLM's call syntax
``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``.

* ``tool_choice`` ``auto`` (or none given, with ``tools``): free text, in which GLM's markers
  (:data:`MARKERS` but ``<tool_call>``) may not appear, and calls, each begun by ``<tool_call>``
  and constrained once begun (``triggered_tags``);
* ``required``: one call or more from the first token on, with no text between
  (``tags_with_separator``, ``at_least_one``); a named function: exactly one call of it;
* ``parallel_tool_calls: false``: every list of calls stops after its first;
* ``auto`` with a structured output (``response_format``, ``structured_outputs``): one call or
  more, or the structured output (``or``); ``required`` / named ignore a structured output.

Each call's arguments: a tool without ``strict: true`` has its keys pinned to its schema's
``properties`` (any of them, any number of times, in any order) with each value's basic type
(a string is text without GLM's markers, an ``enum`` its values, a number, a boolean, an
object or an array JSON of that type); a tool whose schema is not a plain object (no
``properties``, ``$ref``, ``anyOf``, ...) any ``glm_xml`` arguments. A ``strict`` tool's
arguments follow its schema (xgrammar's ``glm_xml`` style); when every tool is strict the tag
is xgrammar's own ``glm_4_7`` template, which lets ``required`` write text before its calls.

The tag is xgrammar's documented JSON built here as plain dicts: the router builds it with no
xgrammar import. ``tests/grammar/test_tool_calls.py`` compiles it beside vLLM's own builder
for the same requests. Where the structured output is a Lark grammar, vLLM turns it into EBNF
first: that needs xgrammar, so it happens only with ``compile`` (the decode server); the
router's check leaves the Lark text in place."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

THINK_START, THINK_END = "<think>", "</think>"
CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
# GLM's markers: never free text, never inside a value (vLLM's list, in its order); special tokens in
# GLM-5.1's tokenizer
MARKERS = (THINK_START, THINK_END, CALL_BEGIN, CALL_END, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
_TEXT_EXCLUDES = [m for m in MARKERS if m != CALL_BEGIN]  # text may begin a call
_NOT_PLAIN = ("$ref", "allOf", "anyOf", "oneOf", "patternProperties")
_LISTS = ("triggered_tags", "tags_with_separator")

Format = dict[str, Any]


class FunctionTool(NamedTuple):
    """One function tool as the tag needs it."""

    name: str
    parameters: Any  # its schema as given; None when absent
    strict: bool  # ``strict: true`` given


def _any_text() -> Format:
    return {"type": "any_text", "excludes": list(MARKERS)}


def _value(prop: Any) -> Format:
    """One argument's value for a non-strict tool: its basic type (vLLM's shallow pinning)."""
    if not isinstance(prop, Mapping):
        return _any_text()
    if "enum" in prop and isinstance(prop["enum"], list) and prop["enum"]:
        values = [{"type": "const_string", "value": v if isinstance(v, str) else json.dumps(v)}
                  for v in prop["enum"]]
        return values[0] if len(values) == 1 else {"type": "or", "elements": values}
    kind = prop.get("type")
    if isinstance(kind, list):
        formats = [_value({"type": t}) for t in kind if t != "string"]
        if "string" in kind:
            formats.append(_any_text())
        return formats[0] if len(formats) == 1 else {"type": "or", "elements": formats}
    if kind is None or kind == "string":
        return _any_text()
    return {"type": "json_schema", "json_schema": {"type": kind}, "style": "json"}


def _plain_properties(params: Any) -> Mapping[str, Any] | None:
    if not isinstance(params, Mapping):
        return None
    props = params.get("properties")
    if not isinstance(props, Mapping) or not props or params.get("additionalProperties") is True \
            or any(key in params for key in _NOT_PLAIN):
        return None
    return props


def _schema_content(schema: Any) -> Format:
    return {"type": "json_schema", "json_schema": schema, "style": "glm_xml", "any_order": False}


def _call(tool: FunctionTool) -> Format:
    """One call of ``tool``: its arguments pinned as its strictness says."""
    if tool.strict:
        content = _schema_content(tool.parameters if tool.parameters is not None else True)
    else:
        props = _plain_properties(tool.parameters or {})
        if props is None:
            content = _schema_content(True)
        else:
            pairs = [{"type": "sequence", "elements": [
                {"type": "const_string", "value": f"<arg_key>{key}</arg_key><arg_value>"}, _value(prop),
                {"type": "const_string", "value": "</arg_value>"}]} for key, prop in props.items()]
            content = {"type": "star", "content": pairs[0] if len(pairs) == 1 else {"type": "or", "elements": pairs}}
    return {"type": "tag", "begin": f"{CALL_BEGIN}{tool.name}", "content": content, "end": CALL_END}


def _strict_template(tools: list[FunctionTool], mode: str) -> Format:
    """xgrammar's ``glm_4_7`` template (no reasoning part), for tools that are all strict."""
    calls = [_call(tool) for tool in tools]
    if mode == "forced":
        return calls[0]
    return {"type": "triggered_tags", "triggers": [CALL_BEGIN], "tags": calls, "excludes": list(_TEXT_EXCLUDES),
            "at_least_one": mode == "required", "stop_after_first": False}


def _calls(tools: list[FunctionTool], mode: str) -> Format:
    """The calls' format for ``mode`` (auto, required, forced), before parallel_tool_calls."""
    if all(tool.strict for tool in tools):
        return _strict_template(tools, mode)
    calls = [_call(tool) for tool in tools]
    if mode == "auto":
        return {"type": "triggered_tags", "triggers": [CALL_BEGIN], "tags": calls, "excludes": list(_TEXT_EXCLUDES),
                "at_least_one": False, "stop_after_first": False}
    return {"type": "tags_with_separator", "tags": calls, "separator": "", "at_least_one": True,
            "stop_after_first": mode == "forced"}


def _first_call_only(fmt: Any) -> None:
    """Every list of calls in ``fmt`` stops after its first (in place)."""
    if isinstance(fmt, dict):
        if fmt.get("type") in _LISTS:
            fmt["stop_after_first"] = True
        for value in fmt.values():
            _first_call_only(value)
    elif isinstance(fmt, list):
        for item in fmt:
            _first_call_only(item)


def tool_call_tag(tools: list[FunctionTool], mode: str, single_call: bool, output: Format | None) -> str:
    """The structural tag's JSON text: ``mode`` is ``auto``, ``required`` or ``forced`` (``tools``
    then holds the named one only); ``output`` the structured output's format (``auto`` only)."""
    fmt = _calls(tools, "required" if mode == "auto" and output is not None else mode)
    if single_call:
        _first_call_only(fmt)
    if output is not None:
        fmt = {"type": "or", "elements": [fmt, output]}
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False, separators=(",", ":"))
