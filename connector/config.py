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

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from connector.control import parse_endpoint
from pd_settings.problems import SettingsError, validate_mapping
from pd_settings.secrets import is_loopback, read_secret
from pd_settings.servers import checked_name_ports, checked_servers_file

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
    servers_file: str | None = Field(
        default=None,
        min_length=1,
        description="the servers file the router reads too (pd_settings.servers): the kv_endpoint of each "
        "decode server in it is handshaken; re-read every handshake_interval_s (added: handshaken, removed: "
        "dropped)",
    )
    decode_kv_dns: tuple[str, ...] = Field(
        default=(),
        description="NAME:PORT whose DNS name resolves to the decode servers' KV endpoints (a Kubernetes "
        "headless Service), re-resolved every handshake_interval_s",
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
    # The KV channel's shared secret, by reference only (never the secret itself in this config).
    kv_secret_env: str | None = Field(
        default=None, min_length=1, description="name of an environment variable holding the shared secret"
    )
    kv_secret_file: str | None = Field(
        default=None,
        min_length=1,
        validate_default=True,
        description="file holding the shared secret the decode servers' KV endpoints require "
        "(their --kv-secret-file); every control connection proves it before any handshake",
    )

    @field_validator("kv_secret_file")
    @classmethod
    def _secret_readable(cls, value: str | None, info: ValidationInfo) -> str | None:
        read_secret(value, info.data.get("kv_secret_env"))  # the reason never quotes the secret
        return value

    def kv_secret(self) -> bytes | None:
        secret = read_secret(self.kv_secret_file, self.kv_secret_env)
        return secret.encode() if secret is not None else None

    def endpoint_allowed(self, endpoint: str) -> bool:
        """The connector dials only the configured ``decode_endpoints`` (a request's
        ``kv_endpoint`` comes from whoever sent it); none configured: loopback endpoints only."""
        if self.decode_endpoints:
            return endpoint in self.decode_endpoints
        try:
            host, _ = parse_endpoint(endpoint)
        except ValueError:
            return False
        return is_loopback(host)

    _servers_file = field_validator("servers_file")(checked_servers_file)

    _dns = field_validator("decode_kv_dns")(checked_name_ports)

    @field_validator("decode_endpoints", "decode_kv_dns", mode="before")
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
