"""``kv_connector_extra_config`` of :class:`connector.TileRTConnector`, validated once at start-up.

Example (the part under ``kv_connector_extra_config`` of ``--kv-transfer-config``)::

    {"profile": "tiny", "decode_endpoints": ["127.0.0.1:9100"],
     "handshake_timeout_s": 10, "admission_timeout_s": 5, "transfer_timeout_s": 30}

Unknown keys are rejected (a typo must not silently fall back to a default). A bad
value raises :class:`ConnectorConfigError` in the project's one settings error format
(:mod:`pd_settings.problems`): ``kv_connector_extra_config.<option>=<value>: <reason>``
for each problem, so vLLM refuses to start with an actionable error. vLLM hands the
connector this dict, so there is no command line or environment to read here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from connector.control import parse_endpoint
from pd_settings.problems import SettingsError, validate_mapping

ProfileName = Literal["auto", "tiny", "glm5.1"]
PREFIX = "kv_connector_extra_config."


class ConnectorConfigError(SettingsError):
    """An invalid ``kv_connector_extra_config``: names each option, value and reason."""


class ConnectorSettings(BaseModel):
    """What the connector needs besides vLLM's own config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: ProfileName = Field(
        default="auto",
        description="model profile: 'glm5.1', 'tiny' (N+1 MLA layers) or 'auto' (from the HF config)",
    )
    decode_endpoints: tuple[str, ...] = Field(
        default=(), description="host:port KV endpoints of decode servers, handshaken eagerly at start-up"
    )
    handshake_timeout_s: float = Field(default=10.0, gt=0, le=600)
    handshake_interval_s: float = Field(
        default=2.0,
        ge=0,
        le=3600,
        description="how often a background thread re-checks the handshake with every decode_endpoint "
        "(a decode server started after vLLM, or restarted, is handshaken again); 0: only at start-up",
    )
    admission_timeout_s: float = Field(default=5.0, gt=0, le=600)
    transfer_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="bound on the wait, after the last layer, for the KV to be complete at decode",
    )
    send_lanes: int = Field(
        default=2,
        ge=1,
        le=8,
        description="threads (each with its own NIXL/UCX worker) that post a rank's KV WRITEs; a burst of "
        "layers is split between them (intra-node, one WRITE is a copy by the posting thread)",
    )
    pin_send_lanes: bool = Field(
        default=True,
        description="with host (CPU) staging, pin each send lane to a CPU of its own (when the process may "
        "use at least as many); GPU staging is never pinned",
    )
    max_tokens: int | None = Field(
        default=None, ge=1, description="longest prompt handed off (default: vLLM's max_model_len)"
    )

    @field_validator("decode_endpoints", mode="before")
    @classmethod
    def _endpoints(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        return value

    @field_validator("decode_endpoints")
    @classmethod
    def _endpoints_format(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for endpoint in value:
            parse_endpoint(endpoint)
        return value


def load_settings(extra_config: dict[str, Any] | None) -> ConnectorSettings:
    """Validate ``kv_connector_extra_config``; raise :class:`ConnectorConfigError` listing every problem."""
    return validate_mapping(ConnectorSettings, extra_config, PREFIX, ConnectorConfigError)
