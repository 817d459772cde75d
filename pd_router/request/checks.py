"""What the router decides from a request before its decode and prefill legs: the decode
server's own 400 before anything is sent, for what no engine serves (:func:`check_decode_view`)
and what a server's advertised features exclude (:func:`refusal`, before its decode request
goes there); which requests a prefill server answers alone, what the prefill leg must ask for,
and where the first token comes from (:func:`result_with_kv`); and the answers the router
merges (prompt logprobs, echo)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from pd_router.apis.completions import prefill_body
from pd_router.errors import InvalidRequest
from pd_wire.decode import DecodeCapabilities
from pd_wire.requests import (
    CompletionRequest,
    Endpoint,
    OpenAIRequest,
    Refusal,
    over_context,
    unsupported,
    zero_max_tokens,
)


def _invalid(refusal: Refusal) -> InvalidRequest:
    return InvalidRequest(refusal.message, param=refusal.param)


def check_decode_view(endpoint: Endpoint, body: Mapping[str, Any], req: OpenAIRequest) -> None:
    """What the decode server and vLLM refuse, whatever the engine, in a body the router will
    split into prefill and decode (``req``: the body as :func:`pd_router.apis.completions.parse_request`
    validated it, once); its 400 otherwise."""
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None and body.get("stream"):  # vLLM's rule (prefill runs with stream false)
        raise InvalidRequest("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    if endpoint is Endpoint.COMPLETIONS and body.get("echo"):
        if body.get("stream") or not isinstance(body.get("prompt"), str):
            raise InvalidRequest("echo is supported for a string prompt, not streamed", param="echo")
    if isinstance(req, CompletionRequest) and req.max_tokens == 0:
        raise _invalid(zero_max_tokens())


def check_context(req: OpenAIRequest, capabilities: Iterable[DecodeCapabilities | None]) -> None:
    """The decode servers' own 400 for an output bound that leaves no room for any prompt, before
    prefill: when every decode server of the model says its context (``max_seq_len``) and the
    longest is too short. A server that does not say (plain vLLM) checks for itself."""
    known = list(capabilities)
    if not known or any(c is None for c in known):
        return
    refusal = over_context(req, max(c.max_seq_len for c in known if c is not None))
    if refusal is not None:
        raise _invalid(refusal)


def served_by_prefill(endpoint: Endpoint, body: Mapping[str, Any]) -> bool:
    """A completion that asks for the prompt's logprobs by ``echo`` and at most one new token
    (what lm-eval's loglikelihood requests are): vLLM computes all of it in its prefill step,
    so the prefill server answers it alone, exactly as vLLM does, and no decode slot is held."""
    max_tokens = body.get("max_tokens")
    return (endpoint is Endpoint.COMPLETIONS and body.get("echo") is True and body.get("logprobs") is not None
            and not body.get("stream") and isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
            and 0 <= max_tokens <= 1 and body.get("n", 1) == 1)


def prefill_fields(req: OpenAIRequest, capabilities: DecodeCapabilities | None) -> dict[str, Any]:
    """What the prefill leg must add for this decode server: ``return_token_ids`` when the
    repetition penalty (the request's, else the checkpoint's default) needs the prompt's
    token ids there (they travel in ``kv_transfer_params.prompt_token_ids``)."""
    if capabilities is None:
        return {}
    repetition = req.repetition_penalty
    if repetition is None:
        repetition = capabilities.sampling_defaults.repetition_penalty
    return {"return_token_ids": True} if repetition not in (None, 1.0) else {}


def result_with_kv(body: Mapping[str, Any], req: OpenAIRequest, capabilities: DecodeCapabilities | None) -> bool:
    """Whether the first token can travel with the KV (``HandoffTarget.result_with_kv``;
    ``HandoffClaim.result`` ``with_kv``) to this decode server. Not when the decode needs
    something of vLLM's answer (the first token's logprobs, the prompt's token ids:
    :func:`prefill_fields`; the router then posts it) or the router merges something of it
    (``prompt_logprobs``, ``echo``), nor for a decode server that is not ours."""
    return (capabilities is not None and not prefill_fields(req, capabilities) and not req.wants_logprobs()
            and body.get("prompt_logprobs") is None and not body.get("echo"))


def prompt_token_ids(answer: Mapping[str, Any]) -> list[int] | None:
    """``prompt_token_ids`` of a prefill answer (top level for chat, in the choice for completions)."""
    ids = answer.get("prompt_token_ids")
    choices = answer.get("choices")
    if ids is None and isinstance(choices, list) and choices and isinstance(choices[0], dict):
        ids = choices[0].get("prompt_token_ids")
    if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return ids
    return None


def prompt_logprobs_body(endpoint: Endpoint, body: dict[str, Any]) -> bytes:
    """A one-token request for the prompt's logprobs alone: the prefill leg's body without
    ``kv_transfer_params`` (vLLM's KV connector leaves such a request alone)."""
    out = json.loads(prefill_body(endpoint, body, {}))
    del out["kv_transfer_params"]
    return json.dumps(out).encode()


def echoes_logprobs(endpoint: Endpoint, body: Mapping[str, Any]) -> bool:
    """A completion that echoes its prompt with logprobs: the prompt's come first in its answer."""
    return endpoint is Endpoint.COMPLETIONS and bool(body.get("echo")) and body.get("logprobs") is not None


def echo_logprobs_body(body: Mapping[str, Any]) -> bytes:
    """The echoed prompt's logprobs alone, as vLLM answers them (``max_tokens`` 0): a plain
    request (no ``kv_transfer_params``) that generates nothing."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_ECHO}
    out.update(max_tokens=0, stream=False)
    return json.dumps(out).encode()


# what a zero-token echo does not take: a stream's and a generation's options (vLLM refuses
# logit_bias and min_p beside speculative decoding), and the handoff
_NOT_FOR_ECHO = ("stream_options", "min_tokens", "max_completion_tokens", "logit_bias", "min_p", "kv_transfer_params",
                 "prompt_logprobs")


def choice_logprobs(answer: Mapping[str, Any]) -> Any:
    """``choices[0].logprobs`` of a completion answer."""
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0].get("logprobs")
    return None


def echoed_logprobs(prompt: Any, generated: Any) -> Any:
    """A completion's logprobs with its echoed prompt's first, as vLLM answers them: one list
    of tokens, logprobs and top logprobs, the generated tokens' text offsets following the
    prompt tokens' (each offset is the text length of the tokens before it)."""
    if not isinstance(prompt, dict):
        return generated
    if not isinstance(generated, dict):
        return prompt
    tokens = list(prompt.get("tokens") or [])
    offsets = list(prompt.get("text_offset") or [])
    shift = offsets[-1] + len(tokens[-1]) if offsets and tokens else 0
    return {"tokens": tokens + list(generated.get("tokens") or []),
            "token_logprobs": list(prompt.get("token_logprobs") or []) + list(generated.get("token_logprobs") or []),
            "top_logprobs": list(prompt.get("top_logprobs") or []) + list(generated.get("top_logprobs") or []),
            "text_offset": offsets + [shift + o for o in generated.get("text_offset") or []]}


def prompt_logprobs_of(answer: Mapping[str, Any]) -> Any:
    """``prompt_logprobs`` of a prefill answer (top level for chat, in the choice for completions)."""
    if "prompt_logprobs" in answer:
        return answer["prompt_logprobs"]
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0].get("prompt_logprobs")
    return None


def merged(endpoint: Endpoint, data: bytes, body: Mapping[str, Any], prompt_logprobs: Any,
           echo_logprobs: Any = None) -> bytes:
    """The decode server's JSON answer with what the router serves itself, where vLLM puts
    it: prefill's ``prompt_logprobs`` (the response's top level for chat, each choice for
    completions) and, for a completion with ``echo``, the prompt before each choice's text
    (and, with ``logprobs``, the prompt's logprobs before the choice's: ``echo_logprobs``)."""
    answer = json.loads(data)
    if prompt_logprobs is not None and endpoint is Endpoint.CHAT:
        answer["prompt_logprobs"] = prompt_logprobs
    echo = endpoint is Endpoint.COMPLETIONS and body.get("echo")
    for choice in answer.get("choices") or []:
        if prompt_logprobs is not None and endpoint is Endpoint.COMPLETIONS:
            choice["prompt_logprobs"] = prompt_logprobs
        if echo:
            choice["text"] = body["prompt"] + choice.get("text", "")
            if echo_logprobs is not None:
                choice["logprobs"] = echoed_logprobs(echo_logprobs, choice.get("logprobs"))
    return json.dumps(answer).encode()


def refusal(req: OpenAIRequest, capabilities: DecodeCapabilities | None) -> InvalidRequest | None:
    """The 400 the decode server with these capabilities would answer, if any: the router's
    own, before the decode request is sent. A server without a capabilities endpoint (plain
    vLLM decode) checks for itself."""
    if capabilities is None:
        return None
    found = unsupported(req, capabilities.features, capabilities.engine, routed=True)
    return None if found is None else _invalid(found)
