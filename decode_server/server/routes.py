"""HTTP routes of the decode server (contract: :mod:`pd_wire.decode`)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from decode_server.server.api_errors import ApiError, InvalidRequest, NotFound, NotReady, validation_message
from decode_server.server.generation import GenerationResponse, Job
from decode_server.server.observe import RequestObservation
from decode_server.server.request_plan import build_plan
from decode_server.server.state import DecodeState
from pd_wire.decode import (
    CANCEL_PATH,
    CAPABILITIES_PATH,
    REQUEST_ID_HEADER,
    RESULT_PATH,
    CancelRequest,
    CancelResponse,
    DecodeCapabilities,
)
from pd_wire.handoff import PROTOCOL_VERSION, HandoffClaim, HandoffResult
from pd_wire.requests import MODELS, Endpoint

router = APIRouter()
MAX_HANDOFF_ID = 256  # as connector.protocol.HandoffResult allows
CANCEL_WAIT_S = 5.0  # the cancel endpoint answers once the generation gave its slot back, or after this


def _state(request: Request) -> DecodeState:
    return request.app.state.decode


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> Response:
    if err.status in (429, 503):  # every "not now" says when to come back
        headers = {"Retry-After": "1", **(headers or {})}
    return Response(err.body(), status_code=err.status, media_type="application/json", headers=headers)


async def _read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc


def _validate(body: Any, model: type[Any]) -> Any:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    if "kv_transfer_params" not in body or body["kv_transfer_params"] is None:
        raise InvalidRequest("kv_transfer_params is required: this decode server only continues prefilled "
                             "requests (send requests through the PD router)", "kv_transfer_params")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_url=False))
        raise InvalidRequest(message, param) from exc


async def parse_body(request: Request, model: type[Any]) -> Any:
    """The request's JSON body as ``model``; an invalid one raises its 400."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_url=False))
        raise InvalidRequest(message, param) from exc


def handoff_id_of(body: Any) -> str | None:
    """``kv_transfer_params.handoff_id`` of a request body, read leniently: also from a body
    that fails validation, so that a refused request's KV can be given back."""
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    handoff_id = params.get("handoff_id") if isinstance(params, dict) else None
    return handoff_id if isinstance(handoff_id, str) and 0 < len(handoff_id) <= MAX_HANDOFF_ID else None


def _release_refused(state: DecodeState, body: Any) -> None:
    """Give back the KV receive slot of a request refused before it became a :class:`Job`
    (the KV of a client that prefilled elsewhere came before this server saw the request). Not
    when a decode request holds that handoff here (a duplicate). The release of a claim leaves
    no tombstone: its prefill goes out only on its 200, so no KV is on its way, and a tombstone
    would refuse the KV of its next try under that id."""
    handoff_id = handoff_id_of(body)
    if handoff_id is None or state.receiver is None or state.slots.job(handoff_id) is not None:
        return
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    state.receiver.release(handoff_id, tombstone=not (isinstance(params, dict) and "result" in params))


async def _generate(request: Request, endpoint: Endpoint) -> Response:
    state = _state(request)
    request_id = request.headers.get(REQUEST_ID_HEADER) or f"decode-{uuid.uuid4().hex}"
    headers = {REQUEST_ID_HEADER: request_id}
    label = endpoint.label
    obs = RequestObservation(state.tracing, request.url.path, request_id, request.scope["headers"])
    body: Any = None
    try:
        body = await _read_json(request)
        req = _validate(body, MODELS[endpoint])
        if not state.ready or state.context is None or state.limits is None:
            raise NotReady(f"decode server not ready: {state.not_ready_reason()}")
        plan = build_plan(endpoint, req, request_id, state.limits, state.defaults)
        obs.stage = "slot"
        job = Job(state.context, plan, label, obs)  # it takes its slot as it runs (now, or after a wait)
    except ApiError as err:
        _release_refused(state, body)  # every refusal gives the KV back before answering
        state.metrics.requests.labels(label, str(err.status)).inc()
        state.metrics.errors.labels(err.type).inc()
        obs.answered(err.status, err.type)
        obs.finish()
        return error_response(err, headers)
    return GenerationResponse(job, [(REQUEST_ID_HEADER.lower().encode(), request_id.encode())])


@router.post(Endpoint.COMPLETIONS.path)
async def completions(request: Request) -> Response:
    return await _generate(request, Endpoint.COMPLETIONS)


@router.post(Endpoint.CHAT.path)
async def chat_completions(request: Request) -> Response:
    return await _generate(request, Endpoint.CHAT)


@router.get(CAPABILITIES_PATH)
async def capabilities(request: Request) -> Response:
    state = _state(request)
    if not state.ready or state.receiver is None or state.engine is None or state.limits is None:
        return error_response(NotReady(f"decode server not ready: {state.not_ready_reason()}"))
    cfg, receiver = state.config, state.receiver
    caps = DecodeCapabilities(
        protocol_version=PROTOCOL_VERSION, model=cfg.served_model_name, engine=cfg.engine, slots=cfg.slots,
        busy_slots=state.slots.busy, kv_busy_slots=receiver.busy_slots(), max_seq_len=cfg.max_seq_len,
        num_mtp=cfg.num_mtp, kv_endpoint=receiver.endpoint, layout_fingerprint=receiver.fingerprint,
        peers=receiver.peers(),
        features=state.limits.features, sampling_defaults=state.defaults.sampling,
        share_clock=dict(state.slots.share_clock),
        kept=state.slots.kept(),
    )
    return Response(caps.model_dump_json(), media_type="application/json")


@router.post(CANCEL_PATH)
async def cancel(request: Request) -> Response:
    """Stop the generation of the request's handoff and answer once its slot and KV are given
    back; with no generation under that handoff, take its decode request out of the queue and
    free the handoff in the receiver (an unclaimed KV, or a tombstone that refuses the KV if it
    comes later)."""
    try:
        body: CancelRequest = await parse_body(request, CancelRequest)
    except ApiError as err:
        return error_response(err)
    state = _state(request)
    handoff_id = body.handoff_id or body.request_id
    job = state.slots.job(handoff_id)
    if job is None and body.handoff_id is None:  # a client of this server's own API, by its request id
        job = state.slots.job_of_request(body.request_id)
    if job is not None and job.request_id != body.request_id:
        job = None  # another request's handoff: leave that generation alone
    cancelled = False
    if isinstance(job, Job):
        cancelled = job.abort("cancelled")
        await job.given_back(CANCEL_WAIT_S)
    else:
        state.slots.cancel(handoff_id)
        if state.receiver is not None:
            state.receiver.release(handoff_id)
    return Response(CancelResponse(request_id=body.request_id, cancelled=cancelled).model_dump_json(),
                    media_type="application/json")


@router.post(RESULT_PATH)
async def post_result(request: Request) -> Response:
    """The result of a claim whose result is posted (``HandoffClaim.result == "posted"``): vLLM's
    answer as the router read it, for the request waiting under that handoff with its KV."""
    try:
        result: HandoffResult = await parse_body(request, HandoffResult)
    except ApiError as err:
        return error_response(err)
    state = _state(request)
    job = state.slots.job(result.handoff_id)
    waiting = (isinstance(job, Job) and isinstance(job.plan.handoff, HandoffClaim)
               and job.plan.handoff.result == "posted")
    if not waiting or state.receiver is None or not await state.receiver.post_result(result):
        return error_response(NotFound(f"no request waits here for the result of handoff {result.handoff_id!r} "
                                       "(its KV did not come, or it ended)", "handoff_id"))
    return Response(status_code=204)


@router.get("/health")
async def health() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


@router.get("/ready")
async def ready(request: Request) -> Response:
    state = _state(request)
    if state.ready:
        return Response(b'{"status":"ready"}', media_type="application/json")
    return error_response(NotReady(f"decode server not ready: {state.not_ready_reason()}"))


@router.get("/v1/models")
async def models(request: Request) -> Response:
    name = _state(request).config.served_model_name
    body = {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "decode_server",
                                         "max_model_len": _state(request).config.max_seq_len}]}
    return Response(json.dumps(body), media_type="application/json")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
