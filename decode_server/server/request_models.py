"""Request bodies of the decode server's OpenAI endpoints.

The body is the client's original OpenAI request plus ``kv_transfer_params``
(a :class:`connector.protocol.HandoffResult`). Unknown fields are accepted and
ignored, as the router forwards the client's body untouched. Fields this server
cannot honour with a non-default value are rejected with a 400 (see
:func:`decode_server.server.request_plan.build_plan`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from connector.protocol import HandoffResult

MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM extension: usage in every chunk


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    kv_transfer_params: HandoffResult
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None
    # Accepted only at their neutral value (the engines do not implement them).
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: Any = None
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


Endpoint = Literal["completions", "chat"]
