"""The completion routes as one raw ASGI handler: the router's hot path.

Per request: validate -> lease a decode slot from the decode server (FIFO across routers,
:mod:`pd_router.slots`) -> prefill (least-loaded healthy server, one retry on connection
failure) -> decode (relay bytes unchanged) -> release. When the decode server turns out
busy (prefill's KV refused as ``busy``, or decode 429: a lease that ran out, or a server
without leases counted free here), the request waits for a slot again and runs prefill
again, within its ``--queue-timeout`` (:class:`Requeue`).

One abort path: a watcher task waits for the client's ``http.disconnect`` and cancels
the request's task wherever it is (queued, in prefill, in decode). Whatever the way
out, the ``finally`` of :meth:`CompletionHandler._serve` either releases the lease
(clean end) or hands it to :meth:`RouterState.abort`, which calls the decode server's
cancel endpoint and then releases the slot.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import uuid
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from connector.protocol import HandoffResult, HandoffTarget
from pd_grammar.spec import GrammarSpec, asks_for_grammar
from pd_http.chunk_writer import ChunkWriter, chunk_writer
from pd_http.logs import bind_request
from pd_http.tracing import Span, SpanKind, Tracing, fail, span_ids
from pd_router import decode_check, fanout, responses_api, upstream
from pd_router.api import (
    VLLM_REMOTE_DECODE_PARAMS,
    ChatCompletionRequest,
    Endpoint,
    OpenAIRequest,
    decode_body,
    parse_request,
    prefill_body,
    structured_output,
)
from pd_router.asgi import SSE, Receive, Scope, Send, header, read_body, respond
from pd_router.backends import DecodeBackend
from pd_router.errors import (
    BadUpstream,
    InvalidRequest,
    ModelNotFound,
    NoHealthyBackend,
    Overloaded,
    PromptTooLong,
    RouterError,
    ShuttingDown,
    Unauthorized,
    UpstreamRejected,
    UpstreamTimeout,
)
from pd_router.rawhttp import Response, UpstreamError
from pd_router.slots import Lease, Requeue

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from pd_router.metrics import TokenHistogram
    from pd_router.state import RouterState

log = logging.getLogger("pd_router.requests")
_DONE = b"data: [DONE]"
_REQUEST_ID = re.compile(rb"[\x21-\x7e]+")  # visible ASCII: it goes into headers and the KV handoff id
_NO_SPAN: AbstractContextManager[None] = nullcontext()  # tracing off: no span object at all


class HandoffFailed(BadUpstream):
    """Prefill ran but its KV did not reach the decode server (unreachable, rejected,
    transfer failed): a failure of the decode leg, before anything reached the client."""


class DecodeLegFailed(Exception):
    """The decode server failed before any byte reached the client (connection refused, 5xx,
    KV handoff failed, the connection lost before its first chunk): the request may run
    again on another decode server (:meth:`CompletionHandler._serve`, once)."""

    def __init__(self, error: RouterError) -> None:
        super().__init__(error.message)
        self.error = error


def attempt_handoff_id(request_id: str, attempt: int) -> str:
    """The KV handoff id of a request's ``attempt``-th prefill: the request id, then a new
    id per retry, so that a retry's handoff is never confused with (or cancelled as) an
    earlier one's on the decode server."""
    return request_id if attempt == 0 else f"{request_id[:240]}#{attempt}"


@dataclass(eq=False)
class _Ctx:
    endpoint: Endpoint
    request_id: str
    start: float
    send: Send
    stage: str = "validating"
    model: str = ""  # the model_name label: set once the model is known to be served
    prompt_tokens: int = 0  # as prefill counted them (our connector's handoff)
    ttft: float | None = None  # seconds from ``start`` to the first token relayed (the whole answer unstreamed)
    leased: float | None = None  # seconds from ``start`` to its first decode slot lease (the end of its queue wait)
    status: int = 0
    error_type: str = ""
    started: bool = False  # response headers sent
    finished: bool = False  # last byte sent (or being sent)
    disconnected: bool = False
    cut_off: bool = False  # ended by the router's drain (--drain-timeout passed)
    raw: bytes = b""  # the client's body as received
    writer: ChunkWriter | None = None  # writes the streamed answer's chunks to the client (None: ``send`` does)
    prompt_logprobs: Any = None  # prefill's, for a client that asked (merged into the decode answer)
    span: Span | None = None  # the request's root span (tracing on)
    trace: Context | None = None  # its context: the parent of the stage spans

    async def fail(self, err: RouterError) -> None:
        self.status, self.error_type = err.status, err.type
        if self.started:  # the stream began: end it with an error event
            self.finished = True
            await self.send({"type": "http.response.body", "body": err.sse_event(), "more_body": False})
            return
        self.finished = True
        ctype = getattr(err, "content_type", b"application/json")
        await respond(
            self.send,
            err.status,
            err.body(),
            ctype,
            [(b"x-request-id", self.request_id.encode()), *err.headers()],
        )


class CompletionHandler:
    def __init__(self, state: RouterState) -> None:
        self.state = state
        self._api_key = f"Bearer {state.settings.api_key}".encode() if state.settings.api_key else None

    def _check_request(self, scope: Scope, rid_raw: bytes | None) -> None:
        """Before anything else: the API key (constant time, so that neither its value nor
        which ids are in flight leak to a caller without it), then the drain, then the id."""
        if self._api_key is not None and not hmac.compare_digest(
            header(scope, b"authorization") or b"", self._api_key
        ):
            raise Unauthorized("invalid or missing API key (Authorization: Bearer KEY)")
        if self.state.draining:
            raise ShuttingDown("the router is shutting down; retry (another router replica)", retry_after=1)
        if rid_raw is not None and not _REQUEST_ID.fullmatch(rid_raw):
            raise InvalidRequest("X-Request-Id must be visible ASCII characters (0x21-0x7e)", param="X-Request-Id")

    async def __call__(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint,
                       responses: bool = False) -> None:
        """``responses``: a ``/v1/responses`` request, served as a chat completion (:mod:`responses_api`)."""
        rid_raw = header(scope, b"x-request-id")
        rid = rid_raw.decode("latin-1")[:256] if rid_raw else uuid.uuid4().hex
        ctx = _Ctx(endpoint, rid, perf_counter(), send)
        state = self.state
        if state.tracing is None:
            bind_request(rid)
        else:
            self._start_trace(state.tracing, ctx, scope)
        metrics = state.metrics
        metrics.in_flight.inc()
        me = asyncio.current_task()
        watcher: asyncio.Task[None] | None = None
        in_flight = state.request_ids
        owned = False
        if me is not None:
            state.live[me] = lambda: self._cut_off(ctx, me)
        try:
            self._check_request(scope, rid_raw)
            if rid in in_flight:  # the id names the KV handoff on the decode server: it must be unique
                raise InvalidRequest(f"X-Request-Id {rid!r} is already in flight", param="X-Request-Id")
            in_flight.add(rid)
            owned = True
            raw = await read_body(scope, receive, state.settings.max_body_bytes, state.settings.body_timeout)
            if responses:
                as_responses = responses_api.parse(raw)
                raw = json.dumps(as_responses.chat_body()).encode()
                ctx.send = responses_api.Translator(send, as_responses).send
            else:
                ctx.writer = chunk_writer(scope)
            body, request = parse_request(endpoint, raw)
            ctx.raw = raw
            watcher = asyncio.get_running_loop().create_task(self._watch(receive, ctx, me))
            n = fanout.choices_wanted(body)
            if n > 1:
                await fanout.serve(self, ctx, body, request, n)
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
            metrics.in_flight.dec()
            if ctx.disconnected:
                ctx.status, ctx.error_type = 499, "client_disconnected"
                metrics.child(metrics.client_aborts, ctx.stage).inc()
            metrics.child(metrics.requests, endpoint.label, ctx.model, str(ctx.status), ctx.error_type).inc()
            latency = perf_counter() - ctx.start
            metrics.child(metrics.e2e, endpoint.label, ctx.model).observe(latency)
            if ctx.prompt_tokens:
                metrics.child(metrics.prompt_tokens, endpoint.label, ctx.model).inc(ctx.prompt_tokens)
            if ctx.span is not None:
                self._end_trace(ctx)
            ttft_ms = None if ctx.ttft is None else round(ctx.ttft * 1e3, 3)
            leased_ms = None if ctx.leased is None else round(ctx.leased * 1e3, 3)
            log.info(
                "request_id=%s %s status=%d%s stage=%s %.1fms%s%s",
                rid,
                endpoint.value,
                ctx.status,
                f" error={ctx.error_type}" if ctx.error_type else "",
                ctx.stage,
                latency * 1e3,
                "" if leased_ms is None else f" leased={leased_ms:.1f}ms",
                "" if ttft_ms is None else f" ttft={ttft_ms:.1f}ms",
                extra={"fields": {"event": "access", "endpoint": endpoint.value, "status": ctx.status,
                                  "error_type": ctx.error_type or None, "stage": ctx.stage,
                                  "latency_ms": round(latency * 1e3, 3), "leased_ms": leased_ms,
                                  "ttft_ms": ttft_ms}},
            )

    @staticmethod
    def _start_trace(tracing: Tracing, ctx: _Ctx, scope: Scope) -> None:
        """The request's root span, continuing the client's trace when it sent a ``traceparent``."""
        span = tracing.start(f"POST {ctx.endpoint.value}", tracing.extract(scope["headers"]), SpanKind.SERVER,
                             {"http.request.method": "POST", "url.path": ctx.endpoint.value,
                              "pd.request_id": ctx.request_id})
        ctx.span, ctx.trace = span, tracing.context(span)
        bind_request(ctx.request_id, span_ids(span)[0])

    @staticmethod
    def _end_trace(ctx: _Ctx) -> None:
        span = ctx.span
        assert span is not None
        span.set_attributes({"http.response.status_code": ctx.status, "pd.stage": ctx.stage})
        if ctx.error_type:
            span.set_attribute("error.type", ctx.error_type)
        if ctx.status >= 500 or ctx.status == 0:
            fail(span, RuntimeError(ctx.error_type or "no answer"), ctx.error_type or None)
        span.end()

    def _span(self, ctx: _Ctx, name: str, kind: SpanKind = SpanKind.INTERNAL) -> AbstractContextManager[Span | None]:
        """A stage's span under the request's root span; with tracing off a shared no-op."""
        tracing = self.state.tracing
        if tracing is None or ctx.trace is None:
            return _NO_SPAN
        return tracing.span(name, ctx.trace, kind)

    @staticmethod
    def _cut_off(ctx: _Ctx, task: asyncio.Task[Any]) -> None:
        """The drain's deadline passed: end the request (an error event if it streams)."""
        if not ctx.finished and not ctx.cut_off:
            ctx.cut_off = True
            task.cancel()

    @staticmethod
    async def _watch(receive: Receive, ctx: _Ctx, task: asyncio.Task[Any] | None) -> None:
        message = await receive()
        if message["type"] == "http.disconnect" and not ctx.finished and task is not None:
            ctx.disconnected = True
            task.cancel()

    async def _serve(self, ctx: _Ctx, body: dict[str, Any], request: OpenAIRequest) -> None:
        state = self.state
        grammar = None
        if asks_for_grammar(body):  # off the loop: compiling a large schema takes a while
            grammar = await asyncio.to_thread(structured_output, ctx.endpoint, body, state.schema_limits)
        served = state.backends.prefill_models()
        if not served:
            raise NoHealthyBackend("no healthy prefill server")
        if request.model not in served:
            raise ModelNotFound(
                f"model {request.model!r} does not exist; served: {sorted(served)}",
                param="model",
                code="model_not_found",
            )
        ctx.model = request.model
        if decode_check.served_by_prefill(ctx.endpoint, body):
            await self._prefill_alone(ctx, body, request.model)
            return
        decode_view = decode_check.parse_decode_view(ctx.endpoint, body)
        t_start = perf_counter()
        attempt = busy = 0
        failed_over = False
        while True:
            ctx.stage = "queued"
            t_queue = perf_counter()
            remaining = state.settings.queue_timeout - (t_queue - t_start)
            with self._span(ctx, "queue") as span:
                try:
                    lease = await state.pool.lease(request.model, timeout=remaining, requeue=attempt > 0,
                                                   lease_id=attempt_handoff_id(ctx.request_id, attempt),
                                                   arrived=ctx.start)
                except Overloaded as err:
                    if not busy:
                        raise
                    raise Overloaded(
                        f"{err.message}; the decode servers were busy for {busy} earlier attempt(s) "
                        "(their slots taken outside this router's count)",
                        retry_after=err.retry_after,
                    ) from None
                if span is not None:
                    span.set_attributes({"pd.attempt": attempt, "pd.decode.backend": lease.backend.url})
            now = perf_counter()
            state.metrics.queue_wait.observe(now - t_queue)
            if ctx.leased is None:
                ctx.leased = now - ctx.start
            refused = decode_check.refusal(decode_view, lease.backend.capabilities)
            if refused is not None:  # what this decode server would refuse costs no prefill
                state.pool.release(lease)
                raise refused
            extra = decode_check.prefill_fields(decode_view, lease.backend.capabilities)
            try:
                await self._attempt(ctx, lease, {**body, **extra} if extra else body, request,
                                    attempt_handoff_id(ctx.request_id, attempt), grammar)
                return
            except DecodeLegFailed as failed:
                state.upstream_failed("decode", lease.backend, failed.error, mark_down=True)
                if failed_over or not state.backends.decode_available(request.model):
                    raise failed.error from None
                failed_over = True
                state.metrics.child(state.metrics.failovers, lease.backend.url, failed.error.type).inc()
                log.warning("request_id=%s attempt %d: decode server %s failed before the first byte (%s); "
                            "running the request again on another decode server", ctx.request_id, attempt,
                            lease.backend.url, failed.error.message)
                attempt += 1
            except Requeue as again:
                if again.busy:
                    busy += 1
                    state.metrics.child(state.metrics.busy_requeues, lease.backend.url, again.reason).inc()
                log.info("request_id=%s attempt %d: %s; waiting for a slot again", ctx.request_id, attempt,
                         again.message)
                attempt += 1

    async def _attempt(
        self, ctx: _Ctx, lease: Lease, body: dict[str, Any], request: OpenAIRequest, handoff_id: str,
        grammar: GrammarSpec | None = None,
    ) -> None:
        """Prefill and decode on one lease; always gives the lease back: at once after a clean
        end or a 4xx answer (prefill refused before computing anything; decode refused after
        giving its slot and the KV back), held back when the decode server was busy, else
        after a cancel on the decode server (it may still hold the KV or the generation)."""
        state = self.state
        outcome = "aborted"
        try:
            ctx.stage = "prefill"
            kv_params = await self._prefill(ctx, lease, body, request, handoff_id, grammar)
            ctx.stage = "decode"
            with self._span(ctx, "decode", SpanKind.CLIENT) as span:
                trace = None
                if span is not None:
                    span.set_attributes({"pd.decode.backend": lease.backend.url, "pd.handoff_id": handoff_id,
                                         "pd.stream": request.stream})
                    trace = Tracing.headers(span)
                clean = await self._decode(ctx, lease, body, request, kv_params, trace)
            if clean:
                outcome = "clean"
        except Requeue as again:
            outcome = "busy" if again.busy else "aborted"
            raise
        except UpstreamRejected:  # never a decode 429: that one became a Requeue
            outcome = "answered"
            raise
        except HandoffFailed as err:
            raise DecodeLegFailed(err) from None
        except RouterError as err:
            if ctx.stage == "decode" and not ctx.started:
                if not isinstance(err, UpstreamTimeout):
                    raise DecodeLegFailed(err) from None
                state.upstream_failed("decode", lease.backend, err)  # slow, not down
            raise
        finally:
            if outcome in ("clean", "answered"):  # a clean end also ended the lease on the server
                state.pool.release(lease, tell_server=outcome != "clean")
            else:
                state.abort(lease, ctx.request_id, handoff_id, busy=outcome == "busy")

    async def _prefill(
        self, ctx: _Ctx, lease: Lease, body: dict[str, Any], request: OpenAIRequest, handoff_id: str,
        grammar: GrammarSpec | None = None,
    ) -> dict[str, Any]:
        decode = lease.backend
        if decode.capabilities is None:
            target: Mapping[str, Any] = VLLM_REMOTE_DECODE_PARAMS
        else:
            target = HandoffTarget(handoff_id=handoff_id, kv_endpoint=decode.capabilities.kv_endpoint).model_dump()
        side: asyncio.Future[dict[str, Any]] | None = None
        if body.get("prompt_logprobs") is not None:  # asked of a prefill server apart, at the same time
            side = asyncio.ensure_future(self._prompt_logprobs(ctx, body, request.model))
            body = {k: v for k, v in body.items() if k != "prompt_logprobs"}
        try:
            answer = await self._prefill_leg(ctx, body, request, handoff_id, target, grammar)
            if side is not None:
                ctx.prompt_logprobs = decode_check.prompt_logprobs_of(await side)
        finally:
            if side is not None and not side.done():
                side.cancel()
            elif side is not None and not side.cancelled():
                side.exception()  # retrieved: the PD prefill's own failure is the one raised
        with self._span(ctx, "handoff") as span:
            params = self._handoff(lease, answer, request, handoff_id, span)
        tokens = params.get("num_prompt_tokens")
        ctx.prompt_tokens = tokens if isinstance(tokens, int) else 0
        return params

    async def _prompt_logprobs(self, ctx: _Ctx, body: dict[str, Any], model: str) -> dict[str, Any]:
        """vLLM schedules a request with ``prompt_logprobs`` without asking the KV connector
        first (it skips the prefix-cache lookup, where the connector holds a request back
        until its decode server admitted the KV): the prompt's logprobs come from a plain
        one-token request to a prefill server, run next to the PD prefill."""
        return await self._plain_prefill(ctx, model, decode_check.prompt_logprobs_body(ctx.endpoint, body),
                                         f"{ctx.request_id[:240]}~plp")

    async def _plain_prefill(self, ctx: _Ctx, model: str, data: bytes, request_id: str) -> dict[str, Any]:
        """``data`` (no ``kv_transfer_params``: vLLM's KV connector leaves it alone) to the
        least-loaded prefill server serving ``model``; its JSON answer."""
        backend = self.state.backends.pick_prefill(model)
        if backend is None:
            raise NoHealthyBackend(f"no healthy prefill server for model {model!r}")
        backend.sent()
        try:
            return await upstream.prefill(self.state.upstream, backend.target, ctx.endpoint.value, data, request_id,
                                          self.state.settings.prefill_timeout)
        finally:
            backend.in_flight -= 1

    async def _prefill_alone(self, ctx: _Ctx, body: dict[str, Any], model: str) -> None:
        """The whole request to a prefill server (:func:`decode_check.served_by_prefill`), its
        answer relayed as it is: vLLM's own echo and logprobs."""
        ctx.stage = "prefill"
        answer = await self._plain_prefill(ctx, model, json.dumps(body).encode(), ctx.request_id)
        usage = answer.get("usage")
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        ctx.prompt_tokens = tokens if isinstance(tokens, int) else 0
        ctx.status, ctx.finished = 200, True
        ctx.ttft = perf_counter() - ctx.start
        await respond(ctx.send, 200, json.dumps(answer).encode(), b"application/json",
                      [(b"x-request-id", ctx.request_id.encode())])

    async def _prefill_leg(
        self, ctx: _Ctx, body: dict[str, Any], request: OpenAIRequest, handoff_id: str, target: Mapping[str, Any],
        grammar: GrammarSpec | None,
    ) -> dict[str, Any]:
        state = self.state
        data = prefill_body(ctx.endpoint, body, target, grammar)
        t0 = perf_counter()
        failed: upstream.Unreachable | None = None
        failed_backend = None
        with self._span(ctx, "prefill", SpanKind.CLIENT) as span:
            trace = None
            if span is not None:
                span.set_attribute("pd.handoff_id", handoff_id)
                trace = Tracing.headers(span)  # vLLM parents its request span on it
            for attempt in (0, 1):
                backend = state.backends.pick_prefill(request.model, exclude=failed_backend)
                if backend is None:
                    if failed is not None:
                        raise failed
                    raise NoHealthyBackend(f"no healthy prefill server for model {request.model!r}")
                if span is not None:
                    span.set_attributes({"pd.prefill.backend": backend.url, "pd.prefill.tries": attempt + 1})
                backend.sent()
                try:
                    answer = await upstream.prefill(state.upstream, backend.target, ctx.endpoint.value, data,
                                                    ctx.request_id, state.settings.prefill_timeout, trace)
                    break
                except upstream.Unreachable as err:
                    state.upstream_failed("prefill", backend, err, mark_down=True)
                    if attempt:
                        raise
                    failed, failed_backend = err, backend
                except RouterError as err:  # a lost connection: the server is down until a probe says otherwise
                    state.upstream_failed("prefill", backend, err,
                                          mark_down=isinstance(err, upstream.ConnectionLost))
                    raise
                finally:
                    backend.in_flight -= 1
        state.metrics.prefill_latency.observe(perf_counter() - t0)
        return answer

    def _handoff(
        self, lease: Lease, answer: dict[str, Any], request: OpenAIRequest, handoff_id: str,
        span: Span | None = None,
    ) -> dict[str, Any]:
        """The ``kv_transfer_params`` for decode, from the prefill answer."""
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise BadUpstream(
                "prefill answer carries no kv_transfer_params (is the KV connector configured?)"
            )
        if lease.backend.capabilities is None:
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
            raise HandoffFailed(f"KV handoff to {result.kv_endpoint} failed ({result.reason}): {result.error}")
        if result.handoff_id != handoff_id:
            raise BadUpstream(f"prefill returned handoff {result.handoff_id!r}, expected {handoff_id!r}")
        self.state.pool.served(lease.backend)
        ids = decode_check.prompt_token_ids(answer)  # there when the prefill leg asked (prefill_fields)
        if ids is not None:
            result = result.model_copy(update={"prompt_token_ids": ids})
        if request.wants_logprobs():
            choices = answer.get("choices")
            logprobs = (
                choices[0].get("logprobs")
                if isinstance(choices, list) and choices and isinstance(choices[0], dict)
                else None
            )
            if isinstance(logprobs, dict):
                result = result.model_copy(update={"prefill_logprobs": logprobs})
        return result.model_dump()

    async def _decode(
        self, ctx: _Ctx, lease: Lease, body: dict[str, Any], request: OpenAIRequest, kv_params: dict[str, Any],
        trace: Mapping[str, str] | None = None,
    ) -> bool:
        """Relay the decode answer; True when it ended cleanly. ``trace``: the ``traceparent`` header."""
        state = self.state
        backend = lease.backend
        data = decode_body(ctx.raw, body, kv_params)
        try:
            resp = await upstream.open_decode(state.upstream, backend.target, ctx.endpoint.value, data,
                                              ctx.request_id, state.settings.decode_timeout, trace)
        except UpstreamRejected as err:
            # 429: no slot for this request there (its lease ran out, or a server without
            # leases whose slot this router counted free): wait for a slot again
            if err.status != 429:
                raise
            raise Requeue("engine_slot", f"decode server {backend.url} busy (429): {err.message}") from None
            # any other failure to open: the caller marks the server down and may fail over
        try:
            if request.stream:
                return await self._relay_stream(ctx, resp, backend)
            try:
                data = await resp.read()
            except UpstreamError as exc:  # nothing reached the client: the caller may fail over
                raise self._mid_answer_error(backend, exc) from None
            if ctx.prompt_logprobs is not None or body.get("echo"):
                data = decode_check.merged(ctx.endpoint, data, body, ctx.prompt_logprobs)
            ctx.status, ctx.finished = 200, True
            ctx.ttft = perf_counter() - ctx.start
            state.metrics.child(state.metrics.ttft, ctx.endpoint.label, ctx.model).observe(ctx.ttft)
            await respond(
                ctx.send,
                200,
                data,
                resp.headers.get(b"content-type", b"application/json"),
                [(b"x-request-id", ctx.request_id.encode())],
            )
            return True
        finally:
            resp.release()

    async def _relay_stream(self, ctx: _Ctx, resp: Response, backend: DecodeBackend) -> bool:
        """Relay the SSE stream. The response starts with the decode server's first chunk, so
        that a server failing before it costs the client nothing but a failover; a failure
        after it ends the stream with an error event and marks the server down at once.
        After the first chunk, each chunk goes to the client from the upstream connection's
        callback through the request's :class:`ChunkWriter` where the server gives one (no
        task switch per token); what it declines comes here and goes through ``send``."""
        state, send = self.state, ctx.send
        tally = _Tally(state.metrics.itl, ctx.writer)
        try:
            async for chunk in resp:
                now = perf_counter()
                if not tally.chunks:
                    tally.t_first = now
                    ctx.ttft = now - ctx.start
                    state.metrics.child(state.metrics.ttft, ctx.endpoint.label, ctx.model).observe(ctx.ttft)
                    await send(
                        {
                            "type": "http.response.start",
                            "status": 200,
                            "headers": [
                                (b"content-type", resp.headers.get(b"content-type", SSE)),
                                (b"cache-control", b"no-cache"),
                                (b"x-request-id", ctx.request_id.encode()),
                            ],
                        }
                    )
                    ctx.started, ctx.status = True, 200
                tally.note(chunk, now)
                tally.sending = True  # until this chunk is written, later ones wait behind it
                try:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                finally:
                    tally.sending = False
                if tally.writer is not None:
                    resp.sink = tally
        except UpstreamError as exc:
            err = self._mid_answer_error(backend, exc)
            if not ctx.started:
                raise err from None
            state.upstream_failed("decode", backend, err, mark_down=True)
            await ctx.fail(err)
            return False
        finally:
            resp.sink = None
        if not (tally.prev[-16:] + tally.last).rstrip().endswith(_DONE):
            err2 = BadUpstream(f"decode server {backend.url} ended the stream without data: [DONE]")
            if not ctx.started:
                raise err2
            state.upstream_failed("decode", backend, err2, mark_down=True)
            await ctx.fail(err2)
            return False
        ctx.finished = True
        if tally.chunks > 1:
            state.metrics.child(state.metrics.tpot, ctx.endpoint.label, ctx.model).observe(
                (tally.t_prev - tally.t_first) / (tally.chunks - 1))
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True

    def _mid_answer_error(self, backend: DecodeBackend, exc: UpstreamError) -> RouterError:
        return upstream.map_error(
            "decode", backend.target, exc, f"--decode-timeout {self.state.settings.decode_timeout:g}s"
        )


class _Tally:
    """A relayed stream's chunks (their count, times and last bytes, for the ``[DONE]`` check
    and the metrics) and, with a writer, the upstream's :class:`~pd_router.rawhttp.Sink`: the
    chunks of one upstream read go to the client as one write, from the connection's callback."""

    __slots__ = ("itl", "writer", "chunks", "t_first", "t_prev", "prev", "last", "sending", "_pending")

    def __init__(self, itl: TokenHistogram, writer: ChunkWriter | None) -> None:
        self.itl, self.writer = itl, writer
        self.chunks = 0
        # the relay task is in ``send`` with a chunk: uvicorn may be waiting for the client to
        # drain before writing it, and a chunk written past it now would overtake it
        self.sending = False
        self.t_first = self.t_prev = 0.0
        self.prev = self.last = b""
        self._pending: list[bytes] = []

    def note(self, chunk: bytes, now: float) -> None:
        if self.chunks:
            self.itl.observe(now - self.t_prev)
        self.chunks += 1
        self.t_prev = now
        self.prev, self.last = self.last, chunk

    def take(self, chunk: bytes) -> bool:
        """Taken when the client's connection can be written to now (it stays so until
        :meth:`flush`: both run in one callback of the event loop)."""
        if not self._pending and (self.sending or self.writer is None or not self.writer.writable()):
            return False
        self._pending.append(chunk)
        self.note(chunk, perf_counter())
        return True

    def flush(self) -> None:
        pending = self._pending
        if pending and self.writer is not None:
            self.writer.write(pending[0] if len(pending) == 1 else b"".join(pending))
            pending.clear()


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
