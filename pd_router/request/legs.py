"""An attempt's legs: the decode request first, then the prefill, the first token with the KV.

An attempt's decode request (:class:`DecodeRequest`, its ``kv_transfer_params`` a
``HandoffClaim``, sent by :func:`open_slot`) goes to a decode server of ours before anything
else and holds its slot: the server answers 200 once the slot is the request's (the pool,
:mod:`pd_router.slots.pool`, hands the attempt that open answer). The prefill goes out on that
200. When the decode needs nothing of vLLM's answer
(:meth:`pd_router.request.checks.ValidRequest.with_kv`), the prefill asks the connector to send
its result (the first token) to the decode server over the KV channel
(``HandoffTarget.result_with_kv``): the decode server's first event comes once the KV and the
first token landed, and goes to the client at once. vLLM's answer is read beside it, for the
handoff's failures (which it classifies: busy, too long, cancelled, failed) and the prompt's
length, never waited for before the first token. Otherwise the router posts the result it read
from vLLM's answer (:func:`post_and_relay`).

Whatever ends first, nothing is left behind: a failed prefill closes the decode request (the
decode server frees what it held for it), a decode that failed before its first byte waits for
the prefill's answer (its failure says more: a busy KV slot is a requeue, not a failed server),
and the prefill's answer is read to its end after a clean decode.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

from pd_router.apis.completions import decode_body
from pd_router.errors import RouterError, Unavailable, Unreachable, UpstreamRejected
from pd_router.fleet.backends import DecodeBackend
from pd_router.request import prefill, relay
from pd_router.request.context import Attempt, RequestContext
from pd_router.request.stages import Stage
from pd_router.slots.fair import Place
from pd_router.slots.pool import Answer
from pd_router.upstream import calls
from pd_wire.decode import FREE_SLOTS_FIELD
from pd_wire.handoff import HandoffClaim, KeepKey, SlotWait

if TYPE_CHECKING:
    from pd_router.state import RouterState
    from pd_router.upstream.rawhttp import Response

log = logging.getLogger("pd_router.requests")
# a decode request asking for a free slot without waiting is answered at once by a live server
# (a round trip): one that says nothing for this long is hung (SIGSTOPped, its loop stuck)
IMMEDIATE_ANSWER_S = 2.0


async def prefill_and_decode(state: RouterState, ctx: RequestContext, attempt: Attempt) -> bool:
    """The prefill on a slot its decode request holds (its 200 came), the first token with the
    KV; True when the answer ended cleanly. Raises as the sequential legs do (``ctx.stage`` says
    which leg failed)."""
    slot = attempt.slot
    granted = slot.take_opened()
    assert granted is not None  # a slot of a server of ours holds its open decode request
    ctx.stage = Stage.PREFILL
    handoff = asyncio.ensure_future(prefill.handoff(state, ctx, attempt, result_with_kv=True))
    # the decode leg is what remains once the prefill answered well (an unstreamed answer
    # opens only when whole): the stage a failure or a client leaving is counted under
    handoff.add_done_callback(lambda leg: _prefilled(ctx, leg))
    opening = asyncio.ensure_future(relay.first_event(state, slot, granted))
    relayed = False
    try:
        await asyncio.wait({handoff, opening}, return_when=asyncio.FIRST_COMPLETED)
        if opening.done() and isinstance(opening.exception(), UpstreamRejected):
            ctx.stage = Stage.DECODE
            opening.result()  # the decode server refused the request itself: the prefill's end follows from it
        if handoff.done():
            handoff.result()  # its failure first: the decode request is closed below
        resp = await _opened(ctx, handoff, opening)
        ctx.stage = Stage.DECODE
        relayed = True  # the relay gives the connection back
        clean = await relay.relay(state, ctx, slot, resp)
        if clean:
            await _answered(ctx, handoff)
        return clean
    finally:
        for leg in (opening, handoff):
            if not leg.done():
                leg.cancel()  # a decode request closed: the decode server frees what it held for it
        if not relayed:
            granted.close()  # (a no-op when its connection went back or was closed already)


@dataclass(eq=False)
class DecodeRequest:
    """An attempt's decode request (the pool's :class:`~pd_router.slots.queue.SlotClaimant`), sent
    to a decode server of ours before its prefill to hold its slot: its result comes with the KV,
    or is posted when its decode needs vLLM's answer (:func:`post_and_relay`). With conversation
    keys (``ctx.keys``) its claim asks the server to keep the answer's KV (``HandoffClaim.keep``)."""

    state: RouterState
    ctx: RequestContext
    handoff_id: str
    trace: Mapping[str, str] | None = None  # the ``traceparent`` of the router's queue span, where it waits
    # per decode server asked: the kept key its claim continues (HandoffClaim.keep.continues), None for none
    continued: dict[str, str | None] = field(default_factory=dict)

    @property
    def place(self) -> Place:
        place = self.ctx.place
        assert place is not None  # set before its first wait (pd_router.request.attempts)
        return place

    @property
    def tenant(self) -> str:
        return self.ctx.tenant.name

    @property
    def prefixes(self) -> Mapping[str, int] | None:
        keys = self.ctx.keys
        return keys.prefixes if keys is not None else None

    def keep(self, backend: DecodeBackend) -> KeepKey | None:
        """The claim's ``keep`` for ``backend`` (a server of ours; none without conversation
        keys): it continues the kept key there that is the request's longest prefix, if any."""
        keys = self.ctx.keys
        if keys is None or backend.capabilities is None:
            return None
        match = backend.kept.match(keys.prefixes)
        continues = self.continued[backend.url] = match[0] if match is not None else None
        return keys.keep(continues)

    async def open(self, backend: DecodeBackend, wait: SlotWait | None) -> Answer:
        ctx = self.ctx
        refused = ctx.request.refusal(backend.capabilities)
        if refused is not None:  # what this server would refuse is refused here: no call
            return Answer(400, rejected=refused)
        # a resumed sequence's first token is the engine's (its logprobs too), its prompt's ids in the resume
        with_kv = ctx.resume is not None or ctx.request.with_kv(backend.capabilities)
        claim = HandoffClaim(handoff_id=self.handoff_id, result="with_kv" if with_kv else "posted", wait=wait,
                             progress=True, created=ctx.created or None, resume=ctx.resume, keep=self.keep(backend))
        return await open_slot(self.state, ctx, backend, claim.model_dump(exclude_none=True), self.trace)


async def open_slot(state: RouterState, ctx: RequestContext, backend: DecodeBackend, claim: dict[str, Any],
                    trace: Mapping[str, str] | None = None) -> Answer:
    """A request's decode request holding its slot (``claim``: a ``HandoffClaim``; with ``wait``,
    it waits in ``backend``'s queue): open once granted (``Answer.opened``), else the status that
    refused it, the request's own refusal, or no answer (0: unreachable, or silent past its wait:
    hung). ``trace``: the ``traceparent`` header (of the router's queue span, where the request
    waits, or of its decode span)."""
    wait = claim.get("wait")
    wait_s = wait["wait_s"] if wait else 0.0
    limit = wait_s + relay.CALL_TIMEOUT_S if wait_s > 0 else IMMEDIATE_ANSWER_S
    data = decode_body(ctx.raw, ctx.request.body, claim)
    t0 = perf_counter()
    try:
        resp = await calls.open_decode(state.connections, backend.target, ctx.endpoint.path, data, ctx.request_id,
                                       max(limit, state.settings.decode_timeout), trace, limit)
    except UpstreamRejected as err:  # a 429 or 409 refuses the slot request; another 4xx, the request itself
        return Answer(err.status, rtt=perf_counter() - t0, rejected=None if err.status in (409, 429) else err)
    except Unreachable as err:
        return Answer(0, rtt=perf_counter() - t0, unreachable=err.message)
    except Unavailable:  # draining, not ready
        return Answer(503, rtt=perf_counter() - t0)
    except RouterError:
        return Answer(0, rtt=perf_counter() - t0)
    resp.read_timeout = state.settings.decode_timeout  # granted: from here, a decode answer's timeout
    try:
        free = int(resp.headers.get(FREE_SLOTS_FIELD, b"0"))
    except ValueError:
        free = 0
    return Answer(200, rtt=perf_counter() - t0, immediate=wait_s == 0, opened=resp, free=max(0, free))


async def post_and_relay(state: RouterState, ctx: RequestContext, attempt: Attempt, params: dict[str, Any]) -> bool:
    """A request whose decode needs vLLM's answer (the first token's logprobs, the prompt's ids)
    on a slot its decode request holds, once the prefill answered: the result read from vLLM's
    answer (``params``) posted to the decode server (``HandoffClaim.result == "posted"``), whose
    first event then comes. True when the answer ended cleanly; raises as the sequential legs do."""
    slot = attempt.slot
    granted = slot.take_opened()
    assert granted is not None  # a slot of a server of ours holds its open decode request
    relayed = False
    try:
        await relay.post_result(state, ctx, slot, params)
        resp = await relay.first_event(state, slot, granted)
        relayed = True  # the relay gives the connection back
        return await relay.relay(state, ctx, slot, resp)
    finally:
        if not relayed:
            granted.close()  # the decode request closed: the decode server frees what it held for it


def _prefilled(ctx: RequestContext, leg: asyncio.Future[Any]) -> None:
    if not leg.cancelled() and leg.exception() is None and ctx.stage == Stage.PREFILL:
        ctx.stage = Stage.DECODE


async def _opened(ctx: RequestContext, handoff: asyncio.Future[Any], opening: asyncio.Future[Response]) -> Response:
    """The open decode answer. When the decode server refused the request (its 4xx, after
    giving slot and KV back), that refusal: the prefill, refused the KV for it, would only
    say "cancelled". When the decode request failed otherwise before its first byte, the
    prefill's own failure if it has one (it knows why the KV did not come), else the decode's."""
    try:
        return await opening
    except UpstreamRejected:
        ctx.stage = Stage.DECODE
        raise
    except RouterError:
        await asyncio.wait({handoff})
        handoff.result()
        ctx.stage = Stage.DECODE
        raise


async def _answered(ctx: RequestContext, handoff: asyncio.Future[Any]) -> None:
    """vLLM's answer after a clean decode (it came long before, as the first token did): its
    connection goes back to the pool, its prompt count to the access log. A failure now
    changes nothing the client got."""
    try:
        await handoff
    except RouterError as err:
        log.warning("request_id=%s: the prefill answered %s after its decode ended cleanly", ctx.request_id,
                    err.message)
    except Exception:  # a bug reading it: logged, the client's answer is whole
        log.exception("request_id=%s: reading the prefill's answer after a clean decode failed", ctx.request_id)
