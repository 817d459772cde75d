"""What the router decides from a request before its decode and prefill legs: the decode
server's own 400 before anything is sent, for what no engine serves (:func:`check_decode_view`)
and what a server's advertised features exclude (:func:`refusal`, before its decode request
goes there); which requests a prefill server answers alone, what the prefill leg must ask for,
and where the first token comes from (:func:`result_with_kv`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_grammar.spec import GrammarSpec, asks_for_grammar
from pd_router.apis.completions import structured_output
from pd_router.errors import InvalidRequest, ModelNotFound, NoHealthyBackend
from pd_router.request.logprobs import echoes_logprobs
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

if TYPE_CHECKING:
    from pd_router.state import RouterState


@dataclass(frozen=True, eq=False)
class ValidRequest:
    """A request as the router accepted it, made once (:func:`validate`; once per choice of an
    ``n > 1`` request, whose choices' bodies are their own): the body, its pydantic view, the
    grammar its output follows, and what the router decided from them. Read by every stage
    from ``RequestContext.request``."""

    endpoint: Endpoint
    body: dict[str, Any]
    parsed: OpenAIRequest
    model: str  # served by a healthy prefill server
    grammar: GrammarSpec | None
    served_by_prefill: bool  # a prefill server answers it alone (:func:`served_by_prefill`)
    echoes_logprobs: bool  # a completion echoing its prompt with logprobs (pd_router.request.logprobs)

    def prefill_fields(self, capabilities: DecodeCapabilities | None) -> dict[str, Any]:
        return prefill_fields(self.parsed, capabilities)

    def with_kv(self, capabilities: DecodeCapabilities | None) -> bool:
        """Whether the first token travels with the KV to a decode server with these
        capabilities (:func:`result_with_kv`)."""
        return result_with_kv(self.body, self.parsed, capabilities)

    def refusal(self, capabilities: DecodeCapabilities | None) -> InvalidRequest | None:
        return refusal(self.parsed, capabilities)


async def grammar(state: RouterState, endpoint: Endpoint, body: Mapping[str, Any]) -> GrammarSpec | None:
    """The grammar the request's output must follow, checked off the loop (checking a large
    schema takes a while); a 400 naming what is wrong."""
    if not asks_for_grammar(body):
        return None
    return await asyncio.to_thread(structured_output, endpoint, body, state.schema_limits)


def served_model(state: RouterState, parsed: OpenAIRequest) -> str:
    """The request's model, served by a healthy prefill server (a 503 with none, a 404 naming
    what is served otherwise)."""
    served = state.backends.prefill_models()
    if not served:
        raise NoHealthyBackend("no healthy prefill server")
    model = parsed.model or ""  # parse_request requires it
    if model not in served:
        raise ModelNotFound(f"model {model!r} does not exist; served: {sorted(served)}", param="model",
                            code="model_not_found")
    return model


def validate(state: RouterState, endpoint: Endpoint, body: dict[str, Any], parsed: OpenAIRequest, model: str,
             grammar: GrammarSpec | None) -> ValidRequest:
    """The request (its model served, its grammar checked) as a :class:`ValidRequest`, once what
    its decode server would refuse for any engine is ruled out."""
    alone = served_by_prefill(endpoint, body)
    if not alone:
        check_decode_view(endpoint, body, parsed)
        check_context(parsed, (b.capabilities for b in state.backends.decode if b.serves(model)))
    return ValidRequest(endpoint, body, parsed, model, grammar, alone, echoes_logprobs(endpoint, body))


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


def refusal(req: OpenAIRequest, capabilities: DecodeCapabilities | None) -> InvalidRequest | None:
    """The 400 the decode server with these capabilities would answer, if any: the router's
    own, before the decode request is sent. A server without a capabilities endpoint (plain
    vLLM decode) checks for itself."""
    if capabilities is None:
        return None
    found = unsupported(req, capabilities.features, capabilities.engine, routed=True)
    return None if found is None else _invalid(found)
