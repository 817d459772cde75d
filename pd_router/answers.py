"""The router's own answers as pydantic models: the ``/ready`` report, the ``/v1/models``
list, the admin API's bodies (its OpenAI-shaped errors are :mod:`pd_wire.errors`). Clients,
tests and probes parse them with these."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from pd_build.info import BuildInfo
from pd_settings.servers import check_url
from pd_wire.handoff import PeerStatus


class PrefillStatus(BaseModel):
    url: str
    healthy: bool
    reason: str
    models: list[str]
    in_flight: int
    draining: bool = False  # removed (servers file, DNS, admin API): finishing what it has
    load: float = 0.0  # what --prefill-policy least-loaded compares (docs/router.md)


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
    draining: bool = False  # removed: no new requests, finishing what it has


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
    # what serves it: the build info of every backend reporting this model (see /version)
    build: list[BuildInfo] = []


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class BackendBuild(BaseModel):
    """One backend's build info as its ``/metrics`` says (``*_build_info``), or why not."""

    role: Literal["prefill", "decode"]
    url: str
    build: list[BuildInfo]  # one per engine / process reporting it; empty when unreachable
    error: str | None = None


class VersionReport(BaseModel):
    """``GET /version``: the router's own build info and each backend's, asked at once."""

    router: BuildInfo
    backends: list[BackendBuild]


class BackendChange(BaseModel):
    """``POST /admin/backends`` (add) and ``DELETE /admin/backends`` (remove: drain, then drop)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["prefill", "decode"]
    url: str

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_url(value)


BackendState = Literal["ready", "unhealthy", "draining"]


class BackendEntry(BaseModel):
    """One server as the router uses it: where it came from and its state."""

    role: Literal["prefill", "decode"]
    url: str
    sources: list[str]  # static, file, dns, admin
    state: BackendState
    reason: str | None  # why it is not ready
    in_flight: int  # prefill requests in flight, or decode slots held


class BackendList(BaseModel):
    """``GET /admin/backends``."""

    backends: list[BackendEntry]
