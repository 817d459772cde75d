"""A request's attempts, each on one decode slot, until one ends: the stages after validation.

Per attempt (:class:`~pd_router.request.stages.Stage`, in order):

1. ``QUEUED``: the attempt's decode request (:class:`pd_router.request.legs.DecodeRequest`)
   takes a decode slot (:mod:`pd_router.slots`), at once or after a wait in the queues, FIFO
   across routers within the request's place (priority, fair share, arrival);
2. ``PREFILL``: the prefill with the KV handoff's target (:mod:`pd_router.request.prefill`), on
   the 200 of the decode request that holds the slot (:mod:`pd_router.request.legs`);
3. ``DECODE``: the decode server's answer relayed to the client (:mod:`pd_router.request.relay`);
   the slot given back.

What ends an attempt without ending the request (:class:`~pd_router.errors.AttemptEnded`): a
busy decode server or a stale handoff id (:class:`~pd_router.errors.Requeue`: the queues again,
bounded, within ``--queue-timeout``), a decode server failed before the first byte
(:class:`~pd_router.errors.DecodeLegFailed`: once, on another), and an answer whose decode
server was lost after it began (:class:`~pd_router.errors.DecodeLost`: ``MIGRATING``, the answer
goes on on another, :mod:`pd_router.request.migration`). docs/router.md, "Retries".

Whatever the way out, an attempt gives its slot back (:func:`_attempt`): at once after a clean
end or a refusal, else through :meth:`RouterState.abort`, which calls the decode server's cancel
endpoint first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from time import perf_counter
from typing import TYPE_CHECKING, Any

from pd_http.tracing import SpanKind, Tracing
from pd_router.errors import (
    BadUpstream,
    Conflict,
    DecodeLegFailed,
    DecodeLost,
    KVNotDelivered,
    Overloaded,
    Requeue,
    RouterError,
    UpstreamRejected,
    UpstreamTimeout,
)
from pd_router.metrics import priority_label
from pd_router.request import keys, legs, migration, observe, prefill, relay
from pd_router.request.context import Attempt, RequestContext, attempt_handoff_id
from pd_router.request.stages import Stage
from pd_router.request.trail import Trail
from pd_router.slots.pool import Slot, backoff

if TYPE_CHECKING:
    from pd_router.state import RouterState

log = logging.getLogger("pd_router.requests")
# retries of one request (each counted in pd_router_retries_total by reason; docs/router.md, "Retries"):
# a KV handoff id the decode server still knows is retried once under a new id; a busy decode
# server (its KV receive slot or its engine slot taken) sends the request back to the queues,
# where it waits for the next grant, this many times at most
MAX_STALE_RETRIES = 1
MAX_BUSY_RETRIES = 16


async def serve(state: RouterState, ctx: RequestContext) -> None:
    """The validated request (``ctx.request``) served by its attempts."""
    ctx.created, ctx.trail = int(time.time()), Trail()
    if ctx.keeps and any(d.owns_slots and d.serves(ctx.model) for d in state.backends.decode):
        ctx.keys = keys.conversation_keys(keys.secret(state.backends.decode_api_key), ctx.tenant.name, ctx.endpoint,
                                          ctx.model, ctx.request.body)
    try:
        await _attempts(state, ctx)
    except RouterError as err:
        if ctx.resume is None or ctx.lost_at is None or ctx.lost_error is None:
            raise
        # the move failed before the new server's first output: the answer ends as it would have
        state.metrics.child(state.metrics.migrations, ctx.resume_reason, "failed").inc()
        ctx.lost_at = None
        raise _said(ctx.lost_error, f"moving the answer to another decode server failed: {err.message}") from None


async def _attempts(state: RouterState, ctx: RequestContext) -> None:
    """The request's attempts until one ends: retries before the first byte (bounded, by
    reason), and the moves of an answer whose decode server was lost after it began."""
    t_start = perf_counter()
    number = busy = stale = 0
    failed_over = False
    if ctx.place is None:  # its place in the queues, kept by its retries and moves
        tenant = ctx.tenant
        ctx.place = state.pool.shares.place(ctx.priority, tenant.name, tenant.weight, ctx.start)
    while True:
        slot, handoff_id = await _queued(state, ctx, number, busy, t_start)
        try:
            await _attempt(state, ctx, number, slot, handoff_id)
            return
        except DecodeLost as lost:
            await _move(state, ctx, lost)
            t_start = perf_counter()  # the wait for a slot: from the loss
            number += 1
            busy = stale = 0
            failed_over = False
        except DecodeLegFailed as failed:
            state.upstream_failed("decode", slot.backend, failed.error, mark_down=True)
            if failed_over or not state.backends.decode_available(ctx.model):
                raise failed.error from None
            failed_over = True
            state.metrics.child(state.metrics.failovers, slot.backend.url, failed.error.type).inc()
            state.metrics.child(state.metrics.retries, failed.reason).inc()
            log.warning("request_id=%s attempt %d: decode server %s failed before the first byte (%s); "
                        "running the request again on another decode server", ctx.request_id, number,
                        slot.backend.url, failed.error.message)
            number += 1
        except Requeue as again:
            if again.busy:
                busy += 1
                state.metrics.child(state.metrics.busy_requeues, slot.backend.url, again.reason).inc()
                if busy > MAX_BUSY_RETRIES:
                    raise Overloaded(f"{again.message}; the decode servers were busy for {busy} attempts in a row "
                                     f"(at most {MAX_BUSY_RETRIES} retries)", retry_after=1) from None
            else:
                stale += 1
                if stale > MAX_STALE_RETRIES:  # refused again under a new id: the request itself repeats it
                    raise Conflict(f"{again.message}; refused again under a new handoff id, so not retried "
                                   "(the same X-Request-Id in flight through another router?)",
                                   param="X-Request-Id") from None
            state.metrics.child(state.metrics.retries, again.reason).inc()
            log.info("request_id=%s attempt %d: %s; waiting for a slot again", ctx.request_id, number,
                     again.message)
            number += 1
            if again.busy and slot.backend.owns_slots:  # a back-off, within the request's queue timeout
                # (a server the router counts keeps the slot taken for it instead: SlotPool.hold)
                left = state.settings.queue_timeout - (perf_counter() - t_start)
                await asyncio.sleep(max(0.0, min(backoff(busy), left)))


async def _queued(state: RouterState, ctx: RequestContext, number: int, busy: int,
                  t_start: float) -> tuple[Slot, str]:
    """:attr:`Stage.QUEUED`: the attempt's decode request holds its slot at a server of ours (its
    200: the slot is the request's), found free at once or after a wait in the queue; the slot
    and the attempt's handoff id."""
    ctx.stage = Stage.QUEUED
    t_queue = perf_counter()
    remaining = state.settings.queue_timeout - (t_queue - t_start)
    handoff_id = attempt_handoff_id(ctx.request_id, number)
    with observe.span(state, ctx, "queue") as span:
        decode = legs.DecodeRequest(state, ctx, handoff_id, Tracing.headers(span) if span is not None else None)
        try:
            slot = await state.pool.take(ctx.model, decode, timeout=remaining, first_try=number == 0,
                                         max_queued=ctx.tenant.max_queued)
            ctx.continues = decode.continued.get(slot.backend.url)
            if ctx.resume is not None and ctx.lost_at is not None:
                log.warning("request_id=%s: decode server %s lost after %d tokens (%s); the answer goes "
                            "on on %s", ctx.request_id, ctx.lost_from, len(ctx.resume.output_token_ids),
                            ctx.resume_reason, slot.backend.url)
        except Overloaded as err:
            if not busy:
                raise
            raise Overloaded(
                f"{err.message}; the decode servers were busy for {busy} earlier attempt(s) "
                "(their slots taken outside this router's count)",
                retry_after=err.retry_after,
            ) from None
        if span is not None:
            span.set_attributes({"pd.attempt": number, "pd.decode.backend": slot.backend.url})
    now = perf_counter()
    state.metrics.queue_wait.observe(now - t_queue)
    if ctx.slot_wait is None:
        ctx.slot_wait = now - ctx.start
        state.metrics.child(state.metrics.tenant_queue_wait, ctx.tenant.label,
                            priority_label(ctx.priority)).observe(ctx.slot_wait)
    return slot, handoff_id


async def _move(state: RouterState, ctx: RequestContext, lost: DecodeLost) -> None:
    """:attr:`Stage.MIGRATING`: prepare the attempt that resumes an answer whose decode server
    was lost (:mod:`pd_router.request.migration`); raises the loss, said why, when the answer
    cannot move."""
    metrics = state.metrics
    if ctx.resume is not None and ctx.lost_at is not None:  # lost again before the move's first output
        metrics.child(metrics.migrations, ctx.resume_reason, "failed").inc()
    why = migration.not_resumable(state, ctx)
    outcome = "not_resumable"
    if why is None and ctx.migrations >= state.settings.max_migrations:
        why, outcome = f"it moved {ctx.migrations} times already (--max-migrations)", "limit"
    if why is not None:
        metrics.child(metrics.migrations, lost.reason, outcome).inc()
        ctx.lost_at = None
        log.warning("request_id=%s: decode server %s lost mid-answer (%s): %s; not moved: %s", ctx.request_id,
                    lost.server, lost.reason, lost.error.message, why)
        raise _said(lost.error, f"the answer was not moved to another decode server: {why}") from None
    ctx.lost_at = perf_counter()
    ctx.migrations += 1
    ctx.lost_from, ctx.lost_error, ctx.resume_reason = lost.server, lost.error, lost.reason
    ctx.stage = Stage.MIGRATING
    try:
        with observe.span(state, ctx, "migration") as span:
            if span is not None:
                span.set_attributes({"pd.migration.from": lost.server, "pd.migration.reason": lost.reason,
                                     "pd.migration.count": ctx.migrations})
            if ctx.prompt_ids is None:
                ctx.prompt_ids = await migration.prompt_ids(state, ctx)
            ctx.resume = migration.resume_from(ctx)
            if span is not None:
                span.set_attribute("pd.migration.output_tokens", len(ctx.resume.output_token_ids))
    except RouterError as err:
        metrics.child(metrics.migrations, lost.reason, "failed").inc()
        ctx.lost_at = None
        raise _said(lost.error, f"moving the answer to another decode server failed: {err.message}") from None


async def _attempt(state: RouterState, ctx: RequestContext, number: int, slot: Slot, handoff_id: str) -> None:
    """:attr:`Stage.PREFILL` and :attr:`Stage.DECODE` on one slot: at a server of ours, the
    prefill on the slot its decode request holds (the first token with the KV,
    :func:`pd_router.request.legs.prefill_and_decode`, or the result posted); at a server the
    router counts, the prefill, then the decode request. Always gives the slot back: at once
    after a clean end or a 4xx answer (prefill refused before computing anything; decode refused
    after giving its slot and the KV back), held back when a counted server was busy, else
    after a cancel on the decode server (it may still hold the KV or the generation)."""
    outcome = "aborted"
    caps = slot.backend.capabilities
    request = ctx.request
    extra = request.prefill_fields(caps)
    attempt = Attempt(number, handoff_id, slot, {**request.body, **extra} if extra else request.body,
                      with_kv=ctx.resume is not None or request.with_kv(caps))
    try:
        ctx.stage = Stage.PREFILL
        kv_params: dict[str, Any] | None = None
        if not attempt.with_kv:  # the prefill's answer first: for a server the router counts, or to post it
            kv_params = await prefill.handoff(state, ctx, attempt)
            ctx.stage = Stage.DECODE
        with observe.span(state, ctx, "decode", SpanKind.CLIENT) as span:
            trace = None
            if span is not None:
                span.set_attributes({"pd.decode.backend": slot.backend.url, "pd.handoff_id": handoff_id,
                                     "pd.stream": request.parsed.stream})
                trace = Tracing.headers(span)
            if kv_params is None:
                clean = await legs.prefill_and_decode(state, ctx, attempt)
            elif slot.opened is None:  # a server the router counts: the decode request now
                clean = await relay.decode(state, ctx, attempt, kv_params, trace)
            else:
                clean = await legs.post_and_relay(state, ctx, attempt, kv_params)
        if clean:
            outcome = "clean"
            _kept(ctx, slot)
    except Requeue as again:
        outcome = "busy" if again.busy else "aborted"
        raise
    except UpstreamRejected:  # never a decode 429: that one became a Requeue
        outcome = "answered"
        raise
    except KVNotDelivered as err:
        raise DecodeLegFailed(err) from None
    except RouterError as err:
        if ctx.stage == Stage.DECODE and not ctx.started:
            if not isinstance(err, UpstreamTimeout):
                raise DecodeLegFailed(err) from None
            state.upstream_failed("decode", slot.backend, err)  # slow, not down
        raise
    finally:
        # a clean end freed the slot there (the generation ended); a refusal came after the
        # server gave its slot and the KV back
        if outcome in ("clean", "answered"):
            state.pool.release(slot)
        else:
            state.abort(slot, ctx.request_id, handoff_id, busy=outcome == "busy")


def _kept(ctx: RequestContext, slot: Slot) -> None:
    """A clean end of an answer whose claim asked to keep its KV: its server keeps it now, as
    the conversation key, in place of the kept key it continued (until a probe says otherwise)."""
    caps = slot.backend.capabilities
    if ctx.keys is not None and caps is not None:
        slot.backend.kept.record(ctx.keys.conversation, ctx.continues, perf_counter(), caps.slots)


def _said(err: RouterError, why: str) -> RouterError:
    """``err`` (a decode server's loss, of its kind: a timeout stays a 504) with ``why`` added."""
    try:
        return type(err)(f"{err.message}; {why}")
    except TypeError:  # a kind whose constructor takes more than the message
        return BadUpstream(f"{err.message}; {why}")
