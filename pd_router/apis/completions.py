"""The OpenAI request bodies the router accepts, and the two rewrites it makes.

A body is parsed once, with its endpoint's model from :mod:`pd_wire.requests` (the decode
server's own), plus the rules of a client-facing server (:func:`parse_request`); every field
passes through to prefill and decode untouched (``extra="allow"``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pd_grammar.spec import GrammarSpec, SchemaLimits, StructuredOutputError, grammar_spec
from pd_router.errors import InvalidRequest
from pd_wire.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    Endpoint,
    OpenAIRequest,
    Refusal,
    parse,
    zero_max_tokens,
)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object; 400 otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # the parser's own depth limit: refuse, as for any unusable body
        raise InvalidRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def effort_kwargs(given: Mapping[str, Any] | None, effort: str | None) -> dict[str, Any]:
    """The chat template's kwargs for a reasoning ``effort`` (the Responses API's
    ``reasoning.effort``, Anthropic's ``output_config.effort`` or disabled thinking), as vLLM
    passes it: ``reasoning_effort``, and ``enable_thinking`` false for ``none``; the client's own
    ``chat_template_kwargs`` (``given``) win."""
    kwargs = dict(given or {})
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def passed_through(body: dict[str, Any], extra: Mapping[str, Any] | None, names: tuple[str, ...]) -> None:
    """vLLM's own request fields among a translated request's extra fields (``names``), set on
    the chat ``body`` as they came."""
    given = extra or {}
    for name in names:
        if given.get(name) is not None:
            body[name] = given[name]


def parse_request(endpoint: Endpoint, raw: bytes) -> tuple[dict[str, Any], OpenAIRequest]:
    """The body as a dict (what is forwarded) and its validated view; 400 otherwise."""
    body = json_object(raw)
    request = parse(endpoint, body)
    if isinstance(request, Refusal):
        raise InvalidRequest(request.message, param=request.param)
    if request.model is None:
        raise InvalidRequest("model: Field required", param="model")
    if isinstance(request, ChatCompletionRequest) and not request.messages:
        raise InvalidRequest("messages: List should have at least 1 item after validation, not 0", param="messages")
    if isinstance(request, CompletionRequest):
        prompt = request.prompt
        if not isinstance(prompt, (str, list)) or not prompt:
            raise InvalidRequest("prompt: a non-empty string or list (of strings or token ids) is required",
                                 param="prompt")
        if request.max_tokens == 0 and request.echo is not True:
            zero = zero_max_tokens()
            raise InvalidRequest(zero.message, param=zero.param)
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    return body, request


# vLLM's NIXL connector convention for "prefill here, decode elsewhere" (plain vLLM decode).
VLLM_REMOTE_DECODE_PARAMS: Mapping[str, Any] = MappingProxyType(
    {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
)


def structured_output(endpoint: Endpoint, body: Mapping[str, Any], limits: SchemaLimits) -> GrammarSpec | None:
    """The grammar the request's output must follow (``response_format``, ``structured_outputs``,
    a chat's ``tools``), checked before any prefill: a bad or oversized schema is a 400 naming it."""
    try:
        return grammar_spec(body, limits, chat=endpoint is Endpoint.CHAT, compile=False)
    except StructuredOutputError as exc:
        raise InvalidRequest(exc.message, param=exc.param) from None


def prefill_body(endpoint: Endpoint, body: dict[str, Any], kv_transfer_params: Mapping[str, Any]) -> bytes:
    """The prefill leg's body (docs/facts.md §1): one token, not streamed, with the handoff target.
    The grammar's fields (``response_format``, ``structured_outputs``, ``tools``, ``tool_choice``)
    go as the client sent them: vLLM samples the first token under the same grammar the decode
    server builds (prefill runs GLM's tool-call and reasoning parsers, docs/router.md "Tools")."""
    out = dict(body)
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    # vLLM refuses these with speculative decoding (our prefill's MTP); the decode engine
    # chooses the first token itself when the request has them (docs/router.md)
    out.pop("logit_bias", None)
    out.pop("min_p", None)
    out.pop("echo", None)  # the router echoes the prompt itself (ROUTER_FIELDS)
    if endpoint is Endpoint.CHAT and "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
        if "max_tokens" in body:
            out["max_tokens"] = 1
    else:
        out["max_tokens"] = 1
        if endpoint is Endpoint.COMPLETIONS:  # not a completions field: prefill must not see another limit
            out.pop("max_completion_tokens", None)
    out["kv_transfer_params"] = dict(kv_transfer_params)
    return json.dumps(out).encode()


# Fields the router serves itself from the prefill answer: never sent to the decode server.
ROUTER_FIELDS = ("prompt_logprobs", "echo")


def decode_body(raw: bytes, body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> bytes:
    """The decode leg's body: the client's original body plus ``kv_transfer_params``, less
    :data:`ROUTER_FIELDS`.

    ``raw`` is the client's JSON text of ``body``. When it is a plain UTF-8 object without
    ``kv_transfer_params``, the field is appended to the text as it is (no re-encoding of
    a long prompt); otherwise the dict is encoded again."""
    text = raw.strip()
    if (
        "kv_transfer_params" not in body
        and not any(name in body for name in ROUTER_FIELDS)
        and text[:1] == b"{"
        and text[-1:] == b"}"
        and b"\x00" not in text[:4]
    ):
        head = text[:-1].rstrip()
        comma = b"" if head == b"{" else b","
        return head + comma + b' "kv_transfer_params": ' + json.dumps(kv_transfer_params).encode() + b"}"
    out = {k: v for k, v in body.items() if k not in ROUTER_FIELDS}
    out["kv_transfer_params"] = kv_transfer_params
    return json.dumps(out).encode()
