"""The OpenAI request bodies of the two generation endpoints, and which request features
each engine supports: ONE model per endpoint, used by both servers that read them.

* The router parses each client body once with these models (:mod:`pd_router.apis.completions` adds
  the few rules only a client-facing server needs: ``model`` required, a non-empty prompt),
  then, before it sends anything to prefill, runs :func:`unsupported` against the
  :class:`~pd_wire.decode.EngineFeatures` the chosen decode server advertises
  (:mod:`pd_router.request.checks`), so a request the decode server would refuse gets the
  same 400 without costing a prefill.
* The decode server validates every body it gets (the client's body plus
  ``kv_transfer_params``) with the same models and refuses with :func:`unsupported`
  (after prefill ran: the KV is already there).

Wire-level code: pydantic, the rest of :mod:`pd_wire` and :mod:`pd_grammar` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pd_grammar.spec import grammar_param
from pd_wire.decode import EngineFeatures
from pd_wire.handoff import HandoffClaim, HandoffResult
from pd_wire.limits import (
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_PROMPT_TOKEN_IDS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
    content_parts_refusal,
    too_many,
)

MAX_LOGPROBS = 20
GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's sampling epsilon (and TileRT's)


class Endpoint(StrEnum):
    """An OpenAI generation endpoint; its value is its label (metrics, plans)."""

    CHAT = "chat"
    COMPLETIONS = "completions"

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self is Endpoint.CHAT else "/v1/completions"

    @property
    def label(self) -> str:
        return self.value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM extension: usage in every chunk


class _Common(BaseModel):
    """The fields both endpoints share; every count and size bounded (:mod:`pd_wire.limits`), every
    number finite."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = Field(default=None, min_length=1)  # the router requires it (pd_router.apis.completions)
    # required by the decode server (its route says so first); a client's is refused by the router
    kv_transfer_params: HandoffResult | HandoffClaim | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=MAX_INT32)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    # vLLM's: lower is served sooner; the router orders the decode queues by it (docs/router.md,
    # "Who waits for a decode slot"); the decode server, one sequence per slot, has no use for it
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    # vLLM's: at most this many reasoning tokens, then the reasoning's end token is forced (-1: none)
    thinking_token_budget: int | None = Field(default=None, le=MAX_INT32)

    @field_validator("thinking_token_budget", mode="before")
    @classmethod
    def _budget(cls, budget: Any) -> Any:
        if budget is None:
            return None
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < -1:
            raise ValueError("thinking_token_budget must be a non-negative integer or -1 for unlimited")
        return None if budget == -1 else budget

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_bounded(cls, stop: Any) -> Any:
        if isinstance(stop, list):
            refusal = too_many("stop sequences", stop, MAX_STOP_SEQUENCES)
            if refusal is not None:
                raise ValueError(refusal)
        for one in stop if isinstance(stop, list) else [stop]:
            if isinstance(one, str) and len(one) > MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters (got {len(one)})")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: Any = None
    # 0 only for the prompt's logprobs alone (echo), which prefill serves: refused everywhere else
    max_tokens: int | None = Field(default=16, ge=0, le=MAX_INT32)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, le=MAX_INT32)

    @field_validator("prompt", mode="after")
    @classmethod
    def _token_ids_bounded(cls, prompt: Any) -> Any:
        """A prompt of token ids (or a list of them): each list at most ``MAX_PROMPT_TOKEN_IDS``
        long, each id in [0, ``MAX_INT32``]. How many prompts is the router's ``--max-choices``."""
        if not isinstance(prompt, list):
            return prompt
        for ids in [prompt] if not prompt or not isinstance(prompt[0], list) else prompt:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                continue
            if len(ids) > MAX_PROMPT_TOKEN_IDS:
                raise ValueError(f"a prompt has at most {MAX_PROMPT_TOKEN_IDS} token ids (got {len(ids)})")
            if any(t < 0 or t > MAX_INT32 for t in ids):
                raise ValueError(f"token ids are integers in [0, {MAX_INT32}]")
        return prompt

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def asked_max_tokens(self) -> tuple[int | None, str]:
        """The output's bound as the client gave it (None: the context's room) and its field."""
        return self.max_tokens, "max_tokens"


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True  # false: only the first call is returned (as vLLM filters them)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the template's reasoning_effort, and its enable_thinking (false for "none") unless
    # chat_template_kwargs says otherwise
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    def thinking(self) -> bool:
        """Whether the chat template opens the model's reasoning, as vLLM decides it:
        ``chat_template_kwargs``' ``enable_thinking`` (or ``thinking``) when given, else
        ``reasoning_effort`` other than ``none``, else on."""
        kwargs = self.chat_template_kwargs or {}
        for key in ("enable_thinking", "thinking"):
            if kwargs.get(key) is False:
                return False
        if "enable_thinking" not in kwargs and self.reasoning_effort == "none":
            return False
        return True

    @field_validator("messages", mode="after")
    @classmethod
    def _parts_bounded(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        refusal = content_parts_refusal(messages)
        if refusal is not None:
            raise ValueError(refusal)
        return messages

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def asked_max_tokens(self) -> tuple[int | None, str]:
        """The output's bound as the client gave it (None: the context's room) and its field
        (``max_completion_tokens`` over ``max_tokens``, as vLLM reads them)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


OpenAIRequest = CompletionRequest | ChatCompletionRequest
MODELS: Mapping[Endpoint, type[CompletionRequest] | type[ChatCompletionRequest]] = MappingProxyType({
    Endpoint.COMPLETIONS: CompletionRequest,
    Endpoint.CHAT: ChatCompletionRequest,
})


LOGIT_BIAS_LIMIT = 100.0  # a bias is clamped to +-100, as OpenAI documents and vLLM does


def logit_bias(bias: Mapping[str, float] | None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, clamped bias) pairs; its keys were checked by :func:`unsupported`."""
    if not bias:
        return ()
    return tuple((int(t), max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(b)))) for t, b in bias.items())


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: an OpenAI 400's ``message`` and ``param``."""

    message: str
    param: str | None = None


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """Pydantic's error list as one message and the offending parameter."""
    first = errors[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    msg = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}" for e in errors[:5]
    )
    return msg, loc or None


def parse(endpoint: Endpoint, body: Mapping[str, Any]) -> OpenAIRequest | Refusal:
    """The body validated with its endpoint's model; the refusal (400) otherwise."""
    try:
        return MODELS[endpoint].model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_url=False))
        return Refusal(message, param)


_NEUTRAL_PENALTIES = (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))


def unsupported(req: OpenAIRequest, features: EngineFeatures, engine: str, routed: bool = False) -> Refusal | None:
    """The first thing in ``req`` a decode server whose engine has ``features`` cannot do.
    ``routed``: the router's check, which serves ``echo`` and ``prompt_logprobs`` itself
    (they never reach the decode server)."""
    if (req.n or 1) > 1:
        return Refusal("n > 1 is not supported: a KV handoff carries one sequence; send n requests", "n")
    if not features.penalties:
        for name, neutral in _NEUTRAL_PENALTIES:
            got = getattr(req, name)
            if got is not None and got != neutral:
                return Refusal(f"{name}={got} is not supported by the {engine} engine (only {neutral})", name)
    if req.logit_bias and not features.logit_bias:
        return Refusal(f"logit_bias is not supported by the {engine} engine", "logit_bias")
    for key in req.logit_bias or ():
        digits = key.strip()
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 10 or int(digits) > MAX_INT32:
            return Refusal(f"logit_bias: {key!r} is not a token id", "logit_bias")
    if req.min_p and not features.min_p:
        return Refusal(f"min_p={req.min_p} is not supported by the {engine} engine (only 0)", "min_p")
    greedy = req.temperature is not None and req.temperature < GREEDY_BELOW_TEMPERATURE
    if req.seed is not None and not features.seed and not greedy:
        return Refusal(f"seed is not supported by the {engine} engine (its sampler is seeded per process; "
                       "a seed is accepted with temperature 0)", "seed")
    extra = req.model_extra or {}
    if not features.structured_output:  # with it, pd_grammar checks what the grammar fields ask for
        chat = not isinstance(req, CompletionRequest)
        param = grammar_param({**extra, "tool_choice": getattr(req, "tool_choice", None)}, chat)
        if param is not None:
            return Refusal(f"{param}: constrained decoding is not supported by the {engine} engine", param)
    if req.thinking_token_budget is not None and not features.structured_output:
        return Refusal(f"thinking_token_budget is not supported by the {engine} engine (it cannot force a token)",
                       "thinking_token_budget")
    if extra.get("prompt_logprobs") is not None and not routed:
        return Refusal("prompt_logprobs is not supported by the decode server", "prompt_logprobs")
    if isinstance(req, CompletionRequest):
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) > 1 and not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return Refusal("a list of prompts is not supported: a KV handoff carries one sequence; send a request "
                           "for each", "prompt")
        if req.max_tokens == 0:
            return zero_max_tokens()
        if req.echo and not routed:
            return Refusal("echo is not supported: the decode server never sees the prompt's logprobs", "echo")
        if req.suffix:
            return Refusal("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of > 1:
            return Refusal("best_of > 1 is not supported", "best_of")
        wants_logprobs = req.logprobs is not None
    else:
        if req.top_logprobs and not req.logprobs:
            return Refusal("top_logprobs requires logprobs to be true", "top_logprobs")
        wants_logprobs = bool(req.logprobs)
    if wants_logprobs and not features.logprobs:
        return Refusal(f"logprobs are not supported by the {engine} engine", "logprobs")
    if req.stop_token_ids and any(t < 0 or t > MAX_INT32 for t in req.stop_token_ids):
        return Refusal("stop_token_ids must be non-negative token ids", "stop_token_ids")
    return None


def over_context(req: OpenAIRequest, max_seq_len: int) -> Refusal | None:
    """The 400 for an output bound that leaves no room for any prompt in a context of
    ``max_seq_len`` tokens (known before the prompt's length is)."""
    asked, param = req.asked_max_tokens()
    if asked is None or asked < max_seq_len:
        return None
    return Refusal(f"This model's maximum context length is {max_seq_len} tokens. However, you requested {asked} "
                   f"tokens in the completion, which leaves no room for the prompt. Please reduce {param}.", param)


def zero_max_tokens() -> Refusal:
    """``max_tokens`` 0 asks for the prompt's logprobs alone, which only a prefill server
    answers (a completion with ``echo`` and ``logprobs``): refused everywhere else."""
    return Refusal("max_tokens: Input should be greater than or equal to 1 (0 only with echo and logprobs: the "
                   "prompt's logprobs alone)", "max_tokens")


def check(endpoint: Endpoint, body: Mapping[str, Any], features: EngineFeatures, engine: str) -> Refusal | None:
    """:func:`parse` then :func:`unsupported`: the 400 a decode server would answer, if any."""
    req = parse(endpoint, body)
    return req if isinstance(req, Refusal) else unsupported(req, features, engine)
