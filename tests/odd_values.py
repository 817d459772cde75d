"""Wrong types and extreme values for every field of a request (the request-bounds tests of
the router and the decode server): each field of each API set, one at a time, to each of
:data:`ODD_VALUES` in an otherwise valid body, plus the counts a client gives far past
their bounds (:func:`huge_counts`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pd_wire.errors import ErrorBody

ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, -(2**63), 2**64, 10**30, 1.5, 1e308, -1e308, float("inf"), float("nan"),
    "", "x" * 400, "a\x00b", "\ud800", [], [None], [[[1]]], [[1, 2], [3]], {}, {"a": {"b": [None]}},
]

COMMON_FIELDS = [
    "model", "stream", "stream_options", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
    "return_tokens_as_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "user", "priority", "max_tokens", "response_format", "structured_outputs", "prompt_logprobs",
    "kv_transfer_params", "cache_salt", "request_id", "unknown_field",
]
CHAT_FIELDS = COMMON_FIELDS + [
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "echo",
]
COMPLETION_FIELDS = COMMON_FIELDS + ["prompt", "logprobs", "echo", "suffix", "best_of"]
RESPONSES_FIELDS = [
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "store", "tools",
    "tool_choice", "parallel_tool_calls", "text", "reasoning", "include", "previous_response_id", "conversation",
    "metadata", "prompt_cache_key", "truncation", "unknown_field",
]

# fields inside a chat message, a completion's list of prompts, a response's input item
MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"]
INPUT_ITEM_FIELDS = ["role", "content", "type"]


def bodies(endpoint: str, base: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(what was set, the body) for each field of ``endpoint`` ("chat", "completions",
    "responses") set to each odd value, at the top level and inside the body's message."""
    fields = {"chat": CHAT_FIELDS, "completions": COMPLETION_FIELDS, "responses": RESPONSES_FIELDS}[endpoint]
    for name in fields:
        for value in ODD_VALUES:
            yield f"{name}={value!r:.40}", {**base, name: value}
    inner = {"chat": ("messages", MESSAGE_FIELDS), "responses": ("input", INPUT_ITEM_FIELDS)}.get(endpoint)
    if inner is not None:
        key, inner_fields = inner
        for name in inner_fields:
            for value in ODD_VALUES:
                yield f"{key}[0].{name}={value!r:.40}", {**base, key: [{**base_item(endpoint), name: value}]}
        for value in ODD_VALUES:
            yield f"{key}=[{value!r:.40}]", {**base, key: [value]}
            yield f"{key}[0].content=[{value!r:.40}]", {**base, key: [{**base_item(endpoint), "content": [value]}]}
    if endpoint == "completions":
        for value in ODD_VALUES:
            yield f"prompt=[{value!r:.40}]", {**base, "prompt": [value]}
            yield f"prompt=[[{value!r:.40}]]", {**base, "prompt": [[value]]}


def base_item(endpoint: str) -> dict[str, Any]:
    return {"role": "user", "content": "hi"} if endpoint == "chat" else {"type": "message", "role": "user",
                                                                         "content": "hi"}


def huge_counts(endpoint: str, base: dict[str, Any], far: int = 100_000) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every count a client gives, far past its bound (``far`` items, or numbers up to 10**30):
    each a 400 from whichever server reads the field."""
    if endpoint != "responses":  # the Responses API has none of these fields
        for n in (10**6, 2**64, 10**30):
            yield f"n={n}", {**base, "n": n}
        yield "stop x far", {**base, "stop": ["s"] * far}
        yield "stop one long", {**base, "stop": "s" * far}
        yield "stop_token_ids x far", {**base, "stop_token_ids": list(range(far))}
        yield "logit_bias x far", {**base, "logit_bias": {str(i): 1 for i in range(far)}}
        yield "logit_bias huge id", {**base, "logit_bias": {str(2**64): 1}}
        yield "logit_bias unicode digit", {**base, "logit_bias": {"\u00b2": 1}}
        yield "logit_bias 5000 digits", {**base, "logit_bias": {"9" * 5000: 1}}
        yield "max_tokens 2**64", {**base, "max_tokens": 2**64}
        yield "max_tokens past the context", {**base, "max_tokens": 10**7}
        yield "min_tokens 2**64", {**base, "min_tokens": 2**64}
        yield "top_k 2**64", {**base, "top_k": 2**64}
        yield "seed 2**64", {**base, "seed": 2**64}
        yield "priority 10**30", {**base, "priority": 10**30}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    if endpoint == "chat":
        yield "tools x far", {**base, "tools": [tool] * far}
        yield "messages x far", {**base, "messages": [{"role": "user", "content": "hi"}] * far}
        yield "content parts x far", {**base, "messages": [{"role": "user", "content": [{"type": "text",
                                                                                          "text": "hi"}] * far}]}
        yield "tool_calls x far", {**base, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}] * far}]}
        yield "max_completion_tokens 2**64", {**base, "max_completion_tokens": 2**64}
        yield "top_logprobs 10**30", {**base, "logprobs": True, "top_logprobs": 10**30}
        yield "nested content 200 deep", {**base, "messages": [{"role": "user", "content": _nested(200)}]}
    if endpoint == "completions":
        yield "prompts x far", {**base, "prompt": ["p"] * far}
        yield "token-id prompts x far", {**base, "prompt": [[1]] * far}
        yield "token ids past the bound", {**base, "prompt": [1] * (2**21 + 1)}
        yield "token id 2**64", {**base, "prompt": [2**64]}
        yield "logprobs 10**30", {**base, "logprobs": 10**30}
        yield "best_of 10**30", {**base, "best_of": 10**30}
    if endpoint == "responses":
        yield "input x far", {**base, "input": [base_item("responses")] * far}
        yield "content parts x far", {**base, "input": [{**base_item("responses"), "content": [
            {"type": "input_text", "text": "hi"}] * far}]}
        yield "tools x far", {**base, "tools": [{"type": "function", "name": "f", "parameters": {}}] * far}
        yield "max_output_tokens 2**64", {**base, "max_output_tokens": 2**64}


def _nested(depth: int) -> Any:
    out: Any = "x"
    for _ in range(depth):
        out = [out]
    return out


def encode(body: dict[str, Any]) -> bytes:
    """The body as a client may send it: Python's JSON (``Infinity``, ``NaN`` and lone
    surrogates as ``\\ud800`` escapes included, which strict encoders refuse to write)."""
    return json.dumps(body).encode()


def problem(what: str, status: int, content: bytes) -> str | None:
    """What is wrong with an answer to an odd request (None: a 200, or a 4xx in OpenAI's
    shape); ``status`` -1: no answer."""
    if status < 0 or status >= 500:
        return f"{what}: {status} {content[:200]!r}"
    if status >= 400:
        try:
            ErrorBody.model_validate_json(content)
        except ValueError:
            return f"{what}: {status} not OpenAI-shaped: {content[:200]!r}"
    return None
