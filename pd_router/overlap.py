"""Prefill and decode at once, the first token with the KV (issue 34).

When the decode needs nothing of vLLM's answer (:func:`decode_check.result_with_kv`), the
prefill asks the connector to send its result (the first token) to the decode server over
the KV channel (``HandoffTarget.result_with_kv``), and the decode request goes out at the
same time, naming only the handoff (``HandoffClaim``). The decode server answers once the
KV and the first token have landed; its first event goes to the client at once. vLLM's
answer is read beside it: for the handoff's failures (which it classifies: busy, too
long, cancelled, failed) and the prompt's length, never waited for before the first token.

Whatever ends first, nothing is left behind: a failed prefill closes the decode request
(the decode server frees what it held for it), a decode that failed before its first byte
waits for the prefill's answer (its failure says more: a busy KV slot is a requeue, not a
failed server), and the prefill's answer is read to its end after a clean decode.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_grammar.spec import GrammarSpec
from pd_router import decode_check, prefill_leg, relay
from pd_router.backends import DecodeBackend
from pd_router.context import RequestContext
from pd_router.errors import RouterError, UpstreamRejected
from pd_router.lease_client import Answer
from pd_router.slots import Lease
from pd_wire.handoff import HandoffClaim, SlotWait
from pd_wire.requests import OpenAIRequest

if TYPE_CHECKING:
    from pd_router.rawhttp import Response
    from pd_router.state import RouterState

log = logging.getLogger("pd_router.requests")


async def prefill_and_decode(
    state: RouterState, ctx: RequestContext, lease: Lease, body: dict[str, Any], request: OpenAIRequest,
    handoff_id: str, grammar: GrammarSpec | None, trace: Mapping[str, str] | None = None,
) -> bool:
    """Run both legs on one lease; True when the answer ended cleanly. Raises as the
    sequential legs do (``ctx.stage`` says which leg failed). An implicit lease (no lease was
    asked: :attr:`Lease.implicit`): the decode request goes first and takes the slot, and the
    prefill goes out on its 200 (the grant); not taken, :class:`SlotNotTaken`, no prefill run."""
    claim = HandoffClaim(handoff_id=handoff_id, result="with_kv", grant_first=lease.implicit).model_dump(
        exclude_none=True)
    granted: Response | None = None
    if lease.implicit:
        ctx.stage = "decode"  # a failure to take the slot is the decode leg's
        granted = lease.take_opened()  # granted in the server's queue (:class:`StandingDecode`)
        if granted is None:
            granted = await relay.open_answer(state, ctx, lease, body, claim, trace)
        ctx.stage = "prefill"
    prefill = asyncio.ensure_future(
        prefill_leg.prefill(state, ctx, lease, body, request, handoff_id, grammar, result_with_kv=True))
    # the decode leg is what remains once the prefill answered well (an unstreamed answer
    # opens only when whole): the stage a failure or a client leaving is counted under
    prefill.add_done_callback(lambda leg: _prefilled(ctx, leg))
    opening = asyncio.ensure_future(relay.open_answer(state, ctx, lease, body, claim, trace) if granted is None
                                    else relay.first_event(state, lease, granted))
    relayed = False
    try:
        await asyncio.wait({prefill, opening}, return_when=asyncio.FIRST_COMPLETED)
        if opening.done() and isinstance(opening.exception(), UpstreamRejected):
            ctx.stage = "decode"
            opening.result()  # the decode server refused the request itself: the prefill's end follows from it
        if prefill.done():
            prefill.result()  # its failure first: the decode request is closed below
        resp = await _opened(ctx, prefill, opening)
        ctx.stage = "decode"
        relayed = True  # the relay gives the connection back
        clean = await relay.relay(state, ctx, lease, resp, body, request)
        if clean:
            await _answered(ctx, prefill)
        return clean
    finally:
        for leg in (opening, prefill):
            if not leg.done():
                leg.cancel()  # a decode request closed: the decode server frees what it held for it
            elif not leg.cancelled() and leg.exception() is None and leg is opening and not relayed:
                opening.result().close()  # opened as the prefill failed: closed the same way
        if granted is not None and not relayed:
            granted.close()  # (a no-op when its connection went back or was closed already)


@dataclass(eq=False)
class StandingDecode:
    """One attempt's decode request as its standing request in a decode server's queue
    (:class:`pd_router.lease_types.DecodeFirst`), to one of our servers that would take it as it
    is (no 400 of its own): its result comes with the KV, or is posted when its decode needs
    vLLM's answer (:func:`prefill_then_post`)."""

    state: RouterState
    ctx: RequestContext
    body: dict[str, Any]
    request: OpenAIRequest
    handoff_id: str
    trace: Mapping[str, str] | None = None  # the ``traceparent`` of the router's queue span, where it waits

    def fits(self, backend: DecodeBackend) -> bool:
        caps = backend.capabilities
        return caps is not None and decode_check.refusal(self.request, caps) is None

    async def open(self, backend: DecodeBackend, wait: SlotWait) -> Answer:
        caps = backend.capabilities
        with_kv = decode_check.result_with_kv(self.body, self.request, caps,
                                              decode_check.prefill_fields(self.request, caps))
        claim = HandoffClaim(handoff_id=self.handoff_id, result="with_kv" if with_kv else "posted", grant_first=True,
                             wait=wait)
        return await relay.open_standing(self.state, self.ctx, backend, self.body, claim.model_dump(exclude_none=True),
                                         self.trace)


async def prefill_then_post(
    state: RouterState, ctx: RequestContext, lease: Lease, body: dict[str, Any], request: OpenAIRequest,
    handoff_id: str, grammar: GrammarSpec | None, trace: Mapping[str, str] | None = None,
) -> bool:
    """A request whose decode needs vLLM's answer (the first token's logprobs, the prompt's ids)
    on a slot its decode request holds (:attr:`Lease.implicit`): that request first (granted in
    the server's queue, or taking a free slot now: :class:`SlotNotTaken` when it does not), the
    prefill on its 200, then the result read from vLLM's answer posted to the decode server
    (``HandoffClaim.result == "posted"``), whose first event then comes. True when the answer
    ended cleanly; raises as the sequential legs do."""
    granted = lease.take_opened()
    if granted is None:
        ctx.stage = "decode"  # a failure to take the slot is the decode leg's
        claim = HandoffClaim(handoff_id=handoff_id, result="posted", grant_first=True)
        granted = await relay.open_answer(state, ctx, lease, body, claim.model_dump(exclude_none=True), trace)
    relayed = False
    try:
        ctx.stage = "prefill"
        params = await prefill_leg.prefill(state, ctx, lease, body, request, handoff_id, grammar)
        ctx.stage = "decode"
        await relay.post_result(state, ctx, lease, params)
        resp = await relay.first_event(state, lease, granted)
        relayed = True  # the relay gives the connection back
        return await relay.relay(state, ctx, lease, resp, body, request)
    finally:
        if not relayed:
            granted.close()  # the decode request closed: the decode server frees what it held for it


def _prefilled(ctx: RequestContext, leg: asyncio.Future[Any]) -> None:
    if not leg.cancelled() and leg.exception() is None and ctx.stage == "prefill":
        ctx.stage = "decode"


async def _opened(ctx: RequestContext, prefill: asyncio.Future[Any], opening: asyncio.Future[Response]) -> Response:
    """The open decode answer. When the decode server refused the request (its 4xx, after
    giving slot and KV back), that refusal: the prefill, refused the KV for it, would only
    say "cancelled". When the decode request failed otherwise before its first byte, the
    prefill's own failure if it has one (it knows why the KV did not come), else the decode's."""
    try:
        return await opening
    except UpstreamRejected:
        ctx.stage = "decode"
        raise
    except RouterError:
        await asyncio.wait({prefill})
        prefill.result()
        ctx.stage = "decode"
        raise


async def _answered(ctx: RequestContext, prefill: asyncio.Future[Any]) -> None:
    """vLLM's answer after a clean decode (it came long before, as the first token did): its
    connection goes back to the pool, its prompt count to the access log. A failure now
    changes nothing the client got."""
    try:
        await prefill
    except RouterError as err:
        log.warning("request_id=%s: the prefill answered %s after its decode ended cleanly", ctx.request_id,
                    err.message)
    except Exception:  # a bug reading it: logged, the client's answer is whole
        log.exception("request_id=%s: reading the prefill's answer after a clean decode failed", ctx.request_id)
