"""The router's own answers as pydantic models: OpenAI-shaped errors, the ``/ready``
report and the ``/v1/models`` list. Clients, tests and probes parse them with these."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from connector.protocol import PeerStatus


class ErrorDetail(BaseModel):
    model_config = ConfigDict(frozen=True)

    message: str
    type: str  # also the error_type label of pd_router_requests_total
    param: str | None = None
    code: str | int | None = None


class ErrorBody(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI answers errors."""

    model_config = ConfigDict(frozen=True)

    error: ErrorDetail


class PrefillStatus(BaseModel):
    url: str
    healthy: bool
    reason: str
    models: list[str]
    in_flight: int


class DecodeStatus(BaseModel):
    url: str
    healthy: bool
    compatible: bool
    reason: str | None  # why it cannot take requests ("ok" when it can)
    models: list[str]
    engine: str | None  # capabilities.engine, "plain" without a capabilities endpoint
    slots: int | None  # None: unlimited
    in_use: int
    peers: list[PeerStatus]


class ReadinessReport(BaseModel):
    """``GET /ready``: 200 when ``ready``, else 503; ``problems`` says which backend is
    not usable and why, one line each."""

    ready: bool
    problems: list[str]
    prefill: list[PrefillStatus]
    decode: list[DecodeStatus]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "pd_router"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
