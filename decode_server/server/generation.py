"""One generation, from KV wait to the last byte, with one abort path.

:class:`Job` owns everything a request holds — its decode slot (taken as it runs: now,
or after a wait in the queue), its KV handoff in the receiver, its engine session and worker
thread — and gives each back exactly once, whatever happens (client gone, cancel endpoint,
KV timeout, engine error, server shutdown, a swap that took its slot).
:class:`GenerationResponse` is the ASGI response that runs the job and watches the client: a
disconnect aborts the job at once.

Threads: the engine runs on the slot's worker thread (``engine.start`` then
``session.step`` until a stop condition); between two steps the worker only cuts the
step's tokens at the token-level stop conditions (:meth:`SequenceProcessor.cut`) and posts
them to the loop through ``call_soon_threadsafe``. The loop detokenizes, matches stop strings
(:meth:`SequenceProcessor.text`: a match stops the steps), renders and sends, beside the
worker's next step.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import MutableMapping
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any, Protocol

from starlette.responses import Response

from connector.kv_errors import HandoffTimeout, ReceiverError, TransferFailed
from connector.prefix import PREFIX_BLOCK_TOKENS, block_hashes
from connector.receiver import ReceivedKV
from decode_server.engine.base import Cancelled as EngineCancelled
from decode_server.engine.base import DecodeSession, Engine, EngineError, SamplingParams, TokenOut
from decode_server.engine.grammar import ThinkingBudgetSpec
from decode_server.engine.process import GrammarRequests
from decode_server.engine.structured import GrammarCompiler
from decode_server.server.api_errors import ApiError, Cancelled, EngineFailure, KVHandoffFailed, KVTimeout
from decode_server.server.granted import GrantedSend
from decode_server.server.metrics import DecodeMetrics
from decode_server.server.observe import RequestObservation
from decode_server.server.request_plan import Plan, with_result
from decode_server.server.responses import DONE, dumps, renderer_for, sse
from decode_server.server.sequence import Cut, Delta, SequenceProcessor, TokenLogprob
from decode_server.server.slots import Kept, SlotRefused, SlotTable
from decode_server.server.text import TextTokenizer
from pd_http.tracing import Span, Tracing, fail
from pd_wire.decode import progress_line
from pd_wire.handoff import HandoffClaim, HandoffResult

log = logging.getLogger(__name__)
SLOT_RETURN_WAIT_S = 5.0

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
JSON_HEADERS = [(b"content-type", b"application/json")]


class Receiver(Protocol):
    """What the server uses of :class:`connector.receiver.KVReceiver`."""

    async def wait_for(self, handoff_id: str, timeout: float, with_result: bool = False) -> ReceivedKV: ...

    def release(self, handoff_id: str, tombstone: bool = True) -> None: ...


@dataclass
class GenerationContext:
    engine: Engine
    receiver: Receiver
    tokenizer: TextTokenizer
    slots: SlotTable
    metrics: DecodeMetrics
    executor: Executor
    kv_timeout: float
    write_timeout: float = 60.0  # an answer's wait for its client to take the next bytes
    tracing: Tracing | None = None  # None: tracing off
    grammars: GrammarCompiler | GrammarRequests | None = None  # structured output (None: the engine cannot)


class _Started:
    pass


@dataclass(frozen=True)
class _Replayed:
    """The output before a cut, through the token-level stop conditions again (a resumed
    sequence): the loop runs its text for the renderer; the client had it already."""

    cut: Cut


@dataclass(frozen=True)
class _Stepped:
    """One engine step's tokens as the worker cut them, for the loop's half of the processing
    (:meth:`SequenceProcessor.text`), with the step's time and MTP counts for the metrics."""

    cut: Cut
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    first_logprob: TokenLogprob | None = None


_ABORTED = object()


def error_response_parts(err: ApiError, extra_headers: list[tuple[bytes, bytes]]) -> tuple[dict, dict]:
    body = err.body()
    start = {"type": "http.response.start", "status": err.status,
             "headers": JSON_HEADERS + [(b"content-length", str(len(body)).encode())] + extra_headers}
    return start, {"type": "http.response.body", "body": body}


class Job:
    def __init__(self, ctx: GenerationContext, plan: Plan, endpoint_label: str,
                 observation: RequestObservation | None = None) -> None:
        self.ctx = ctx
        self.plan = plan
        self.endpoint_label = endpoint_label
        self.request_id = plan.request_id
        self.obs = observation or RequestObservation(None, endpoint_label, plan.request_id, ())
        self.holds_slot = False
        # a decode request before its prefill: its 200 goes out once it holds its slot (:mod:`granted`),
        # and no KV comes before (the router prefills on that 200)
        self.claim = isinstance(plan.handoff, HandoffClaim)
        # the keys of the KV its slot may keep after a clean end, and reuse now (HandoffClaim.keep)
        self.keep = plan.handoff.keep if isinstance(plan.handoff, HandoffClaim) else None
        self._output_ids: list[int] = []  # every token the engine gave, in order (the worker's)
        self.arrived = time.monotonic()
        self.abort_reason: str | None = None
        self._aborted = asyncio.Event()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._session: DecodeSession | None = None
        self._proc: SequenceProcessor | None = None  # the worker's, once it decodes
        self._worker_started = False
        self._worker_done = asyncio.Event()  # set on the loop once the worker gave the slot back
        self._given_back = asyncio.Event()  # slot and KV handoff are free again
        self._kv_released = self.claim  # nothing of a claim's KV to give back before its slot
        self._tombstone = True  # a KV released before it came is refused when it comes
        self._closed = False

    # ---- abort path -------------------------------------------------------------
    def abort(self, reason: str) -> bool:
        """Stop this generation (from the loop). Returns False if it already ended."""
        if self._closed or self.abort_reason is not None:
            return False
        self.abort_reason = reason
        self.ctx.metrics.cancelled.labels(reason).inc()
        self._stop.set()
        with self._lock:
            session = self._session
        if session is not None:
            session.cancel()
        self._aborted.set()
        self._queue.put_nowait(_ABORTED)
        return True

    def replaced(self) -> None:
        """A swap took this request's slot (its router gave it up here before any prefill for
        it: no KV comes, and its release leaves no tombstone that would refuse that handoff's
        KV when the same request is granted here later)."""
        self._tombstone = False
        self.abort("replaced")

    def close(self) -> None:
        """Always called last (on the loop): gives back whatever the worker does not own."""
        if self._closed:
            return
        self._closed = True
        self._stop_worker()
        if not self._worker_started:
            self._release_now()

    def _stop_worker(self) -> None:
        self._stop.set()
        with self._lock:
            session = self._session
        if session is not None:
            session.cancel()

    def _release_now(self) -> None:
        """Give back the KV handoff and the slot (no worker holds them)."""
        self._release_kv()
        self._release_slot()
        self._given_back.set()

    def _release_slot(self) -> None:
        if self.holds_slot:
            self.holds_slot = False
            self.ctx.slots.release(self.plan.handoff_id, "job")

    async def _give_back(self) -> None:
        """Before an error answer: stop the worker and give back the slot and the KV handoff,
        so that whoever sees the answer (the router) finds both free."""
        self._stop_worker()
        if self._worker_started:
            await self._slot_returned()  # the worker releases the KV, then the slot
        else:
            self._release_now()

    async def given_back(self, timeout: float) -> bool:
        """Wait (bounded) until the slot and the KV handoff are free; False on timeout."""
        try:
            await asyncio.wait_for(self._given_back.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _release_kv(self) -> None:
        if not self._kv_released:
            self._kv_released = True
            self.ctx.receiver.release(self.plan.handoff_id, self._tombstone)

    def _from_worker(self, fn: Any, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed at shutdown: nothing left to notify
            pass

    # ---- KV wait --------------------------------------------------------------------
    async def _wait_kv(self) -> ReceivedKV:
        self.obs.stage = "kv_wait"
        span = self.obs.stage_span("kv_wait")
        try:
            kv = await self._wait_kv_traced(span)
        except BaseException as exc:
            if span is not None:
                fail(span, exc, exc.type if isinstance(exc, ApiError) else None)
            raise
        finally:
            if span is not None:
                span.end()
        return kv

    async def _wait_kv_traced(self, span: Span | None) -> ReceivedKV:
        handoff = self.plan.handoff
        claim = not isinstance(handoff, HandoffResult)  # the result (first token) comes with the KV
        if span is not None:
            span.set_attribute("pd.handoff_id", handoff.handoff_id)
            if isinstance(handoff, HandoffResult):
                span.set_attribute("pd.handoff.prompt_tokens", handoff.num_prompt_tokens)
        wait = asyncio.ensure_future(self.ctx.receiver.wait_for(handoff.handoff_id, self.ctx.kv_timeout,
                                                                with_result=claim))
        aborted = asyncio.ensure_future(self._aborted.wait())
        try:
            await asyncio.wait({wait, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for fut in (wait, aborted):
                if not fut.done():
                    fut.cancel()
        if not wait.done() or wait.cancelled():
            raise Cancelled(f"request {self.request_id!r} was cancelled ({self.abort_reason}) while waiting for KV")
        try:
            kv = wait.result()
        except HandoffTimeout as exc:
            raise KVTimeout(f"the KV of handoff {handoff.handoff_id!r} did not arrive within "
                            f"{self.ctx.kv_timeout:g} s: {exc}") from exc
        except (TransferFailed, ReceiverError) as exc:
            raise KVHandoffFailed(f"the KV handoff {handoff.handoff_id!r} failed: {exc}") from exc
        self.ctx.metrics.kv_wait.observe(time.monotonic() - self.arrived)
        if claim:
            if kv.result is None:  # a receiver that returned without it: a bug, not the client's
                raise KVHandoffFailed(f"the KV of handoff {handoff.handoff_id!r} came without the prefill's result")
            if span is not None:
                span.set_attribute("pd.handoff.prompt_tokens", kv.result.num_prompt_tokens)
            self.plan = with_result(self.plan, kv.result)
        return kv

    # ---- worker thread ----------------------------------------------------------------
    def _post(self, item: Any) -> None:
        self._from_worker(self._queue.put_nowait, item)

    def _work(self, kv: ReceivedKV) -> None:
        session: DecodeSession | None = None
        span: Span | None = None
        try:
            span = self.obs.stage_span("engine_start")
            try:
                session = self.ctx.engine.start(kv, self.plan.result, self._sampling())
            except BaseException as exc:
                if span is not None:
                    fail(span, exc)
                raise
            finally:
                self._from_worker(self._release_kv)  # the engine copied the KV (or failed)
                if span is not None:
                    span.end()
                span = None
            with self._lock:
                self._session = session
            if self._stop.is_set():
                session.cancel()
            self._post(_Started())
            span = self.obs.stage_span("generation")
            if span is not None:
                span.set_attributes({"pd.kv.reused_tokens": kv.reused,
                                     "pd.kv.pushed_tokens": kv.num_tokens - kv.reused})
            finished = self._decode(session, self.plan.result, span)
            if finished and self.abort_reason is None:
                self._keep_kv(kv, session)
        except EngineCancelled:
            pass
        except ApiError as exc:
            self._post(exc)
            if span is not None:
                fail(span, exc, exc.type)
        except EngineError as exc:
            self._post(EngineFailure(f"decode engine error: {exc}"))
            if span is not None:
                fail(span, exc, EngineFailure.type)
        except Exception as exc:  # report it; never let the worker die silently
            log.exception("request %s: engine failure", self.request_id)
            self._post(EngineFailure(f"decode engine failure: {type(exc).__name__}: {exc}"))
            if span is not None:
                fail(span, exc, EngineFailure.type)
        finally:
            if span is not None:  # the generation's, ended here also when it failed or was cancelled
                if self.abort_reason is not None:
                    span.set_attribute("pd.abort_reason", self.abort_reason)
                span.end()
            if session is not None:
                try:
                    session.close()
                except Exception:
                    log.exception("request %s: session.close failed", self.request_id)
            self._from_worker(self._worker_finished)

    def _keep_kv(self, kv: ReceivedKV, session: DecodeSession) -> None:
        """After a clean end: what the slot keeps for the conversation's next turn (its keys, the
        hashes of the token ids whose KV the engine holds valid), handed to the slot table on
        the loop before the slot is given back. Nothing when the request has no keys, the engine
        keeps nothing, or the Admit did not offer the whole prompt's ids."""
        keep, valid = self.keep, session.kept_tokens
        if keep is None or valid <= 0 or len(kv.prefix) * PREFIX_BLOCK_TOKENS + len(kv.tail) != kv.num_tokens:
            return
        ids = [*kv.tail, *self._output_ids][:max(0, valid - len(kv.prefix) * PREFIX_BLOCK_TOKENS)]
        hashes = (*kv.prefix, *block_hashes(ids, kv.prefix[-1] if kv.prefix else None))
        kept = Kept(keep.scope, keep.conversation, hashes, min(valid, kv.num_tokens + len(self._output_ids)))
        self._from_worker(self.ctx.slots.keep, self.plan.handoff_id, kept)

    def _sampling(self) -> SamplingParams:
        """The plan's sampling parameters, with a fresh matcher for structured output or a
        thinking budget (compiled here, on the worker thread: the tokenizer is loaded on first
        use). The budget's reasoning is open from the start when the prompt ended with its
        start token."""
        plan = self.plan
        if plan.grammar is None and plan.thinking_budget is None:
            return plan.sampling
        if self.ctx.grammars is None:
            raise EngineFailure("structured output requested from a server whose engine cannot constrain decoding")
        stops = set(plan.stop.eos_token_ids) | set(plan.stop.stop_token_ids)
        budget = None
        if plan.thinking_budget is not None:
            last = plan.resume.context_token_id if plan.resume is not None else plan.result.last_prompt_token_id
            budget = ThinkingBudgetSpec(plan.thinking_budget, last)
        return replace(plan.sampling, grammar=self.ctx.grammars.matcher(plan.grammar, stops, budget))

    def _worker_finished(self) -> None:
        self._release_kv()  # already done after engine.start; kept for a worker that never got there
        self._release_slot()
        self._worker_done.set()
        self._given_back.set()

    async def _slot_returned(self) -> None:
        """Before an error answer: the slot and KV are free once the client sees the error.
        (Not before the last byte of a clean answer: the slot goes to the next queued request as soon
        as the worker has closed the engine session; nobody counts it elsewhere.) Bounded:
        after the final token the worker only closes the engine session."""
        try:
            await asyncio.wait_for(self._worker_done.wait(), SLOT_RETURN_WAIT_S)
        except TimeoutError:
            log.warning("request %s: engine session still closing after %.1fs", self.request_id,
                        SLOT_RETURN_WAIT_S)

    def _decode(self, session: DecodeSession, handoff: HandoffResult, span: Span | None = None) -> bool:
        """The worker's loop: a step, its token-level stop conditions, the tokens posted to the
        loop (which detokenizes, matches stop strings and renders beside the next step), the
        next step. A stop string the loop finds ends the steps (``_stop``). True when the
        sequence finished (a stop condition, not a stop from outside)."""
        plan = self.plan
        resume = plan.resume
        context = resume.context_token_id if resume is not None else handoff.last_prompt_token_id
        self._proc = proc = SequenceProcessor(self.ctx.tokenizer, plan.stop, [context], plan.logprobs,
                                              plan.tokens_as_ids)
        if resume is not None:  # the processor (stop strings, detokenizer) where the lost server's was
            replayed = proc.cut([TokenOut(t) for t in resume.output_token_ids])
            self._post(_Replayed(replayed))
            if replayed.finish_reason:  # the output so far had ended the sequence
                return False
        first = session.first_token if session.first_token is not None else TokenOut(handoff.first_token_id)
        self._output_ids.append(first.token_id)
        if session.first_token is not None:  # the engine chose it (SamplingParams.first_token_here)
            cut = proc.cut([session.first_token])
            self._post(_Stepped(cut))
        else:
            cut = proc.cut([first])
            self._post(_Stepped(cut, first_logprob=plan.first_logprob))
        self.ctx.metrics.first_token(handoff.num_prompt_tokens)
        drafted = accepted = steps = 0
        try:
            while not proc.cut_finished and not self._stop.is_set():
                t0 = time.perf_counter()
                tokens = session.step()
                dt = time.perf_counter() - t0
                if not tokens:
                    raise EngineError("the engine step produced no token")
                self._output_ids.extend(t.token_id for t in tokens)
                stats = session.stats
                cut = proc.cut(tokens)
                self._post(_Stepped(cut, dt, stats.drafted - drafted, stats.accepted - accepted))
                drafted, accepted = stats.drafted, stats.accepted
                steps += 1
        finally:
            if span is not None:  # however the loop ended
                span.set_attributes({"pd.completion_tokens": proc.num_cut, "pd.steps": steps,
                                     "pd.mtp.drafted": drafted, "pd.mtp.accepted": accepted})
                # a stop string's end is the loop's (it stopped the steps), the others the cut's
                reason = proc.finish_reason or cut.finish_reason
                if reason is not None:
                    span.set_attribute("pd.finish_reason", reason)
        return (proc.finish_reason or cut.finish_reason) is not None

    # ---- the response -------------------------------------------------------------------
    async def _first_event(self) -> None:
        kv = await self._wait_kv()
        if self.abort_reason is not None:
            self._release_kv()
            raise Cancelled(f"request {self.request_id!r} was cancelled ({self.abort_reason})")
        self.obs.stage = "generating"
        try:  # the worker's log lines carry the request's ids too
            self._loop.run_in_executor(self.ctx.executor, contextvars.copy_context().run, self._work, kv)
        except RuntimeError as exc:  # executor shut down: the server is stopping
            self._release_kv()
            raise EngineFailure(f"decode server is shutting down: {exc}") from exc
        self._worker_started = True
        first = await self._queue.get()
        if first is _ABORTED:
            raise Cancelled(f"request {self.request_id!r} was cancelled ({self.abort_reason})")
        if isinstance(first, ApiError):
            raise first

    def _api_error(self, exc: Exception) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        log.exception("request %s: unexpected failure", self.request_id)
        return EngineFailure(f"decode server error: {type(exc).__name__}: {exc}")

    async def run(self, send: Any, headers: list[tuple[bytes, bytes]]) -> None:
        """Answer the request; every failure becomes an OpenAI-shaped error (a status before
        the stream started, an error event after; the ``pd-error`` event of a request that
        holds its slot itself, whose 200 went out first)."""
        status_sent = False
        if not await self._take_slot(send, headers):
            return
        if self.claim:
            send = GrantedSend(send, (SSE_HEADERS if self.plan.stream else JSON_HEADERS) + headers)
            await send.start(self.ctx.slots.free)
        try:
            await self._first_event()
            renderer = renderer_for(self.plan)  # after the first event: a claim's plan is complete then
            if self.plan.stream:
                await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + headers})
                status_sent = True
                self._count(200)
                await self._stream(send, renderer)
            else:
                await self._full(send, renderer, headers)
            self.obs.stage = "done"
        except Exception as exc:  # noqa: BLE001 - mapped (and logged) by _api_error; CancelledError passes
            err = self._api_error(exc)
            await self._give_back()  # before the answer: the next request finds the slot and KV free
            if not status_sent:
                self._count(err.status, err)
                if self.abort_reason != "client_disconnected":
                    start, body = error_response_parts(err, headers)
                    await send(start)
                    await send(body)
            elif self.abort_reason != "client_disconnected":
                self.obs.answered(200, err.type)
                self.ctx.metrics.errors.labels(err.type).inc()
                await send({"type": "http.response.body", "body": sse(err.payload().model_dump()) + DONE})

    async def _take_slot(self, send: Any, headers: list[tuple[bytes, bytes]]) -> bool:
        """The request's slot (:meth:`SlotTable.take`: now, or its place in a claim's queue, then
        :meth:`SlotTable.granted_unless`; a request whose KV came first joins the slot its KV holds);
        False when it was refused (answered here: 429, 409 or 503) or its client went away first."""
        handoff = self.plan.handoff
        wait = handoff.wait if isinstance(handoff, HandoffClaim) else None
        slots = self.ctx.slots
        try:
            taken = slots.take(self.plan.handoff_id, self, wait, kv_first=not self.claim)
            # queued: until the grant, the wait's end, or the client's leaving
            if not isinstance(taken, int) and not await slots.granted_unless(taken, self._aborted.wait()):
                return False
        except SlotRefused as refused:
            if slots.job(self.plan.handoff_id) is not None:
                self._kv_released = True  # the KV under that handoff is the job's that holds it
            self._release_kv()  # before the answer, as every refusal
            err = refused.error()
            self._count(err.status, err)
            if self.abort_reason != "client_disconnected":
                start, body = error_response_parts(err, headers)
                await send(start)
                await send(body)
            return False
        self.holds_slot = True
        self._kv_released = False  # the KV may come now: the router prefills on the 200
        self.ctx.metrics.slot_wait.observe(time.monotonic() - self.arrived)
        if self.abort_reason is not None:  # aborted as the slot came: given back by close()
            return False
        return True

    async def _next_delta(self, renderer: Any) -> Delta:
        """The next delta to send: a step's tokens through the text half of the processing; a
        replayed output (a resumed sequence's) goes to ``renderer`` on the way, unsent. Once the
        job is aborted, what its worker posted before is dropped, not rendered: a client that
        stopped reading may have left thousands of steps queued behind its writes, and rendering
        them would hold the loop (and the slot) for nothing."""
        while True:
            item = await self._queue.get()
            if item is _ABORTED or self.abort_reason is not None:
                raise Cancelled(f"request {self.request_id!r} was cancelled ({self.abort_reason})")
            if isinstance(item, ApiError):
                raise item
            proc = self._proc
            assert proc is not None  # set by the worker before it posts a step
            if isinstance(item, _Replayed):
                delta = proc.text(item.cut)
                end = Delta(finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
                delta.finish_reason = delta.stop_reason = None
                renderer.add(delta)
                if end.finish_reason:  # the output so far had ended the sequence: its end is left to send
                    return end
                continue
            if proc.finished:  # a step the engine ran before it heard of a stop string
                continue
            delta = proc.text(item.cut, item.first_logprob)
            metrics = self.ctx.metrics
            if item.seconds:
                metrics.step(len(delta.token_ids), item.seconds)
                metrics.spec(item.drafted, item.accepted)
            if delta.finish_reason and not item.cut.finish_reason:  # a stop string: no more steps
                self._stop.set()
            return delta

    async def _stream(self, send: Any, renderer: Any) -> None:
        progress = self.plan.progress
        out = [] if self.plan.resume is not None else [sse(c) for c in renderer.start()]
        while True:
            delta = await self._next_delta(renderer)
            out.extend(sse(c) for c in renderer.add(delta))
            if delta.finish_reason:
                break
            if progress:  # ends the write: what it holds stands for these tokens (none: a step all the same)
                out.append(progress_line(delta.token_ids))
            if out:
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                out = []
        out.extend(sse(c) for c in renderer.end())
        out.append(DONE)
        if progress:
            out.append(progress_line(delta.token_ids))
        await send({"type": "http.response.body", "body": b"".join(out)})

    async def _full(self, send: Any, renderer: Any, headers: list[tuple[bytes, bytes]]) -> None:
        progress = self.plan.progress  # a claim's answer: its 200 went out at the grant, unsized
        while True:
            delta = await self._next_delta(renderer)
            renderer.add(delta)
            if progress:
                await send({"type": "http.response.body", "body": progress_line(delta.token_ids), "more_body": True})
            if delta.finish_reason:
                break
        body = dumps(renderer.full())
        self._count(200)
        await send({"type": "http.response.start", "status": 200,
                    "headers": JSON_HEADERS + [(b"content-length", str(len(body)).encode())] + headers})
        await send({"type": "http.response.body", "body": body})

    def _count(self, status: int, err: ApiError | None = None) -> None:
        self.obs.answered(status, err.type if err is not None else None)
        self.ctx.metrics.requests.labels(self.endpoint_label, str(status)).inc()
        if err is not None:
            self.ctx.metrics.errors.labels(err.type).inc()


class GenerationResponse(Response):
    """ASGI response running one :class:`Job` while watching for the client leaving.

    (A Starlette ``Response`` only so that FastAPI passes it through; the status and
    body are decided while it runs.)"""

    def __init__(self, job: Job, headers: list[tuple[bytes, bytes]]) -> None:
        self.job = job
        self._extra_headers = headers
        self.status_code = 200
        self.background = None

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            await self.job.run(self._safe_send(send), self._extra_headers)
        finally:
            watcher.cancel()
            self.job.close()
            self.job.obs.finish(self.job.abort_reason)

    def _safe_send(self, send: Any) -> Any:
        """``send``, given up (the job aborted) when the client is gone, or takes no bytes for
        the write timeout (a client that stopped reading: a router SIGSTOPped mid-stream would
        hold the slot for ever)."""
        limit = self.job.ctx.write_timeout

        async def wrapped(message: dict) -> None:
            if self.job.abort_reason in ("client_disconnected", "client_stalled"):
                return
            try:
                async with asyncio.timeout(limit):
                    await send(message)
            except TimeoutError:  # (an OSError too: first)
                log.warning("request %s: its client took no bytes for %gs; ending it", self.job.request_id, limit)
                self.job.abort("client_stalled")
            except OSError:
                self.job.abort("client_disconnected")
        return wrapped

    async def _watch(self, receive: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.job.abort("client_disconnected")
                return
