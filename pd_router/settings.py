"""Router settings: one pydantic-settings model (:mod:`pd_settings.loader`): the command
line, ``PD_ROUTER_<OPTION>`` environment variables (lists comma-separated) and a YAML file
(``--config``), validated once at start-up. Errors name the option as it was given, the
value and the reason (:class:`pd_settings.problems.SettingsError`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from pd_grammar.spec import DEFAULT_MAX_SCHEMA_BYTES, DEFAULT_MAX_SCHEMA_DEPTH, MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH
from pd_http.logs import LogFormat
from pd_http.tracing import OtlpProtocol, check_endpoint
from pd_router.tenants import read_keys
from pd_settings.loader import EntrySettings, load, split_list, validate
from pd_settings.problems import SettingsError
from pd_settings.secrets import is_loopback, read_secret
from pd_settings.servers import check_url, checked_servers_file, split_host_port

ENV_PREFIX = "PD_ROUTER_"
LogLevel = Literal["critical", "error", "warning", "info", "debug"]

__all__ = ["ENV_PREFIX", "RouterSettings", "SettingsError", "load_settings", "validate_settings"]


class RouterSettings(EntrySettings):
    """OpenAI-compatible prefill/decode router."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, cli_prog_name="pd_router")

    prefill: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="base URL of a vLLM prefill server (repeatable, or comma-separated)"
    )
    decode: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="base URL of a decode server (repeatable, or comma-separated)"
    )
    servers_file: Path | None = Field(
        None,
        description="YAML/JSON file listing prefill and decode servers (docs/router.md), re-read when it "
        "changes: servers added or removed (drained) without a restart",
    )
    prefill_dns: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="http://NAME:PORT whose DNS name resolves to the prefill servers (a Kubernetes headless "
        "Service), re-resolved every --discovery-interval; one backend per address",
    )
    decode_dns: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="http://NAME:PORT whose DNS name resolves to the decode servers (as --prefill-dns)"
    )
    discovery_interval: float = Field(
        5.0, gt=0, le=300, description="seconds between two looks at --servers-file and the DNS names"
    )
    prefill_policy: Literal["least-loaded", "round-robin"] = Field(
        "least-loaded",
        description="prefill server choice: least-loaded (vLLM's running + waiting requests from its /metrics, "
        "plus what this router sent since) or round-robin",
    )
    prefill_affinity_slack: float = Field(
        2.0, ge=0, allow_inf_nan=False,
        description="requests a prefill server that prefilled a conversation's last turn may have above the least "
        "loaded one and still get its next turn (its prefix cache holds the conversation); 0: only when it is "
        "among the least loaded",
    )
    prefill_load_interval: float = Field(
        0.5, gt=0, le=60, description="seconds between two scrapes of each prefill server's /metrics"
    )
    host: str = Field("127.0.0.1", min_length=1, description="address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="port to listen on")
    api_key: str | None = Field(
        None, min_length=1, description="require 'Authorization: Bearer KEY' on /v1/*"
    )
    api_keys_file: Path | None = Field(
        None, description="TOML file of named API keys, stored as SHA-256 (docs/router.md, 'Tenants and keys'): a "
        "request's tenant is its key's name; re-read when it changes"
    )
    tenant_header: str | None = Field(
        None, pattern=r"^[A-Za-z0-9-]{1,64}$", description="behind a trusted gateway: the header whose value names "
        "the request's tenant (off by default: a client's header names nothing)"
    )
    min_priority: int = Field(
        0, ge=-(2**63), le=2**63 - 1, description="the lowest (soonest served) priority a request may ask for, "
        "unless its key allows lower (its min_priority); lower gets 400"
    )
    max_queued_per_tenant: int | None = Field(
        None, ge=0, description="requests of one tenant that may wait for a decode slot at this router (a key's "
        "max_queued overrides it); more get 429 (default: only --max-queue)"
    )
    priority_aging: float = Field(
        60.0, ge=0, le=86400, description="seconds after which a request waiting for a decode slot goes ahead of "
        "every priority class (the aged by arrival): the longest a low class waits behind later requests (0: off)"
    )
    max_queue: int = Field(1024, ge=0, description="requests that may wait for a decode slot; more get 429")
    max_choices: int = Field(
        64, ge=1, le=4096, description="choices one request may ask for (a completion's prompts x n), each its own "
        "prefill and decode; more get a 400 that says so")
    queue_timeout: float = Field(
        30.0, gt=0, description="seconds a request may wait for a decode slot (then 429)"
    )
    decode_slots: int | None = Field(
        None,
        ge=1,
        description="slots of a decode server without a capabilities endpoint (default: unlimited)",
    )
    probe_interval: float = Field(2.0, gt=0, le=3600, description="seconds between backend health probes")
    probe_misses: int = Field(
        2, ge=1, le=100,
        description="probes in a row that time out before a healthy backend is marked down "
        "(a refused connection or an error answer marks it down at once)",
    )
    prefill_timeout: float = Field(
        300.0, gt=0, description="seconds allowed for one prefill request (then 504)"
    )
    decode_timeout: float = Field(
        120.0,
        gt=0,
        description="seconds allowed until decode answers and between two decode chunks (then 504)",
    )
    stall_timeout: float = Field(
        5.0, gt=0, le=600, description="seconds without a token after a decode server's answer began (its "
        "progress lines come once per engine step: TileRT's 3.19 ms, the reference engine's tens of ms) before "
        "the router takes the server for lost and moves the answer to another (--max-migrations)",
    )
    max_migrations: int = Field(
        2, ge=0, le=16, description="decode servers one answer may move from when its server is lost after the "
        "answer began (the rest goes on on another, resumed from the tokens the client has; 0: the answer ends "
        "with an error event)",
    )
    max_body_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="largest accepted request body (then 413)"
    )
    max_header_bytes: int = Field(
        16 * 1024, ge=1024, description="largest request head (request line and headers; then 431)"
    )
    max_schema_bytes: int = Field(
        DEFAULT_MAX_SCHEMA_BYTES, ge=2, le=MAX_SCHEMA_BYTES,
        description="structured output: largest JSON schema a request may bring (bytes; then 400, before prefill)"
    )
    max_schema_depth: int = Field(
        DEFAULT_MAX_SCHEMA_DEPTH, ge=1, le=MAX_SCHEMA_DEPTH,
        description="structured output: deepest nesting of a request's JSON schema (then 400, before prefill)"
    )
    max_headers: int = Field(100, ge=8, description="most header lines in a request (then 431)")
    header_timeout: float = Field(
        10.0, gt=0, description="seconds a connection may take to send a request head (then 408 and close)"
    )
    body_timeout: float = Field(
        30.0, gt=0, description="seconds a client may take to send a request body once its head arrived (then 408)"
    )
    keep_alive_timeout: float = Field(
        5.0, gt=0, description="seconds an idle keep-alive connection stays open between requests"
    )
    max_connections: int = Field(
        1024, ge=1, description="open client connections; more are answered 503 and closed"
    )
    dead_peer_timeout: float = Field(
        10.0, ge=3, le=3600,
        description="seconds after its last byte in which a peer that vanished from the network (link down, "
        "host gone) is given up, on client and upstream connections alike (TCP keepalive and user timeout; "
        "a peer that is only slow is never cut)"
    )
    drain_timeout: float = Field(
        600.0,
        ge=0,
        description="on SIGTERM: seconds in-flight requests may take to finish (new ones get 503) "
        "before the rest are ended with an error",
    )
    require_handshake: bool = Field(
        True,
        description="a decode server with capabilities is ready only once a prefill connector "
        "handshook with it",
    )
    log_level: LogLevel = Field("info", description="log level")
    log_format: LogFormat = Field(
        "text", description="text, or json: one JSON object per line, request lines with request_id and trace_id"
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="send OpenTelemetry traces (one per request) to this OTLP endpoint, e.g. http://127.0.0.1:4317; "
        "tracing is off without it",
    )
    otlp_traces_protocol: OtlpProtocol = Field(
        "grpc", description="OTLP transport of --otlp-traces-endpoint: grpc, or http/protobuf"
    )
    # the decode servers' API key (their --api-key-file), by reference only: never on the command line
    decode_api_key_env: str | None = Field(
        None, min_length=1, description="name of an environment variable holding the decode servers' API key"
    )
    decode_api_key_file: Path | None = Field(
        None,
        description="file holding the decode servers' API key, sent as 'Authorization: Bearer' on every "
        "call to a decode server",
    )

    _split = field_validator("prefill", "decode", "prefill_dns", "decode_dns", mode="before")(split_list)

    @field_validator("prefill", "decode")
    @classmethod
    def _urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        out = [check_url(url) for url in urls]
        if len(set(out)) != len(out):
            raise ValueError("the same URL is given twice")
        return tuple(out)

    @field_validator("prefill_dns", "decode_dns")
    @classmethod
    def _dns(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        for url in urls:
            dns_target(url)
        return urls

    _servers_file = field_validator("servers_file")(checked_servers_file)

    @model_validator(mode="after")
    def _sources(self) -> RouterSettings:
        if self.admin_enabled() or self.servers_file is not None:
            return self
        for role, static, dns in (("prefill", self.prefill, self.prefill_dns),
                                  ("decode", self.decode, self.decode_dns)):
            if not static and not dns:
                raise ValueError(f"no {role} server: give --{role} URL, --{role}-dns, --servers-file, "
                                 "or --api-key (or a loopback --host) to add them through /admin/backends")
        return self

    def admin_enabled(self) -> bool:
        """The admin API (``/admin/backends``) needs the API key, except on a loopback-only bind."""
        return self.api_key is not None or is_loopback(self.host)

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _otlp(cls, value: str | None) -> str | None:
        return None if value is None else check_endpoint(value)

    @field_validator("api_keys_file")
    @classmethod
    def _keys_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            read_keys(value)  # ValueError names what is wrong, never a key's hash
        return value

    @field_validator("decode_api_key_file")
    @classmethod
    def _decode_key(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        read_secret(value, info.data.get("decode_api_key_env"))  # ValueError names what is wrong, not the key
        return value

    def decode_api_key(self) -> str | None:
        """The key to send to the decode servers, None when none is set."""
        return read_secret(self.decode_api_key_file, self.decode_api_key_env)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value


def dns_target(url: str) -> tuple[str, str, int]:
    """``http://NAME:PORT`` (--prefill-dns / --decode-dns) -> (scheme, name, port); ValueError."""
    check_url(url)
    scheme, _, rest = url.rstrip("/").partition("://")
    if "/" in rest:
        raise ValueError(f"{url!r} must be SCHEME://NAME:PORT, without a path")
    name, port = split_host_port(rest)
    return scheme, name, port


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> RouterSettings:
    """Settings from ``argv`` (default ``sys.argv[1:]``), ``env`` (default ``os.environ``)
    and the ``--config`` file; raises :class:`SettingsError`."""
    import sys

    return load(RouterSettings, sys.argv[1:] if argv is None else argv, env)


def validate_settings(values: Mapping[str, object]) -> RouterSettings:
    """Settings from a mapping of option names to values (tests, embedding); raises :class:`SettingsError`."""
    return validate(RouterSettings, values)
