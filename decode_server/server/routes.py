"""HTTP routes of the decode server (contract: :mod:`pd_router.contract`)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from connector.protocol import PROTOCOL_VERSION
from decode_server.server.app import DecodeState
from decode_server.server.errors import ApiError, InvalidRequest, NotReady, validation_message
from decode_server.server.generation import GenerationResponse, Job
from decode_server.server.protocol import ChatCompletionRequest, CompletionRequest, Endpoint
from decode_server.server.sampling import build_plan
from pd_router.contract import (
    CANCEL_PATH,
    CAPABILITIES_PATH,
    REQUEST_ID_HEADER,
    CancelRequest,
    CancelResponse,
    DecodeCapabilities,
)

router = APIRouter()

_MODELS: dict[Endpoint, type[CompletionRequest | ChatCompletionRequest]] = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
}


def _state(request: Request) -> DecodeState:
    return request.app.state.decode


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> Response:
    return Response(err.json_bytes(), status_code=err.status, media_type="application/json", headers=headers)


async def _parse(request: Request, model: type[Any]) -> Any:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
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


async def _generate(request: Request, endpoint: Endpoint) -> Response:
    state = _state(request)
    request_id = request.headers.get(REQUEST_ID_HEADER) or f"decode-{uuid.uuid4().hex}"
    headers = {REQUEST_ID_HEADER: request_id}
    label = "chat" if endpoint == "chat" else "completions"
    try:
        req = await _parse(request, _MODELS[endpoint])
        if not state.ready or state.context is None or state.limits is None:
            raise NotReady(f"decode server not ready: {state.not_ready_reason()}")
        plan = build_plan(endpoint, req, request_id, state.limits, state.defaults)
        job = Job(state.context, plan, label)
        job.slot = state.slots.acquire(request_id, job)
    except ApiError as err:
        state.metrics.requests.labels(label, str(err.status)).inc()
        state.metrics.errors.labels(err.error_type).inc()
        return error_response(err, headers)
    return GenerationResponse(job, [(REQUEST_ID_HEADER.lower().encode(), request_id.encode())])


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, "completions")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


@router.get(CAPABILITIES_PATH)
async def capabilities(request: Request) -> Response:
    state = _state(request)
    if not state.ready or state.receiver is None or state.engine is None:
        return error_response(NotReady(f"decode server not ready: {state.not_ready_reason()}"))
    cfg, receiver = state.config, state.receiver
    caps = DecodeCapabilities(
        protocol_version=PROTOCOL_VERSION, model=cfg.served_model_name, engine=cfg.engine, slots=cfg.slots,
        busy_slots=state.slots.busy, max_seq_len=cfg.max_seq_len, num_mtp=cfg.num_mtp,
        kv_endpoint=receiver.endpoint, layout_fingerprint=receiver.fingerprint, peers=receiver.peers(),
    )
    return Response(caps.model_dump_json(), media_type="application/json")


@router.post(CANCEL_PATH)
async def cancel(request: Request) -> Response:
    try:
        body = CancelRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_url=False))
        return error_response(InvalidRequest(message, param))
    job = _state(request).slots.job(body.request_id)
    cancelled = bool(job is not None and job.abort("cancelled"))
    return Response(CancelResponse(request_id=body.request_id, cancelled=cancelled).model_dump_json(),
                    media_type="application/json")


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
