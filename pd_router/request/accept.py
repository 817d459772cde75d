"""The completion routes as one raw ASGI handler: the router's hot path.

Per request: validate -> a decode slot, held by the request's decode request (FIFO across
routers, :mod:`pd_router.slots.pool`) -> prefill on its 200 (least-loaded healthy server, one retry
on connection failure) -> the decode answer relayed (bytes unchanged) -> the slot given back.
When the decode server turns out busy (prefill's KV refused as ``busy``, or decode 429 from a
server the router counts), the request waits for a slot again and runs prefill again, a
bounded number of times within its ``--queue-timeout`` (:class:`Requeue`, docs/router.md,
"Retries").

One abort path: a watcher task waits for the client's ``http.disconnect`` and cancels
the request's task wherever it is (queued, in prefill, in decode). Whatever the way
out, the ``finally`` of :meth:`CompletionHandler._attempt` either gives the slot back
(clean end, a refusal) or hands it to :meth:`RouterState.abort`, which calls the decode
server's cancel endpoint and then gives the slot back.

The rooms around it: the request's context (:mod:`pd_router.request.context`), its observation
(:mod:`pd_router.request.observe`: trace, access log, metrics), the prefill leg
(:mod:`pd_router.request.prefill`), the decode leg's relay (:mod:`pd_router.request.relay`), ``n > 1``
(:mod:`pd_router.request.fanout`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from time import perf_counter
from typing import TYPE_CHECKING, Any, Literal

from pd_grammar.spec import GrammarSpec, asks_for_grammar
from pd_http.chunk_writer import chunk_writer
from pd_http.tracing import SpanKind, Tracing
from pd_router.apis import messages as anthropic_api
from pd_router.apis import messages_out as anthropic_out
from pd_router.apis import responses as responses_api
from pd_router.apis import responses_out
from pd_router.apis.completions import parse_request, structured_output
from pd_router.asgi import Receive, Scope, Send, authorization, header, read_body
from pd_router.errors import (
    BadUpstream,
    Conflict,
    InvalidRequest,
    ModelNotFound,
    NoHealthyBackend,
    Overloaded,
    RouterError,
    ShuttingDown,
    UpstreamRejected,
    UpstreamTimeout,
)
from pd_router.metrics import priority_label
from pd_router.request import checks as decode_check
from pd_router.request import fanout, migration, observe, relay
from pd_router.request import legs as overlap
from pd_router.request import prefill as prefill_leg
from pd_router.request.context import DecodeLegFailed, DecodeLost, RequestContext, attempt_handoff_id
from pd_router.request.legs import ClaimFirst
from pd_router.request.prefill import KVNotDelivered
from pd_router.request.trail import Trail
from pd_router.slots.pool import Requeue, Slot, backoff
from pd_wire.requests import Endpoint, OpenAIRequest

if TYPE_CHECKING:
    from pd_router.state import RouterState

log = logging.getLogger("pd_router.requests")
Api = Literal["openai", "responses", "messages"]  # the API a request came in: all served as chat or completions
# retries of one request (each counted in pd_router_retries_total by reason; docs/router.md, "Retries"):
# a KV handoff id the decode server still knows is retried once under a new id; a busy decode
# server (its KV receive slot or its engine slot taken) sends the request back to the queues,
# where it waits for the next grant, this many times at most
MAX_STALE_RETRIES = 1
MAX_BUSY_RETRIES = 16
_REQUEST_ID = re.compile(rb"[\x21-\x7e]+")  # visible ASCII: it goes into headers and the KV handoff id


class CompletionHandler:
    def __init__(self, state: RouterState) -> None:
        self.state = state

    def _check_request(self, scope: Scope, rid_raw: bytes | None, ctx: RequestContext) -> None:
        """Before anything else: the API key and the tenant (:mod:`pd_router.tenants`: so that
        which ids are in flight does not leak to a caller without a key), then the drain, then
        the id."""
        tenants = self.state.tenants
        ctx.tenant = tenants.tenant(authorization(scope),
                                    header(scope, tenants.header) if tenants.header is not None else None)
        if self.state.draining:
            raise ShuttingDown("the router is shutting down; retry (another router replica)", retry_after=1)
        if rid_raw is not None and not _REQUEST_ID.fullmatch(rid_raw):
            raise InvalidRequest("X-Request-Id must be visible ASCII characters (0x21-0x7e)", param="X-Request-Id")

    async def __call__(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint,
                       api: Api = "openai") -> None:
        """``api``: ``responses``, a ``/v1/responses`` request (:mod:`responses_api`), or
        ``messages``, an Anthropic ``/v1/messages`` request (:mod:`anthropic_api`), served as
        a chat completion."""
        rid_raw = header(scope, b"x-request-id")
        rid = rid_raw.decode("latin-1")[:256] if rid_raw else uuid.uuid4().hex
        anthropic = anthropic_out.Translator(send) if api == "messages" else None
        ctx = RequestContext(endpoint, rid, perf_counter(), send if anthropic is None else anthropic.send)
        state = self.state
        observe.begin(state, ctx, scope)
        me = asyncio.current_task()
        watcher: asyncio.Task[None] | None = None
        in_flight = state.request_ids
        owned = False
        if me is not None:
            state.live[me] = lambda: self._cut_off(ctx, me)
        try:
            self._check_request(scope, rid_raw, ctx)
            if rid in in_flight:  # the id names the KV handoff on the decode server: it must be unique
                raise InvalidRequest(f"X-Request-Id {rid!r} is already in flight", param="X-Request-Id")
            in_flight.add(rid)
            owned = True
            raw = await read_body(scope, receive, state.settings.max_body_bytes, state.settings.body_timeout)
            if api == "responses":
                as_responses = responses_api.parse(raw)
                raw = json.dumps(as_responses.chat_body()).encode()
                ctx.send = responses_out.Translator(send, as_responses).send
            elif anthropic is not None:
                as_messages = anthropic_api.parse_messages(raw)
                raw = json.dumps(as_messages.chat_body()).encode()
                anthropic.stream = bool(as_messages.stream)
            else:
                ctx.writer = chunk_writer(scope)
            body, request = parse_request(endpoint, raw)
            ctx.raw = raw
            self._check_priority(ctx, request)
            watcher = asyncio.get_running_loop().create_task(self._watch(receive, ctx, me))
            legs = fanout.legs(state, endpoint, body, request.model or "")
            if legs is not None:
                await fanout.serve(state, ctx, body, request, legs, self._serve)
            else:
                await self._serve(ctx, body, request)
        except RouterError as err:
            await ctx.fail(err)
        except ConnectionResetError:
            ctx.disconnected = True
        except Exception:  # a bug: answer in OpenAI shape, details only in the log
            log.exception("request_id=%s failed", rid)
            await ctx.fail(RouterError(f"internal router error (request_id={rid}); see the router log"))
        except asyncio.CancelledError:
            if me is None or not (ctx.disconnected or ctx.cut_off):
                raise
            me.uncancel()
            if ctx.cut_off and not ctx.disconnected and not ctx.finished:
                drain = state.settings.drain_timeout
                await ctx.fail(ShuttingDown(f"the router shut down before this request finished "
                                            f"(--drain-timeout {drain:g}s)"))
        finally:
            if watcher is not None:
                watcher.cancel()
            if owned:
                in_flight.discard(rid)
            if me is not None:
                state.request_ended(me)
            observe.finish(state, ctx)

    @staticmethod
    def _check_priority(ctx: RequestContext, request: OpenAIRequest) -> None:
        """The request's ``priority`` (vLLM's field) orders its wait for a decode slot here (and is
        forwarded: a vLLM prefill server running ``--scheduling-policy priority`` orders its
        prefills by it, one running first-come-first-served ignores it)."""
        floor = ctx.tenant.min_priority
        if request.priority < floor:
            raise InvalidRequest(f"priority {request.priority} is below {floor}, the lowest this request may ask "
                                 "for (lower is served sooner; --min-priority, or its key's min_priority)",
                                 param="priority")
        ctx.priority = request.priority

    @staticmethod
    def _cut_off(ctx: RequestContext, task: asyncio.Task[Any]) -> None:
        """The drain's deadline passed: end the request (an error event if it streams)."""
        if not ctx.finished and not ctx.cut_off:
            ctx.cut_off = True
            task.cancel()

    @staticmethod
    async def _watch(receive: Receive, ctx: RequestContext, task: asyncio.Task[Any] | None) -> None:
        message = await receive()
        if message["type"] == "http.disconnect" and not ctx.finished and task is not None:
            ctx.disconnected = True
            task.cancel()

    async def _serve(self, ctx: RequestContext, body: dict[str, Any], request: OpenAIRequest) -> None:
        state = self.state
        grammar = None
        if asks_for_grammar(body):  # off the loop: checking a large schema takes a while
            grammar = await asyncio.to_thread(structured_output, ctx.endpoint, body, state.schema_limits)
        served = state.backends.prefill_models()
        if not served:
            raise NoHealthyBackend("no healthy prefill server")
        model = request.model or ""  # parse_request requires it
        if model not in served:
            raise ModelNotFound(
                f"model {model!r} does not exist; served: {sorted(served)}",
                param="model",
                code="model_not_found",
            )
        ctx.model = model
        if decode_check.served_by_prefill(ctx.endpoint, body):
            await prefill_leg.prefill_alone(state, ctx, body, model)
            return
        decode_check.check_decode_view(ctx.endpoint, body, request)
        decode_check.check_context(request, (b.capabilities for b in state.backends.decode if b.serves(model)))
        ctx.created, ctx.trail = int(time.time()), Trail()
        try:
            await self._attempts(ctx, body, request, model, grammar)
        except RouterError as err:
            if ctx.resume is None or ctx.lost_at is None or ctx.lost_error is None:
                raise
            # the move failed before the new server's first output: the answer ends as it would have
            state.metrics.child(state.metrics.migrations, ctx.resume_reason, "failed").inc()
            ctx.lost_at = None
            raise _said(ctx.lost_error, f"moving the answer to another decode server failed: {err.message}") from None

    async def _attempts(self, ctx: RequestContext, body: dict[str, Any], request: OpenAIRequest, model: str,
                        grammar: GrammarSpec | None) -> None:
        """The request's attempts until one ends: retries before the first byte (bounded, by
        reason), and the moves of an answer whose decode server was lost after it began."""
        state = self.state
        t_start = perf_counter()
        attempt = busy = stale = 0
        failed_over = False
        if ctx.place is None:  # its place in the queues, kept by its retries and moves
            tenant = ctx.tenant
            ctx.place = state.pool.shares.place(ctx.priority, tenant.name, tenant.weight, ctx.start)
        while True:
            ctx.stage = "queued"
            t_queue = perf_counter()
            remaining = state.settings.queue_timeout - (t_queue - t_start)
            handoff_id = attempt_handoff_id(ctx.request_id, attempt)
            with observe.span(state, ctx, "queue") as span:
                # the request's decode request holds its slot at a server of ours (its 200: the
                # slot is the request's), found free at once or after a wait in the queue
                decode = ClaimFirst(state, ctx, body, request, handoff_id,
                                    Tracing.headers(span) if span is not None else None)
                try:
                    slot = await state.pool.take(model, decode, timeout=remaining, first_try=attempt == 0,
                                                 max_queued=ctx.tenant.max_queued)
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
                    span.set_attributes({"pd.attempt": attempt, "pd.decode.backend": slot.backend.url})
            now = perf_counter()
            state.metrics.queue_wait.observe(now - t_queue)
            if ctx.slot_wait is None:
                ctx.slot_wait = now - ctx.start
                state.metrics.child(state.metrics.tenant_queue_wait, ctx.tenant.label,
                                    priority_label(ctx.priority)).observe(ctx.slot_wait)
            try:
                await self._attempt(ctx, slot, body, request, handoff_id)
                return
            except DecodeLost as lost:
                await self._move(ctx, body, request, grammar, lost)
                t_start = perf_counter()  # the wait for a slot: from the loss
                attempt += 1
                busy = stale = 0
                failed_over = False
            except DecodeLegFailed as failed:
                state.upstream_failed("decode", slot.backend, failed.error, mark_down=True)
                if failed_over or not state.backends.decode_available(model):
                    raise failed.error from None
                failed_over = True
                state.metrics.child(state.metrics.failovers, slot.backend.url, failed.error.type).inc()
                state.metrics.child(state.metrics.retries, "failover").inc()
                log.warning("request_id=%s attempt %d: decode server %s failed before the first byte (%s); "
                            "running the request again on another decode server", ctx.request_id, attempt,
                            slot.backend.url, failed.error.message)
                attempt += 1
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
                log.info("request_id=%s attempt %d: %s; waiting for a slot again", ctx.request_id, attempt,
                         again.message)
                attempt += 1
                if again.busy and slot.backend.owns_slots:  # a back-off, within the request's queue timeout
                    # (a server the router counts keeps the slot taken for it instead: SlotPool.hold)
                    left = state.settings.queue_timeout - (perf_counter() - t_start)
                    await asyncio.sleep(max(0.0, min(backoff(busy), left)))

    async def _move(self, ctx: RequestContext, body: dict[str, Any], request: OpenAIRequest,
                    grammar: GrammarSpec | None, lost: DecodeLost) -> None:
        """Prepare the attempt that resumes an answer whose decode server was lost
        (:mod:`pd_router.request.migration`); raises the loss, said why, when the answer cannot move."""
        state = self.state
        metrics = state.metrics
        if ctx.resume is not None and ctx.lost_at is not None:  # lost again before the move's first output
            metrics.child(metrics.migrations, ctx.resume_reason, "failed").inc()
        why = migration.not_resumable(state, ctx, request, grammar)
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
        ctx.stage = "migrating"
        try:
            with observe.span(state, ctx, "migration") as span:
                if span is not None:
                    span.set_attributes({"pd.migration.from": lost.server, "pd.migration.reason": lost.reason,
                                         "pd.migration.count": ctx.migrations})
                if ctx.prompt_ids is None:
                    ctx.prompt_ids = await migration.prompt_ids(state, ctx, body)
                ctx.resume = migration.resume_from(ctx)
                if span is not None:
                    span.set_attribute("pd.migration.output_tokens", len(ctx.resume.output_token_ids))
        except RouterError as err:
            metrics.child(metrics.migrations, lost.reason, "failed").inc()
            ctx.lost_at = None
            raise _said(lost.error, f"moving the answer to another decode server failed: {err.message}") from None

    async def _attempt(
        self, ctx: RequestContext, slot: Slot, body: dict[str, Any], request: OpenAIRequest, handoff_id: str,
    ) -> None:
        """Prefill and decode on one slot: at a server of ours, the prefill on the slot its decode
        request holds (the first token with the KV, :mod:`pd_router.request.legs`, or the result
        posted); at a server the router counts, the prefill, then the decode request. Always
        gives the slot back: at once after a clean end or a 4xx answer (prefill refused before
        computing anything; decode refused after giving its slot and the KV back), held back
        when a counted server was busy, else after a cancel on the decode server (it may still
        hold the KV or the generation)."""
        state = self.state
        outcome = "aborted"
        caps = slot.backend.capabilities
        extra = decode_check.prefill_fields(request, caps)
        if extra:
            body = {**body, **extra}
        try:
            ctx.stage = "prefill"
            with_kv = ctx.resume is not None or decode_check.result_with_kv(body, request, caps)
            kv_params: dict[str, Any] | None = None
            if not with_kv:  # the prefill's answer first: for a server the router counts, or to post it
                kv_params = await prefill_leg.prefill(state, ctx, slot, body, request, handoff_id)
                ctx.stage = "decode"
            with observe.span(state, ctx, "decode", SpanKind.CLIENT) as span:
                trace = None
                if span is not None:
                    span.set_attributes({"pd.decode.backend": slot.backend.url, "pd.handoff_id": handoff_id,
                                         "pd.stream": request.stream})
                    trace = Tracing.headers(span)
                if kv_params is None:
                    clean = await overlap.prefill_and_decode(state, ctx, slot, body, request, handoff_id)
                elif slot.opened is None:  # a server the router counts: the decode request now
                    clean = await relay.decode(state, ctx, slot, body, request, kv_params, trace)
                else:
                    clean = await overlap.post_and_relay(state, ctx, slot, body, request, kv_params)
            if clean:
                outcome = "clean"
        except Requeue as again:
            outcome = "busy" if again.busy else "aborted"
            raise
        except UpstreamRejected:  # never a decode 429: that one became a Requeue
            outcome = "answered"
            raise
        except KVNotDelivered as err:
            raise DecodeLegFailed(err) from None
        except RouterError as err:
            if ctx.stage == "decode" and not ctx.started:
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


def _said(err: RouterError, why: str) -> RouterError:
    """``err`` (a decode server's loss, of its kind: a timeout stays a 504) with ``why`` added."""
    try:
        return type(err)(f"{err.message}; {why}")
    except TypeError:  # a kind whose constructor takes more than the message
        return BadUpstream(f"{err.message}; {why}")
