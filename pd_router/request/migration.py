"""An answer whose decode server was lost after the answer began goes on on another one.

The decode server of ours reports the output tokens of every write (its progress lines,
:mod:`pd_router.request.trail`), so the router knows, at any moment, the tokens whose text the client
has. When that server is lost (:class:`~pd_router.errors.DecodeLost`: its connection lost or
reset, no token for ``--stall-timeout``, an error event of its own failure), the attempts run
the request again as a *resumed* attempt (docs/reliability.md, "A decode server lost
mid-answer"):

1. the prompt's token ids, once per request: a completion's own, or those the prefill server's
   ``/tokenize`` renders for the request (the chat template, its tools and options), checked
   against the prompt's length prefill reported;
2. a decode request that holds a slot as any other, keeping the request's place in the queues
   (its arrival), and carrying :class:`~pd_wire.handoff.ResumeFrom`: the output so far;
3. a prefill of the prompt's and the output's ids (a completion of one token), its KV to that
   decode server;
4. the decode server's answer relayed on in the same client answer: it runs the output so far
   through its stop conditions, detokenizer and parsers without sending it again.

At most ``--max-migrations`` per request. What cannot move (an answer not streamed with logprobs:
the logprobs of its tokens so far are lost with their server; a grammar on a TileRT decode
server; a model a plain vLLM decode server also serves) ends as before: an error event (a 502
when not streamed) saying why.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pd_router.errors import BadUpstream, NoHealthyBackend
from pd_router.request.context import RequestContext
from pd_router.upstream import calls
from pd_wire.handoff import ResumeFrom
from pd_wire.requests import Endpoint

if TYPE_CHECKING:
    from pd_router.state import RouterState

TOKENIZE_PATH = "/tokenize"
# the fields of a chat request that shape the prompt vLLM renders: sent to /tokenize as they came
CHAT_PROMPT_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
                      "continue_final_message", "add_special_tokens", "documents", "mm_processor_kwargs")
# the sampling fields of the resumed prefill: the token it samples at the cut is the one a decode
# engine that cannot choose it itself (TileRT) goes on from
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")


def not_resumable(state: RouterState, ctx: RequestContext) -> str | None:
    """Why this answer cannot move to another decode server (None: it can)."""
    request, grammar = ctx.request.parsed, ctx.request.grammar
    if ctx.trail is None:
        return "its decode server reports no progress"
    if not request.stream and request.wants_logprobs():
        return "an answer not streamed with logprobs cannot move (the logprobs of its tokens so far were lost)"
    servers = [d for d in state.backends.decode if d.serves(ctx.model)]
    if any(d.capabilities is None for d in servers):
        return "a plain vLLM decode server serves the model (it resumes nothing)"
    if grammar is not None and any(d.capabilities is not None and d.capabilities.engine == "tilert" for d in servers):
        return "a TileRT decode server resumes no grammar (its token at the cut would be unconstrained)"
    return None


async def prompt_ids(state: RouterState, ctx: RequestContext) -> list[int]:
    """The prompt's token ids: a completion's own when it sent ids, else the prefill server's
    ``/tokenize`` of the request (the prompt vLLM rendered for it), checked against the
    length prefill reported."""
    body = ctx.request.body
    prompt = body.get("prompt")
    if ctx.endpoint is Endpoint.COMPLETIONS and isinstance(prompt, list):
        ids = [t for t in prompt if isinstance(t, int) and not isinstance(t, bool)]
        if len(ids) == len(prompt):
            return ids
    payload: dict[str, Any] = {"model": ctx.model}
    if ctx.endpoint is Endpoint.COMPLETIONS:
        payload["prompt"] = prompt
        if "add_special_tokens" in body:
            payload["add_special_tokens"] = body["add_special_tokens"]
    else:
        payload["messages"] = body.get("messages")
        payload.update({k: body[k] for k in CHAT_PROMPT_FIELDS if k in body})
    backend = state.backends.pick_prefill(ctx.model)
    if backend is None:
        raise NoHealthyBackend(f"no healthy prefill server for model {ctx.model!r}")
    answer = await calls.post_json(state.connections, backend.target, TOKENIZE_PATH, json.dumps(payload).encode(),
                                   f"{ctx.request_id[:240]}~tok", state.settings.prefill_timeout)
    tokens = answer.get("tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
        raise BadUpstream(f"prefill server {backend.url} answered /tokenize without token ids")
    if ctx.prompt_tokens and len(tokens) != ctx.prompt_tokens:
        raise BadUpstream(f"prefill server {backend.url} tokenized the prompt to {len(tokens)} tokens, prefill "
                          f"counted {ctx.prompt_tokens}")
    return tokens


def resume_from(ctx: RequestContext) -> ResumeFrom:
    """What the resuming decode server needs of the answer so far."""
    assert ctx.prompt_ids is not None and ctx.trail is not None
    # the prompt's ids always: a repetition penalty may come from the checkpoint's defaults
    return ResumeFrom(output_token_ids=list(ctx.trail.tokens), prompt_tokens=len(ctx.prompt_ids),
                      context_token_id=ctx.prompt_ids[-1], prompt_token_ids=ctx.prompt_ids)


def resume_body(ctx: RequestContext, body: Mapping[str, Any], target: Mapping[str, Any]) -> bytes:
    """The resumed attempt's prefill: a completion of one token whose prompt is the prompt's and
    the output's ids so far, its KV handed off to ``target``."""
    assert ctx.prompt_ids is not None and ctx.resume is not None
    out: dict[str, Any] = {"model": ctx.model, "prompt": ctx.prompt_ids + ctx.resume.output_token_ids,
                           "max_tokens": 1, "stream": False}
    out.update({k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None})
    out["kv_transfer_params"] = dict(target)
    return json.dumps(out).encode()
