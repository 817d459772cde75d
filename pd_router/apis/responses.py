"""``POST /v1/responses`` as vLLM serves it without a store, mapped onto chat completions.

vLLM builds its Responses API on its chat serving: the request's ``instructions`` and
``input`` items become chat messages, its function tools the chat tools, and the chat
template renders the prompt. The router does the same translation at its edge
(:meth:`ResponsesRequest.chat_body`), so the rest of the path is the chat route's (decode
slot, prefill, handoff, decode, migration, metrics), and the chat answer becomes a
``response`` object or the Responses API's events (:mod:`pd_router.apis.responses_out`).

The items, as vLLM turns them into messages: ``message`` (any role, ``developer``
included; its content a string or text parts; an assistant message keeps its first part's
text), ``function_call`` (a tool call of the assistant message before it, or a new one),
``function_call_output`` (a ``tool`` message), ``reasoning`` (the assistant message's
``reasoning``; ``encrypted_content`` is refused, as vLLM refuses it). Tools: ``function``
tools (the chat template gets them in chat completions' shape), ``namespace`` tools (each of
their functions shown as ``<namespace>__<name>``, and a call of one answered with its
``namespace``, as vLLM does), hosted tools (``web_search``, ``mcp``, ...) left out of the
prompt, as vLLM leaves them; ``custom`` (free-form) tools are refused. ``tool_choice`` ``auto``,
``none``, ``required`` or a named function; ``text.format`` ``json_object`` /
``json_schema`` become ``response_format``; ``reasoning.effort`` the chat template's
``reasoning_effort`` and ``enable_thinking``, as vLLM passes them. Without a store (vLLM's
default), ``store`` is accepted and nothing is kept, ``previous_response_id`` is a 404
(no response is known), ``background`` is refused. What Codex and the Agents SDK send
besides (``include``, ``prompt_cache_key``, ``client_metadata``, ``metadata``,
``service_tier``, ``truncation``, ``user``, ...) is accepted and, where vLLM does, echoed.
vLLM's own extensions (``top_k``, ``min_p``, ``seed``, ``stop``, penalties,
``chat_template_kwargs``, ``priority``, ...) pass through to the chat request.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, ValidationError, field_validator

from pd_router.apis.completions import effort_kwargs, json_object, passed_through
from pd_router.errors import InvalidRequest, UnknownResponse
from pd_wire.limits import MAX_CONTENT_PARTS, MAX_INT32, MAX_MESSAGES, MAX_TOOLS


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"] = "input_text"
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]
    status: str | None = None


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str
    namespace: str | None = None  # a namespace tool's function: the model called <namespace>__<name>
    id: str | None = None
    status: str | None = None

    def model_name(self) -> str:
        return f"{self.namespace}{NAMESPACE_SEPARATOR}{self.name}" if self.namespace else self.name


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output"]
    call_id: str
    output: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]
    id: str | None = None
    summary: Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] = Field(default_factory=list)
    content: Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: dict[str, type[InputItem]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                      "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        """The tool in chat completions' shape, as vLLM hands it to the chat template."""
        function: dict[str, Any] = {"name": self.name}
        for key in ("description", "parameters", "strict"):
            value = getattr(self, key)
            if value is not None:
                function[key] = value
        return {"type": "function", "function": function}


NAMESPACE_SEPARATOR = "__"  # a namespace's function is shown to the model as <namespace>__<name>, as vLLM


class NamespaceTool(BaseModel):
    """A group of functions (Codex's ``multi_agent_v1``): each shown to the model as a function
    named ``<namespace>__<name>``, as vLLM flattens them; what is not a function is left out."""

    model_config = ConfigDict(extra="allow")

    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] = Field(default_factory=list)

    def functions(self) -> list[FunctionTool]:
        functions = [FunctionTool.model_validate(tool) for tool in self.tools if tool.get("type") == "function"]
        return [fn.model_copy(update={"name": f"{self.name}{NAMESPACE_SEPARATOR}{fn.name}"}) for fn in functions]


class HostedTool(BaseModel):
    """A tool the model is never shown (``web_search``, ``file_search``, ``mcp``, ``computer``,
    ``image_generation``, ...): left out of the prompt, as vLLM leaves it out."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(min_length=1)

    @field_validator("type")
    @classmethod
    def _not_custom(cls, value: str) -> str:
        if value == "custom":
            raise ValueError("custom (free-form) tools are not supported; use function tools")
        return value


def _tool_kind(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return kind if kind in ("function", "namespace") else "hosted"


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[NamespaceTool, Tag("namespace")]
                 | Annotated[HostedTool, Tag("hosted")], Discriminator(_tool_kind)]


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# vLLM's own request fields, passed to the chat request as they came
_PASSED_THROUGH = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "priority", "cache_salt", "structured_outputs",
                   "logit_bias", "user")


class ResponsesRequest(BaseModel):
    """A ``/v1/responses`` body: every count bounded (:mod:`pd_wire.limits`), every number finite."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(min_length=1)
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = None
    background: bool | None = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] = Field(default_factory=list)
    tool_choice: Literal["auto", "none", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: Annotated[list[str], Field(max_length=64)] | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    truncation: Literal["auto", "disabled"] | None = "disabled"
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = Field(default=None, ge=1, le=MAX_INT32)
    chat_template_kwargs: dict[str, Any] | None = None

    _items: list[InputItem] | None = PrivateAttr(default=None)  # items(), validated once

    def items(self) -> list[InputItem]:
        """The input items, each validated by its type (a 400 naming the item otherwise), once."""
        if self._items is None:
            self._items = self._validated_items()
        return self._items

    def _validated_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        items: list[InputItem] = []
        for i, raw in enumerate(self.input):
            kind = raw.get("type") or ("message" if "role" in raw else None)
            model = _ITEMS.get(kind) if isinstance(kind, str) else None
            if model is None:
                raise InvalidRequest(f"Unsupported input item type: {kind}", param=f"input.{i}.type")
            try:
                item = model.model_validate(raw)
            except ValidationError as exc:
                raise _invalid(exc, f"input.{i}") from None
            if isinstance(item, ReasoningItem) and item.encrypted_content:  # vLLM's refusal
                raise InvalidRequest("Encrypted content is not supported.", param=f"input.{i}.encrypted_content")
            items.append(item)
        return items

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages vLLM makes of ``instructions`` and the input items: tool calls and
        reasoning join the assistant message before them."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        for item in self.items():
            last = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
            if isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.model_name(), "arguments": item.arguments}}
                if last is not None:
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "tool_calls": [call]})
            elif isinstance(item, ReasoningItem):
                parts = item.content or item.summary
                reasoning = parts[0].text if parts else ""
                if last is not None and "reasoning" not in last:
                    last["reasoning"] = reasoning
                else:
                    messages.append({"role": "assistant", "reasoning": reasoning})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
            elif item.role == "assistant":
                text = item.content if isinstance(item.content, str) else (
                    item.content[0].text if item.content else None)
                if text is None:
                    continue
                if last is not None and last.get("content") is None:
                    last["content"] = text
                else:
                    messages.append({"role": "assistant", "content": text})
            else:
                content: Any = item.content if isinstance(item.content, str) else [
                    {"type": "text", "text": p.text} for p in item.content]
                messages.append({"role": item.role, "content": content})
        return messages

    def function_tools(self) -> list[FunctionTool]:
        """The functions the model is shown, in order: function tools, and each namespace's."""
        out: list[FunctionTool] = []
        for tool in self.tools:
            if isinstance(tool, FunctionTool):
                out.append(tool)
            elif isinstance(tool, NamespaceTool):
                out.extend(tool.functions())
            if len(out) > MAX_TOOLS:  # namespaces hold up to MAX_TOOLS each: the functions are bounded too
                raise InvalidRequest(f"tools hold more than {MAX_TOOLS} functions", param="tools")
        return out

    def call_names(self) -> dict[str, tuple[str, str]]:
        """A namespaced function's name as the model calls it -> (its namespace, its name)."""
        return {f"{tool.name}{NAMESPACE_SEPARATOR}{fn.get('name')}": (tool.name, str(fn.get("name")))
                for tool in self.tools if isinstance(tool, NamespaceTool)
                for fn in tool.tools if fn.get("type") == "function"}

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request vLLM's Responses serving runs for this request."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(), "stream": bool(self.stream)}
        functions = self.function_tools()
        if functions:
            body["tools"] = [t.chat_tool() for t in functions]
            choice = self.tool_choice
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                                   if isinstance(choice, NamedFunction) else choice)
            body["parallel_tool_calls"] = self.parallel_tool_calls is not False
        for name, value in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p)):
            if value is not None:
                body[name] = value
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_ or {}, "strict": fmt.strict}}
        kwargs = effort_kwargs(self.chat_template_kwargs, self.reasoning.effort if self.reasoning else None)
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        passed_through(body, self.model_extra, _PASSED_THROUGH)
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


def _invalid(exc: ValidationError, prefix: str | None = None) -> InvalidRequest:
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"])
    param = ".".join(p for p in (prefix, loc) if p) or None
    return InvalidRequest(f"{param}: {err['msg']}" if param else err["msg"], param=param)


def parse(raw: bytes) -> ResponsesRequest:
    """The validated request (a 400 naming the field otherwise; a 404 for a
    ``previous_response_id``, which no store here holds, as vLLM without its store answers)."""
    body = json_object(raw)
    try:
        request = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None
    if request.background:
        raise InvalidRequest("background is not supported: this server keeps no responses (no store)",
                             param="background")
    if body.get("prompt") not in (None, {}):
        raise InvalidRequest("prompt (a stored prompt template) is not supported: this server keeps no prompts",
                             param="prompt")
    if request.previous_response_id is not None:
        raise UnknownResponse(f"Response with id '{request.previous_response_id}' not found.", param="response_id")
    request.items()  # each item checked before any work
    try:
        request.function_tools()
    except ValidationError as exc:
        raise _invalid(exc, "tools") from None
    return request
