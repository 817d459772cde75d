"""The content of Anthropic's Messages API bodies (:mod:`pd_router.apis.messages`): blocks,
messages, tools and their choice, thinking and output settings, as pydantic models, every count
bounded (:mod:`pd_wire.limits`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pd_wire.limits import MAX_CONTENT_PARTS, MAX_INT32

BlockType = Literal["text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking",
                    "tool_addition", "tool_removal"]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    defer_loading: bool | None = None

    @field_validator("input_schema")
    @classmethod
    def _typed(cls, schema: dict[str, Any]) -> dict[str, Any]:
        return schema if "type" in schema else {**schema, "type": "object"}  # vLLM's default

    def chat_tool(self) -> dict[str, Any]:
        """The tool in chat completions' shape, as vLLM hands it to the chat template."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        for key in ("description", "strict", "defer_loading"):
            value = getattr(self, key)
            if value is not None:
                function[key] = value
        return {"type": "function", "function": function}


class ToolReference(BaseModel):
    type: Literal["tool_reference"]
    name: str = Field(min_length=1)


class ToolDefinition(BaseModel):
    type: Literal["tool_definition"]
    definition: Tool


class Block(BaseModel):
    """A content block (every kind vLLM accepts; each kind reads its own fields)."""

    model_config = ConfigDict(extra="allow")

    type: BlockType
    text: str | None = None
    source: dict[str, Any] | None = None
    id: str | None = None
    tool_use_id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    is_error: bool | None = None
    tool_name: str | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    tool: Annotated[ToolReference | ToolDefinition, Field(discriminator="type")] | None = None

    @model_validator(mode="after")
    def _tool_change(self) -> Block:
        if self.type in ("tool_addition", "tool_removal"):
            if self.tool is None:
                raise ValueError(f"tool is required for {self.type} blocks")
            if self.type == "tool_removal" and self.tool.type != "tool_reference":
                raise ValueError("tool_removal only accepts a tool_reference")
        return self


Blocks = Annotated[list[Block], Field(max_length=MAX_CONTENT_PARTS)]


def no_tool_changes(content: str | list[Block] | None) -> None:
    if isinstance(content, list) and any(b.type in ("tool_addition", "tool_removal") for b in content):
        kind = next(b.type for b in content if b.type in ("tool_addition", "tool_removal"))
        raise ValueError(f'{kind} blocks are only allowed in messages with role "system"')


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant", "system"]
    content: str | Blocks

    @model_validator(mode="after")
    def _changes_in_system_only(self) -> Message:
        if self.role != "system":
            no_tool_changes(self.content)
        return self


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice.name is required when type is 'tool'")
        return self


class JsonFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["json_schema"] = "json_schema"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonFormat | None = None


class ThinkingEnabled(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024, le=MAX_INT32)
    display: Literal["summarized", "omitted", "updates"] | None = None


class ThinkingDisabled(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["disabled"]


class ThinkingAdaptive(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["adaptive"]
    display: Literal["summarized", "omitted", "updates"] | None = None


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")]
