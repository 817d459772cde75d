"""The lease endpoints of the decode server (contract: :mod:`pd_wire.decode`):
acquire (a long poll in the server's queue), renew, release."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from decode_server.server.api_errors import ApiError, NotReady
from decode_server.server.leases import LeaseRefused, LeaseTable
from decode_server.server.routes import error_response, parse_body
from decode_server.server.slot_table import refusal_error
from decode_server.server.state import DecodeState
from pd_wire.decode import (
    LEASE_PATH,
    LEASE_RELEASE_PATH,
    LEASE_RENEW_PATH,
    LeaseGrant,
    LeaseIds,
    LeaseReleased,
    LeaseRenewed,
    LeaseRequest,
)

router = APIRouter()


def _state(request: Request) -> DecodeState:
    return request.app.state.decode


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post(LEASE_PATH)
async def acquire(request: Request) -> Response:
    """A slot now, or after a wait in the queue; the caller leaving takes it out of the queue."""
    state = _state(request)
    try:
        body: LeaseRequest = await parse_body(request, LeaseRequest)
        if not state.ready:
            raise NotReady(f"decode server not ready: {state.not_ready_reason()}")
    except ApiError as err:
        return error_response(err)
    leases = state.slots.leases
    state.metrics.lease_requests.inc()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        # the common case (a free slot, nobody waiting) is answered here, without a task
        slot = leases.grant_now(body.lease_id, body.replaces)
        if slot is None:
            slot = await _wait_for_slot(request, leases, body)
    except LeaseRefused as exc:
        return error_response(refusal_error(exc))
    if slot is None:  # the caller went away while it waited
        return Response(status_code=499)
    state.metrics.lease_wait.observe(loop.time() - t0)
    return _json(LeaseGrant(lease_id=body.lease_id, slot=slot, ttl_s=leases.ttl_s, free=leases.free,
                            queued=leases.queued))


async def _wait_for_slot(request: Request, leases: LeaseTable, body: LeaseRequest) -> int | None:
    """A slot after a wait in the queue (refusals raised as by :meth:`LeaseTable.acquire`);
    None when the caller went away first."""
    grant = asyncio.ensure_future(leases.acquire(body.lease_id, body.wait_s, body.holder, body.arrived_at,
                                                body.sent_at, body.replaces))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({grant, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not grant.done():
            grant.cancel()
    try:
        return await grant
    except asyncio.CancelledError:
        if not grant.cancelled():
            raise
        return None


@router.post(LEASE_RENEW_PATH)
async def renew(request: Request) -> Response:
    try:
        body: LeaseIds = await parse_body(request, LeaseIds)
    except ApiError as err:
        return error_response(err)
    leases = _state(request).slots.leases
    return _json(LeaseRenewed(ttl_s=leases.ttl_s, unknown=leases.renew(body.lease_ids)))


@router.post(LEASE_RELEASE_PATH)
async def release(request: Request) -> Response:
    try:
        body: LeaseIds = await parse_body(request, LeaseIds)
    except ApiError as err:
        return error_response(err)
    leases = _state(request).slots.leases
    return _json(LeaseReleased(released=leases.release(body.lease_ids), free=leases.free))
