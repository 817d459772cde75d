""":attr:`Stage.DECODE <pd_router.request.stages.Stage>`: the decode server's answer relayed to the
client, a JSON body whole or an SSE stream chunk by chunk (after the first chunk, from the upstream
connection's callback through the request's :class:`~pd_http.chunk_writer.ChunkWriter`: no task
switch per token), with its TTFT, TPOT and ITL; the result posted to a decode request that waits
for it, and a server the router counts asked after the prefill (:func:`decode`)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from time import perf_counter
from typing import TYPE_CHECKING, Any

from pd_http.chunk_writer import ChunkWriter
from pd_router.apis.completions import decode_body
from pd_router.asgi import SSE, respond
from pd_router.errors import (
    BadUpstream,
    DecodeLost,
    Hung,
    Requeue,
    RouterError,
    UpstreamRejected,
)
from pd_router.fleet.backends import DecodeBackend
from pd_router.request import logprobs
from pd_router.request.context import Attempt, RequestContext
from pd_router.request.trail import Trail, server_error
from pd_router.slots.pool import Slot
from pd_router.upstream import calls
from pd_router.upstream.rawhttp import ReadTimeout, Response, UpstreamError
from pd_wire.decode import REQUEST_ID_HEADER, RESULT_PATH, DecodeRefusal

if TYPE_CHECKING:
    from pd_router.metrics import TokenHistogram
    from pd_router.state import RouterState

_DONE = b"data: [DONE]"
CALL_TIMEOUT_S = 5.0  # a posted result; the answer of a decode request past its wait in a queue


async def decode(state: RouterState, ctx: RequestContext, attempt: Attempt, kv_params: dict[str, Any],
                 trace: Mapping[str, str] | None = None) -> bool:
    """A server the router counts (a plain vLLM): the decode request after the prefill, its
    answer relayed; True when it ended cleanly. ``trace``: the ``traceparent`` header."""
    slot = attempt.slot
    backend = slot.backend
    with _busy_is_requeue(backend):
        resp = await calls.open_decode(state.connections, backend.target, ctx.endpoint.path,
                                       decode_body(ctx.raw, attempt.body, kv_params), ctx.request_id,
                                       state.settings.decode_timeout, trace)
    # any other failure to open: the caller marks the server down and may fail over
    return await relay(state, ctx, slot, resp)


async def post_result(state: RouterState, ctx: RequestContext, slot: Slot, params: dict[str, Any]) -> None:
    """The handoff's result, read from vLLM's answer, to the decode request waiting for it
    (``HandoffClaim.result == "posted"``). Not there (404: the request or its KV ended) is for the
    open answer to say; no answer at all is the decode leg's failure, and silence past
    :data:`CALL_TIMEOUT_S` (a live server answers at once) a lost server's (:class:`Hung`): the
    request runs again on another decode server."""
    target = slot.backend.target
    try:
        await calls.call(state.connections, target, RESULT_PATH, json.dumps(params).encode(), CALL_TIMEOUT_S,
                         {REQUEST_ID_HEADER: ctx.request_id})
    except (ReadTimeout, TimeoutError):
        raise Hung(f"decode server {target.origin} did not answer within {CALL_TIMEOUT_S:g}s (posting the result): "
                   "stopped or cut off") from None
    except UpstreamError as exc:
        raise calls.map_error("decode", target, exc, f"{CALL_TIMEOUT_S:g}s (posting the result)") from None


async def first_event(state: RouterState, slot: Slot, resp: Response) -> Response:
    """A granted decode answer (:func:`open_slot`) once its first event came; a refusal in its
    body raised as the status it stands for."""
    with _busy_is_requeue(slot.backend):
        return await calls.read_first_event(resp, slot.backend.target, state.settings.decode_timeout)


@contextmanager
def _busy_is_requeue(backend: DecodeBackend) -> Iterator[None]:
    """429: no slot for this request there (a server whose slot this router counted free): the
    request waits for a slot again."""
    try:
        yield
    except UpstreamRejected as err:
        if err.status != 429:
            raise
        raise Requeue("engine_slot", f"decode server {backend.url} busy (429): {err.message}") from None


async def relay(state: RouterState, ctx: RequestContext, slot: Slot, resp: Response) -> bool:
    """Relay an open decode answer to the client (and give its connection back); True when it ended
    cleanly. An answer with progress lines (a decode server of ours: ``ctx.trail``) is watched for
    a stall from its first event on (``--stall-timeout``), and its loss after that raises
    :class:`DecodeLost`."""
    backend = slot.backend
    trail = ctx.trail if backend.capabilities is not None else None
    if trail is not None:  # a step's progress line at the engine's pace
        resp.read_timeout = min(state.settings.stall_timeout, state.settings.decode_timeout)
    try:
        if ctx.request.parsed.stream:
            return await relay_stream(state, ctx, resp, backend, trail)
        try:
            data = await resp.read() if trail is None else await _read_tracked(resp, trail)
        except UpstreamError as exc:  # nothing reached the client: the caller may fail over
            err = mid_answer_error(state, backend, exc, trail is not None)
            if trail is not None and trail.steps:  # tokens came: resume from them
                state.upstream_failed("decode", backend, err, mark_down=True)
                raise DecodeLost(err, _loss_reason(exc), backend.url) from None
            raise err from None
        if trail is not None:
            data = _unrefused(state, backend, trail, data)
        body = ctx.request.body
        if ctx.prompt_logprobs is not None or body.get("echo"):
            data = logprobs.merged(ctx.endpoint, data, body, ctx.prompt_logprobs, ctx.echo_logprobs)
        ctx.status, ctx.finished = 200, True
        ctx.ttft = perf_counter() - ctx.start
        state.metrics.child(state.metrics.ttft, ctx.endpoint.label, ctx.model).observe(ctx.ttft)
        _resumed(state, ctx)
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


async def _read_tracked(resp: Response, trail: Trail) -> bytes:
    """An answer not streamed: its progress lines, then its JSON body (returned)."""
    async for chunk in resp:
        trail.feed(chunk)
    return trail.rest()


def _unrefused(state: RouterState, backend: DecodeBackend, trail: Trail, data: bytes) -> bytes:
    """The JSON body of a tracked answer not streamed; a refusal the server ended it with after
    its first token raised: its own failure (5xx) as :class:`DecodeLost`, the request's as the
    status it stands for."""
    try:
        refusal = DecodeRefusal.of_event(data)
    except ValueError:
        refusal = None
    if refusal is None:
        return data
    err = calls.status_error("decode", backend.target, refusal.status, refusal.error_body(),
                             b"application/json")
    if refusal.status >= 500 and trail.steps:
        state.upstream_failed("decode", backend, err)
        raise DecodeLost(err, "error_event", backend.url)
    raise err


def _loss_reason(exc: UpstreamError) -> str:
    return "stalled" if isinstance(exc, ReadTimeout) else "connection_lost"


def _resumed(state: RouterState, ctx: RequestContext) -> None:
    """A migrated answer's first output from its new decode server: the time the move cost."""
    if ctx.lost_at is not None:
        metrics = state.metrics
        metrics.migration_seconds.observe(perf_counter() - ctx.lost_at)
        metrics.child(metrics.migrations, ctx.resume_reason, "resumed").inc()
        ctx.lost_at = None


async def relay_stream(state: RouterState, ctx: RequestContext, resp: Response, backend: DecodeBackend,
                       trail: Trail | None = None) -> bool:
    """Relay the SSE stream. The response starts with the decode server's first chunk, so
    that a server failing before it costs the client nothing but a failover; a failure
    after it marks the server down at once and ends the stream with an error event, or, for
    an answer with a ``trail``, raises :class:`DecodeLost` (its attempts may resume it
    elsewhere; a resumed answer's stream goes on here without a second start).
    After the first chunk, each chunk goes to the client from the upstream connection's
    callback through the request's :class:`ChunkWriter` where the server gives one (no
    task switch per token); what it declines comes here and goes through ``send``."""
    send = ctx.send
    tally = Tally(state.metrics.itl, ctx.writer, trail)
    try:
        async for chunk in resp:
            if trail is not None:
                chunk = trail.feed(chunk)
                if not chunk:
                    continue
            now = perf_counter()
            if not tally.chunks:
                tally.t_first = now
                if not ctx.started:
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
                _resumed(state, ctx)
            tally.note(chunk, now)
            tally.sending = True  # until this chunk is written, later ones wait behind it
            try:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finally:
                tally.sending = False
            if tally.writer is not None:
                resp.sink = tally
    except UpstreamError as exc:
        err = mid_answer_error(state, backend, exc, trail is not None)
        if not ctx.started:
            raise err from None
        state.upstream_failed("decode", backend, err, mark_down=True)
        if trail is not None:
            raise DecodeLost(err, _loss_reason(exc), backend.url) from None
        await ctx.fail(err)
        return False
    finally:
        resp.sink = None
    if trail is not None:
        rest = trail.rest()
        failed = server_error(rest) if rest else None
        if failed is not None and ctx.started:  # the server's own failure, in its last event
            err3 = BadUpstream(f"decode server {backend.url} failed mid-answer: {failed}")
            state.upstream_failed("decode", backend, err3)
            raise DecodeLost(err3, "error_event", backend.url)
        if rest:
            tally.note(rest, perf_counter())
            await send({"type": "http.response.body", "body": rest, "more_body": True})
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


def mid_answer_error(state: RouterState, backend: DecodeBackend, exc: UpstreamError,
                     stall: bool = False) -> RouterError:
    """``stall``: the answer reports its progress: its read timeout was ``--stall-timeout`` where
    that is the shorter."""
    settings = state.settings
    limit = (f"--stall-timeout {settings.stall_timeout:g}s (no token)"
             if stall and settings.stall_timeout < settings.decode_timeout
             else f"--decode-timeout {settings.decode_timeout:g}s")
    return calls.map_error("decode", backend.target, exc, limit)



class Tally:
    """A relayed stream's chunks (their count, times and last bytes, for the ``[DONE]`` check
    and the metrics) and, with a writer, the upstream's :class:`~pd_router.upstream.rawhttp.Sink`: the
    chunks of one upstream read go to the client as one write, from the connection's callback
    (their progress lines taken out first, with a ``trail``)."""

    __slots__ = ("itl", "writer", "trail", "chunks", "t_first", "t_prev", "prev", "last", "sending", "_pending")

    def __init__(self, itl: TokenHistogram, writer: ChunkWriter | None, trail: Trail | None = None) -> None:
        self.itl, self.writer, self.trail = itl, writer, trail
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
        if self.trail is not None:
            chunk = self.trail.feed(chunk)
            if not chunk:
                return True
        self._pending.append(chunk)
        self.note(chunk, perf_counter())
        return True

    def flush(self) -> None:
        pending = self._pending
        if pending and self.writer is not None:
            self.writer.write(pending[0] if len(pending) == 1 else b"".join(pending))
            pending.clear()
