"""What the router serves of a request itself, from the prefill side: the prompt's logprobs
and a completion's echoed prompt (with its logprobs), asked of a prefill server beside the PD
prefill and merged into the decode server's answer where vLLM puts them; and the prompt's token
ids a prefill answer carries."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pd_router.apis.completions import prefill_body
from pd_wire.requests import Endpoint


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
