""":attr:`Stage.PREFILL <pd_router.request.stages.Stage>`: the request to a prefill server with the
KV handoff's target (:func:`handoff`: the least-loaded healthy one, one retry elsewhere on a
connection failure, :func:`post`), the prompt's logprobs asked of another at the same time
(:func:`plain`), and the ``kv_transfer_params`` its answer carries for decode
(:func:`read_handoff`); and a request a prefill server answers alone (:func:`answer_alone`:
echo with logprobs)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from pd_http.tracing import Span, SpanKind, Tracing
from pd_router.apis.completions import VLLM_REMOTE_DECODE_PARAMS, prefill_body
from pd_router.asgi import respond
from pd_router.errors import (
    BadUpstream,
    ConnectionLost,
    KVNotDelivered,
    NoHealthyBackend,
    PromptTooLong,
    Requeue,
    RouterError,
    Unreachable,
)
from pd_router.request import logprobs, migration, observe
from pd_router.request.context import Attempt, RequestContext
from pd_router.request.stages import Stage
from pd_router.slots.pool import Slot
from pd_router.upstream import calls
from pd_wire.handoff import HandoffResult, HandoffTarget
from pd_wire.requests import ChatCompletionRequest, Endpoint, OpenAIRequest

if TYPE_CHECKING:
    from pd_router.state import RouterState


async def handoff(state: RouterState, ctx: RequestContext, attempt: Attempt,
                  result_with_kv: bool = False) -> dict[str, Any]:
    """The attempt's prefill; the ``kv_transfer_params`` its answer carries for decode.
    ``result_with_kv``: the connector also sends them to the decode server with the KV. An
    attempt that resumes a cut sequence (``ctx.resume``) prefills the prompt's and the output's
    token ids so far instead (:func:`pd_router.request.migration.resume_body`)."""
    slot, body, handoff_id = attempt.slot, attempt.body, attempt.handoff_id
    request = ctx.request.parsed
    decode = slot.backend
    if decode.capabilities is None:
        target: Mapping[str, Any] = VLLM_REMOTE_DECODE_PARAMS
    else:
        target = HandoffTarget(handoff_id=handoff_id, kv_endpoint=decode.capabilities.kv_endpoint,
                               result_with_kv=result_with_kv).model_dump(exclude_defaults=True)
    # asked of a prefill server apart, at the same time: the prompt's logprobs, and those of a
    # completion's echoed prompt
    if ctx.resume is not None:
        data = migration.resume_body(ctx, body, target)
        answer = await post(state, ctx, data, Endpoint.COMPLETIONS.path, handoff_id)
        with observe.span(state, ctx, "handoff") as span:
            return read_handoff(state, slot, answer, request, handoff_id, span)
    sides: dict[str, asyncio.Future[dict[str, Any]]] = {}
    if body.get("prompt_logprobs") is not None:
        sides["prompt"] = asyncio.ensure_future(prompt_logprobs(state, ctx, body))
        body = {k: v for k, v in body.items() if k != "prompt_logprobs"}
    if ctx.request.echoes_logprobs:
        sides["echo"] = asyncio.ensure_future(plain(
            state, ctx, logprobs.echo_logprobs_body(body), f"{ctx.request_id[:240]}~echo"))
    try:
        answer = await post(state, ctx, prefill_body(ctx.endpoint, body, target), ctx.endpoint.path, handoff_id)
        if "prompt" in sides:
            ctx.prompt_logprobs = logprobs.prompt_logprobs_of(await sides["prompt"])
        if "echo" in sides:
            ctx.echo_logprobs = logprobs.choice_logprobs(await sides["echo"])
    finally:
        for side in sides.values():
            if not side.done():
                side.cancel()
            elif not side.cancelled():
                side.exception()  # retrieved: the PD prefill's own failure is the one raised
    with observe.span(state, ctx, "handoff") as span:
        params = read_handoff(state, slot, answer, request, handoff_id, span)
    tokens = params.get("num_prompt_tokens")
    ctx.prompt_tokens = tokens if isinstance(tokens, int) else 0
    return params


async def prompt_logprobs(state: RouterState, ctx: RequestContext, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM schedules a request with ``prompt_logprobs`` without asking the KV connector
    first (it skips the prefix-cache lookup, where the connector holds a request back
    until its decode server admitted the KV): the prompt's logprobs come from a plain
    one-token request to a prefill server, run next to the PD prefill."""
    return await plain(state, ctx, logprobs.prompt_logprobs_body(ctx.endpoint, body), f"{ctx.request_id[:240]}~plp")


async def plain(state: RouterState, ctx: RequestContext, data: bytes, request_id: str) -> dict[str, Any]:
    """``data`` (no ``kv_transfer_params``: vLLM's KV connector leaves it alone) to the
    least-loaded prefill server serving the request's model; its JSON answer."""
    model = ctx.model
    backend = state.backends.pick_prefill(model)
    if backend is None:
        raise NoHealthyBackend(f"no healthy prefill server for model {model!r}")
    backend.sent()
    try:
        return await calls.post_json(state.connections, backend.target, ctx.endpoint.path, data, request_id,
                                     state.settings.prefill_timeout)
    finally:
        backend.in_flight -= 1


async def answer_alone(state: RouterState, ctx: RequestContext) -> None:
    """The whole request to a prefill server (:func:`pd_router.request.checks.served_by_prefill`),
    its answer relayed as it is: vLLM's own echo and logprobs."""
    ctx.stage = Stage.PREFILL
    answer = await plain(state, ctx, json.dumps(ctx.request.body).encode(), ctx.request_id)
    usage = answer.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    ctx.prompt_tokens = tokens if isinstance(tokens, int) else 0
    ctx.status, ctx.finished = 200, True
    ctx.ttft = perf_counter() - ctx.start
    await respond(ctx.send, 200, json.dumps(answer).encode(), b"application/json",
                  [(b"x-request-id", ctx.request_id.encode())])


async def post(state: RouterState, ctx: RequestContext, data: bytes, path: str, handoff_id: str) -> dict[str, Any]:
    """``data`` POSTed to ``path`` of the least-loaded healthy prefill server, or the one that
    prefilled the conversation's last turn (``Backends.choose_prefill``), once more on another
    when the first is unreachable; its JSON answer."""
    t0 = perf_counter()
    failed: Unreachable | None = None
    failed_backend = None
    with observe.span(state, ctx, "prefill", SpanKind.CLIENT) as span:
        trace = None
        if span is not None:
            span.set_attribute("pd.handoff_id", handoff_id)
            trace = Tracing.headers(span)  # vLLM parents its request span on it
        keys = ctx.keys
        for attempt in (0, 1):
            backend, affinity = state.backends.choose_prefill(ctx.model, failed_backend,
                                                              keys.prefixes if keys is not None else None)
            if keys is not None and not attempt:
                state.metrics.child(state.metrics.prefill_affinity, affinity).inc()
            if backend is None:
                if failed is not None:
                    raise failed
                raise NoHealthyBackend(f"no healthy prefill server for model {ctx.model!r}")
            if attempt:
                state.metrics.child(state.metrics.retries, "prefill_unreachable").inc()
            if span is not None:
                span.set_attributes({"pd.prefill.backend": backend.url, "pd.prefill.tries": attempt + 1})
            backend.sent()
            try:
                answer = await calls.post_json(state.connections, backend.target, path, data,
                                               ctx.request_id, state.settings.prefill_timeout, trace)
                if keys is not None:  # its prefix cache holds the conversation now
                    state.backends.prefill_affinity.record(keys.conversation, backend.url)
                break
            except Unreachable as err:
                state.upstream_failed("prefill", backend, err, mark_down=True)
                if attempt:
                    raise
                failed, failed_backend = err, backend
            except RouterError as err:  # a lost connection: the server is down until a probe says otherwise
                state.upstream_failed("prefill", backend, err,
                                      mark_down=isinstance(err, ConnectionLost))
                raise
            finally:
                backend.in_flight -= 1
    state.metrics.prefill_latency.observe(perf_counter() - t0)
    return answer


def read_handoff(
    state: RouterState, slot: Slot, answer: dict[str, Any], request: OpenAIRequest, handoff_id: str,
    span: Span | None = None,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` for decode, from the prefill answer."""
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise BadUpstream(
            "prefill answer carries no kv_transfer_params (is the KV connector configured?)"
        )
    if slot.backend.capabilities is None:
        return params  # plain vLLM decode: as prefill returned them
    try:
        result = HandoffResult.model_validate(params)
    except ValidationError as exc:
        raise BadUpstream(
            f"prefill returned invalid kv_transfer_params: {exc.errors()[0]['msg']} "
            f"at {'.'.join(map(str, exc.errors()[0]['loc']))}"
        ) from None
    if span is not None:
        span.set_attributes(_handoff_attributes(result))
    if result.status == "failed":
        if result.reason == "busy":  # no free KV receive slot: wait for one, not a client error
            raise Requeue("kv_receive_slot", f"KV handoff to {result.kv_endpoint} refused: {result.error}")
        if result.reason in ("cancelled", "duplicate"):  # the id is still known there: take a new one
            raise Requeue("stale_handoff_id", f"KV handoff id {handoff_id!r} refused by "
                                              f"{result.kv_endpoint}: {result.error}", busy=False)
        if result.reason == "too_long":
            raise PromptTooLong(
                f"the prompt ({result.num_prompt_tokens} tokens) does not fit the decode server: "
                f"{result.error}",
                param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
            )
        raise KVNotDelivered(f"KV handoff to {result.kv_endpoint} failed ({result.reason}): {result.error}")
    if result.handoff_id != handoff_id:
        raise BadUpstream(f"prefill returned handoff {result.handoff_id!r}, expected {handoff_id!r}")
    state.pool.served(slot.backend)
    ids = logprobs.prompt_token_ids(answer)  # there when the prefill leg asked (prefill_fields)
    if ids is not None:
        result = result.model_copy(update={"prompt_token_ids": ids})
    if request.wants_logprobs():
        choices = answer.get("choices")
        first = (
            choices[0].get("logprobs")
            if isinstance(choices, list) and choices and isinstance(choices[0], dict)
            else None
        )
        if isinstance(first, dict):
            result = result.model_copy(update={"prefill_logprobs": first})
    return result.model_dump()


def _handoff_attributes(result: HandoffResult) -> dict[str, str | int]:
    """What prefill said of the KV handoff, as span attributes."""
    attrs: dict[str, str | int] = {"pd.handoff.status": result.status, "pd.handoff.kv_endpoint": result.kv_endpoint,
                                   "pd.handoff.prompt_tokens": result.num_prompt_tokens}
    if result.reason is not None:
        attrs["pd.handoff.reason"] = result.reason
    if result.layers_early is not None:
        attrs["pd.handoff.layers_early"] = result.layers_early
    if result.layers_late is not None:
        attrs["pd.handoff.layers_late"] = result.layers_late
    return attrs
