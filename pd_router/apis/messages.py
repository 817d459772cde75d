"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) as
vLLM 0.32 serves it, mapped onto chat completions.

vLLM builds its Anthropic endpoint on its chat serving: the request's ``system`` and
``messages`` become chat messages, its tools the chat tools, and the chat template renders
the prompt. The router does the same translation at its edge (:meth:`MessagesRequest.chat_body`),
so the rest of the path is the chat route's (decode slot, prefill, handoff, decode, migration,
metrics), and the chat answer becomes a ``message`` object or Anthropic's stream events
(:mod:`pd_router.apis.messages_out`).

The translation, as vLLM's: ``system`` (a string or text blocks; Claude Code's
``x-anthropic-billing-header`` block left out, as vLLM leaves it out for the prefix cache) the
first system message; a ``system`` message inside ``messages`` stays where it is (GLM's
templates take one anywhere); in a message, ``text`` blocks are its content (one: a string),
``thinking`` its ``reasoning``, ``tool_use`` its tool calls (``input`` as JSON), a user's
``tool_result`` a ``tool`` message before it (its text blocks joined by newlines),
``redacted_thinking`` and ``tool_reference`` dropped, ``image`` an ``image_url`` part;
``tool_addition`` / ``tool_removal`` blocks change the tools in effect. ``tools`` become
function tools (``input_schema`` their parameters), ``tool_choice`` ``auto`` / ``any`` /
``tool`` / ``none`` chat's ``auto`` / ``required`` / named / ``none`` (and
``disable_parallel_tool_use`` ``parallel_tool_calls``), ``stop_sequences`` ``stop``;
``output_config.format`` a JSON-schema ``response_format``, ``output_config.effort`` the
template's ``reasoning_effort``; ``thinking`` ``disabled`` turns the template's thinking off
(``reasoning_effort`` ``none``, ``enable_thinking`` false), ``adaptive`` changes nothing, and
``enabled``'s ``budget_tokens`` is vLLM's ``thinking_token_budget``. What Claude Code sends
besides (``metadata``, ``context_management``, ``container``, ``mcp_servers``, ...) is
accepted and ignored, as vLLM ignores it; vLLM's own fields ``chat_template_kwargs``,
``cache_salt`` and ``priority`` pass through to the chat request.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pd_router.apis.completions import effort_kwargs, json_object, passed_through
from pd_router.apis.messages_blocks import (
    Block,
    Blocks,
    Message,
    OutputConfig,
    Thinking,
    ThinkingDisabled,
    ThinkingEnabled,
    Tool,
    ToolChoice,
    ToolDefinition,
    no_tool_changes,
)
from pd_router.errors import InvalidRequest
from pd_wire.limits import MAX_INT32, MAX_MESSAGES, MAX_STOP_SEQUENCES, MAX_TOOLS

BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request system block



# vLLM's own request fields, passed to the chat request as they came (chat_template_kwargs too,
# with what output_config and thinking ask of the template: CountTokensRequest.template_kwargs)
_PASSED_THROUGH = ("cache_salt", "priority", "kv_transfer_params")


class CountTokensRequest(BaseModel):
    """A ``/v1/messages/count_tokens`` body: every count bounded (:mod:`pd_wire.limits`)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(min_length=1)
    messages: Annotated[list[Message], Field(max_length=MAX_MESSAGES)]
    system: str | Blocks | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("system")
    @classmethod
    def _system(cls, system: str | list[Block] | None) -> str | list[Block] | None:
        no_tool_changes(system)
        return system

    def chat_messages(self) -> list[dict[str, Any]]:
        """The chat messages vLLM makes of ``system`` and ``messages``."""
        out: list[dict[str, Any]] = []
        system = [self.system] if isinstance(self.system, str) else [
            b.text for b in self.system or [] if b.type == "text" and b.text and not b.text.startswith(BILLING_HEADER)]
        if any(system):
            out.append({"role": "system", "content": "".join(system)})
        for message in self.messages:
            if message.role == "system":
                text = _system_text(message.content)
                if text:
                    out.append({"role": "system", "content": text})
            elif isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
            else:
                chat = _blocks_message(message.role, message.content, out)
                if message.role != "user" or "content" in chat:
                    out.append(chat)
        return out

    def resolved_tools(self) -> list[Tool] | None:
        """``tools`` as the ``tool_addition`` / ``tool_removal`` blocks leave them at the
        conversation's end (vLLM's reading: one tool list for the template)."""
        changes = [b for m in self.messages if not isinstance(m.content, str) for b in m.content
                   if b.type in ("tool_addition", "tool_removal")]
        if not changes:
            return self.tools
        tools = {tool.name: tool for tool in self.tools or []}
        removed: set[str] = set()
        for block in changes:
            change = block.tool
            if isinstance(change, ToolDefinition):
                name = change.definition.name
                tools[name] = change.definition
            elif change is not None:
                name = change.name
                if name not in tools:
                    raise InvalidRequest(f"{block.type} references tool {name!r}, which is not declared in tools",
                                         param="messages")
                if block.type == "tool_addition":
                    tools[name] = tools[name].model_copy(update={"defer_loading": None})
            else:
                continue
            if block.type == "tool_removal":
                removed.add(name)
            else:
                removed.discard(name)
        if len(tools) > MAX_TOOLS:
            raise InvalidRequest(f"tools hold more than {MAX_TOOLS} tools", param="tools")
        return [tool for name, tool in tools.items() if name not in removed]

    def template_kwargs(self) -> dict[str, Any]:
        """``chat_template_kwargs`` with what ``output_config.effort`` and ``thinking`` ask of
        the template (the client's own keys win, as in vLLM)."""
        effort: str | None = self.output_config.effort if self.output_config is not None else None
        if isinstance(self.thinking, ThinkingDisabled):
            effort = "none"  # GLM's templates honour it (vLLM's probe picks "none" for them)
        return effort_kwargs(self.chat_template_kwargs, effort)

    def tokenize_body(self) -> dict[str, Any]:
        """vLLM's ``/tokenize`` body rendering the prompt ``count_tokens`` counts."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(), "add_generation_prompt": True}
        tools = self.resolved_tools()
        if tools:
            body["tools"] = [t.chat_tool() for t in tools]
        kwargs = self.template_kwargs()
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        return body


class MessagesRequest(CountTokensRequest):
    """A ``/v1/messages`` body."""

    max_tokens: int = Field(ge=1, le=MAX_INT32)
    metadata: dict[str, Any] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool | None = False
    temperature: float | None = None  # bounded as the chat request's (pd_wire.requests)
    top_p: float | None = None
    top_k: int | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request vLLM's Messages serving runs for this request."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(), "max_tokens": self.max_tokens}
        for name, value in (("stop", self.stop_sequences), ("temperature", self.temperature), ("top_p", self.top_p),
                            ("top_k", self.top_k)):
            if value is not None:
                body[name] = value
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None and fmt.schema_:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.type, "schema": fmt.schema_}}
        if isinstance(self.thinking, ThinkingEnabled):
            body["thinking_token_budget"] = self.thinking.budget_tokens
        tools = self.resolved_tools()
        if tools:  # none (or an empty list): no tool choice either, which vLLM then ignores
            body["tools"] = [t.chat_tool() for t in tools]
            choice = self.tool_choice
            body["tool_choice"] = "auto" if choice is None else (
                {"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
            if choice is not None:
                body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        kwargs = self.template_kwargs()
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        passed_through(body, self.model_extra, _PASSED_THROUGH)
        return body


def _system_text(content: str | list[Block]) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [b.text for b in content if b.type == "text" and b.text and not b.text.startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def _blocks_message(role: str, blocks: list[Block], out: list[dict[str, Any]]) -> dict[str, Any]:
    """A user or assistant message of blocks, as vLLM converts it; a user's tool results go to
    ``out`` as ``tool`` messages (before the message itself)."""
    chat: dict[str, Any] = {"role": role}
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        if block.type == "text" and block.text:
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image" and block.source:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.source)}})
        elif block.type == "thinking" and block.thinking is not None:
            reasoning.append(block.thinking)
        elif block.type == "tool_use":
            calls.append({"id": block.id or f"call_{int(time.time())}", "type": "function",
                          "function": {"name": block.name or "", "arguments": json.dumps(block.input or {})}})
        elif block.type == "tool_result":
            if role == "user":
                _tool_result(block, out)
            else:  # vLLM's text for a result inside an assistant message (Python's str of the content)
                parts.append({"type": "text", "text": f"Tool result: {str(block.content) if block.content else ''}"})
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    return chat


def _tool_result(block: Block, out: list[dict[str, Any]]) -> None:
    text, images, references = "", [], []
    if isinstance(block.content, str):
        text = block.content
    elif isinstance(block.content, list):
        texts = []
        for item in block.content:
            kind = item.get("type")
            if kind == "text":
                texts.append(str(item.get("text", "")))
            elif kind == "image":
                url = _image_url(item.get("source") or {})
                if url:
                    images.append(url)
            elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    out.append({"role": "tool", "tool_call_id": block.tool_use_id or "", "content": text})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if references:
        out.append({"role": "tool", "tool_call_id": block.tool_use_id or "", "content": references})


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


_UNION_BRANCHES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _invalid(exc: ValidationError) -> InvalidRequest:
    """The 400 of the most specific error (a block's refused ``type`` rather than "not a
    string"), its field path without pydantic's union branch labels."""
    err = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
    param = ".".join(str(p) for p in err["loc"]
                     if not (isinstance(p, str) and ("[" in p or p in _UNION_BRANCHES))) or None
    return InvalidRequest(f"{param}: {err['msg']}" if param else err["msg"], param=param)


def parse_messages(raw: bytes) -> MessagesRequest:
    """The validated ``/v1/messages`` request (a 400 naming the field otherwise)."""
    try:
        request = MessagesRequest.model_validate(json_object(raw))
    except ValidationError as exc:
        raise _invalid(exc) from None
    request.resolved_tools()  # a change naming an undeclared tool: a 400 before any work
    return request


def parse_count_tokens(raw: bytes) -> CountTokensRequest:
    """The validated ``/v1/messages/count_tokens`` request."""
    try:
        request = CountTokensRequest.model_validate(json_object(raw))
    except ValidationError as exc:
        raise _invalid(exc) from None
    request.resolved_tools()
    return request
