"""The completion routes as one raw ASGI handler: the router's hot path, and a request's first
stage (:attr:`Stage.VALIDATING <pd_router.request.stages.Stage>`).

Per request: the key, the tenant, the drain and the id; the body read within its bounds and
parsed (a ``/v1/responses`` or ``/v1/messages`` body translated to a chat completion first,
:mod:`pd_router.apis`); its priority; ``n > 1`` split into one request per choice
(:mod:`pd_router.request.fanout`); each validated once (:mod:`pd_router.request.checks`) and
served: by a prefill server alone, or by its attempts (:mod:`pd_router.request.attempts`).

One abort path: a watcher task waits for the client's ``http.disconnect`` and cancels the
request's task wherever it is (queued, in prefill, in decode); each attempt gives its slot back
whatever the way out. The request's observation (trace, access log, metrics) begins and ends
here (:mod:`pd_router.request.observe`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from time import perf_counter
from typing import TYPE_CHECKING, Any, Literal

from pd_http.chunk_writer import chunk_writer
from pd_router.apis import messages, messages_out, responses, responses_out
from pd_router.apis.completions import parse_request
from pd_router.asgi import Receive, Scope, Send, authorization, header, read_body
from pd_router.errors import InvalidRequest, RouterError, ShuttingDown
from pd_router.request import attempts, checks, fanout, observe, prefill
from pd_router.request.context import RequestContext
from pd_wire.requests import Endpoint, OpenAIRequest

if TYPE_CHECKING:
    from pd_router.state import RouterState

log = logging.getLogger("pd_router.requests")
Api = Literal["openai", "responses", "messages"]  # the API a request came in: all served as chat or completions
_REQUEST_ID = re.compile(rb"[\x21-\x7e]+")  # visible ASCII: it goes into headers and the KV handoff id


class CompletionHandler:
    """The completion routes' handler (one per app): each request's validating stage, then its
    serving (:meth:`_serve`), once per choice of an ``n > 1`` request."""

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
        """``api``: ``responses``, a ``/v1/responses`` request (:mod:`pd_router.apis.responses`), or
        ``messages``, an Anthropic ``/v1/messages`` request (:mod:`pd_router.apis.messages`), served as
        a chat completion."""
        rid_raw = header(scope, b"x-request-id")
        rid = rid_raw.decode("latin-1")[:256] if rid_raw else uuid.uuid4().hex
        anthropic = messages_out.Translator(send) if api == "messages" else None
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
                as_responses = responses.parse(raw)
                raw = json.dumps(as_responses.chat_body()).encode()
                ctx.send = responses_out.Translator(send, as_responses).send
            elif anthropic is not None:
                as_messages = messages.parse_messages(raw)
                raw = json.dumps(as_messages.chat_body()).encode()
                anthropic.stream = bool(as_messages.stream)
            else:
                ctx.writer = chunk_writer(scope)
            body, parsed = parse_request(endpoint, raw)
            ctx.raw = raw
            self._check_priority(ctx, parsed)
            watcher = asyncio.get_running_loop().create_task(self._watch(receive, ctx, me))
            choices = fanout.choice_bodies(state, endpoint, body, parsed.model or "")
            if choices is not None:
                await fanout.serve(state, ctx, body, parsed, choices, self._serve)
            else:
                await self._serve(ctx, body, parsed)
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
    def _check_priority(ctx: RequestContext, parsed: OpenAIRequest) -> None:
        """The request's ``priority`` (vLLM's field) orders its wait for a decode slot here (and is
        forwarded: a vLLM prefill server running ``--scheduling-policy priority`` orders its
        prefills by it, one running first-come-first-served ignores it)."""
        floor = ctx.tenant.min_priority
        if parsed.priority < floor:
            raise InvalidRequest(f"priority {parsed.priority} is below {floor}, the lowest this request may ask "
                                 "for (lower is served sooner; --min-priority, or its key's min_priority)",
                                 param="priority")
        ctx.priority = parsed.priority

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

    async def _serve(self, ctx: RequestContext, body: dict[str, Any], parsed: OpenAIRequest) -> None:
        """One request (or one choice): checked into its :class:`~pd_router.request.checks.ValidRequest`
        (the grammar first, then the model, the model's label set from there on), then served by
        a prefill server alone or by its attempts."""
        state = self.state
        grammar = await checks.grammar(state, ctx.endpoint, body)
        ctx.model = checks.served_model(state, parsed)
        ctx.valid = checks.validate(state, ctx.endpoint, body, parsed, ctx.model, grammar)
        if ctx.valid.served_by_prefill:
            await prefill.answer_alone(state, ctx)
            return
        await attempts.serve(state, ctx)
