"""Router settings: one pydantic object, filled from the command line and from
``PD_ROUTER_<OPTION>`` environment variables (the command line wins), validated once
at start-up. Errors name the option, the value and the reason."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ENV_PREFIX = "PD_ROUTER_"
LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class SettingsError(ValueError):
    """Invalid settings; the message names option, value and reason."""


class RouterSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill: tuple[str, ...] = Field(
        min_length=1, description="base URL of a vLLM prefill server (repeatable)"
    )
    decode: tuple[str, ...] = Field(min_length=1, description="base URL of a decode server (repeatable)")
    host: str = Field("127.0.0.1", min_length=1, description="address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="port to listen on")
    api_key: str | None = Field(
        None, min_length=1, description="require 'Authorization: Bearer KEY' on /v1/*"
    )
    max_queue: int = Field(1024, ge=0, description="requests that may wait for a decode slot; more get 429")
    queue_timeout: float = Field(
        30.0, gt=0, description="seconds a request may wait for a decode slot (then 429)"
    )
    decode_slots: int | None = Field(
        None,
        ge=1,
        description="slots of a decode server without a capabilities endpoint (default: unlimited)",
    )
    probe_interval: float = Field(2.0, gt=0, le=3600, description="seconds between backend health probes")
    prefill_timeout: float = Field(
        300.0, gt=0, description="seconds allowed for one prefill request (then 504)"
    )
    decode_timeout: float = Field(
        120.0,
        gt=0,
        description="seconds allowed until decode answers and between two decode chunks (then 504)",
    )
    max_body_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="largest accepted request body (then 413)"
    )
    require_handshake: bool = Field(
        True,
        description="a decode server with capabilities is ready only once a prefill connector "
        "handshook with it",
    )
    log_level: LogLevel = Field("info", description="log level")

    @field_validator("prefill", "decode")
    @classmethod
    def _urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
            try:
                _ = parts.port  # raises for a port out of range or not a number
            except ValueError as exc:
                raise ValueError(f"{url!r} has an invalid port") from exc
            if parts.query or parts.fragment:
                raise ValueError(f"{url!r} must not carry a query or fragment")
            out.append(url.rstrip("/"))
        if len(set(out)) != len(out):
            raise ValueError("the same URL is given twice")
        return tuple(out)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd_router",
        description="OpenAI-compatible prefill/decode router. Every option can also be set with the "
        f"environment variable {ENV_PREFIX}<OPTION> (e.g. {ENV_PREFIX}MAX_QUEUE=64; list options "
        "separated by commas); the command line wins.",
    )
    for name, field in RouterSettings.model_fields.items():
        env = ENV_PREFIX + name.upper()
        default = field.default
        help_text = f"{field.description} [env {env}]"
        if name in ("prefill", "decode"):
            parser.add_argument(_option(name), action="append", metavar="URL", help=help_text)
        elif field.annotation is bool:
            parser.add_argument(
                _option(name),
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{help_text} (default: {default})",
            )
        else:
            parser.add_argument(
                _option(name),
                default=None,
                help=f"{help_text} (default: {default})",
                choices=["critical", "error", "warning", "info", "debug"] if name == "log_level" else None,
            )
    return parser


def _from_env(env: Mapping[str, str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for name in RouterSettings.model_fields:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if name in ("prefill", "decode"):
            values[name] = tuple(u for u in raw.replace(" ", ",").split(",") if u)
        else:
            values[name] = raw
    return values


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> RouterSettings:
    """Settings from ``argv`` and ``env`` (defaults: ``sys.argv[1:]``, ``os.environ``).

    Raises :class:`SettingsError` naming option, value and reason; argparse handles
    ``--help`` and unknown options itself (SystemExit)."""
    args = build_parser().parse_args(argv)
    values = _from_env(os.environ if env is None else env)
    for name, value in vars(args).items():
        if value is not None:
            values[name] = tuple(value) if isinstance(value, list) else value
    return validate_settings(values)


def validate_settings(values: Mapping[str, object]) -> RouterSettings:
    try:
        return RouterSettings.model_validate(dict(values))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else "?"
            value = values.get(name, "<missing>")
            reason = err["msg"].removeprefix("Value error, ")
            problems.append(
                f"option {_option(name)} (env {ENV_PREFIX}{name.upper()}), value {value!r}: {reason}"
            )
        raise SettingsError("invalid settings:\n  " + "\n  ".join(problems)) from None
