"""The images' entrypoint: ``python -m pd_deploy.launch ROLE [EXTRA ARGS...]``
(or ``wait-ready URL...``, see :mod:`pd_deploy.wait`).

Reads the role's ``PD_*`` environment variables (Kubernetes manifests and ``docker run -e``
set them), validates them once (errors name the variable, the value and the reason),
builds the command with :mod:`pd_deploy.commands` (the same builders as the local
launcher, the tests and the Slurm plan) and replaces this process with it. Arguments
after ROLE are appended to the server's command line.

=========  ==============================================================================
role       variables (default)
=========  ==============================================================================
prefill    PD_MODEL, PD_SERVED_MODEL_NAME (dir name), PD_HOST (0.0.0.0), PD_PORT (8100),
           PD_PROFILE (glm5.1), PD_TENSOR_PARALLEL (8), PD_MAX_MODEL_LEN, PD_MTP (1: required),
           PD_NUM_SPECULATIVE_TOKENS (1), PD_DECODE_KV_ENDPOINTS (host:port,...), PD_ENFORCE_EAGER (0)
decode     PD_MODEL, PD_SERVED_MODEL_NAME, PD_HOST (0.0.0.0), PD_PORT (8200), PD_KV_HOST (this
           host's name: what prefill connects to), PD_KV_PORT (8300), PD_ENGINE (tilert),
           PD_SLOTS (1), PD_MAX_SEQ_LEN (16384), PD_NUM_MTP (3), PD_KV_DEVICE (cuda:0 for
           tilert: receive into VRAM; cpu for reference)
router     PD_PREFILL_URLS, PD_DECODE_URLS (comma-separated), PD_HOST (0.0.0.0), PD_PORT (8000)
all        PD_PYTHON (python3): the interpreter that runs the server
=========  ==============================================================================
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pd_deploy.wait import wait_ready
from pd_deploy.commands import (
    DECODE_ENV,
    PREFILL_ENV,
    DecodeSpec,
    PrefillSpec,
    RouterSpec,
    decode_server_argv,
    router_argv,
    vllm_prefill_argv,
)


class LaunchError(ValueError):
    """Invalid PD_* settings; the message names the variable, the value and the reason."""


def _csv(value: object) -> object:
    return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value


class _Env(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    python: str = Field("python3", alias="PD_PYTHON", min_length=1)
    host: str = Field("0.0.0.0", alias="PD_HOST", min_length=1)


class PrefillEnv(_Env):
    model: str = Field(alias="PD_MODEL", min_length=1)
    served_model_name: str | None = Field(None, alias="PD_SERVED_MODEL_NAME")
    port: int = Field(8100, alias="PD_PORT", ge=1, le=65535)
    profile: Literal["glm5.1", "tiny", "auto"] = Field("glm5.1", alias="PD_PROFILE")
    tensor_parallel: int = Field(8, alias="PD_TENSOR_PARALLEL", ge=1)
    max_model_len: int | None = Field(None, alias="PD_MAX_MODEL_LEN", ge=1)
    mtp: bool = Field(True, alias="PD_MTP")
    num_speculative_tokens: int = Field(1, alias="PD_NUM_SPECULATIVE_TOKENS", ge=1)
    decode_kv_endpoints: list[str] = Field(default_factory=list, alias="PD_DECODE_KV_ENDPOINTS")
    enforce_eager: bool = Field(False, alias="PD_ENFORCE_EAGER")

    _split = field_validator("decode_kv_endpoints", mode="before")(_csv)

    @field_validator("mtp")
    @classmethod
    def _mtp_required(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                "MTP is required: the decode side expects the MTP layer's KV (unset it or set 1)"
            )
        return value

    @field_validator("decode_kv_endpoints")
    @classmethod
    def _endpoints(cls, value: list[str]) -> list[str]:
        for ep in value:
            host, _, port = ep.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"{ep!r} is not host:port")
        return value


class DecodeEnv(_Env):
    model: str = Field(alias="PD_MODEL", min_length=1)
    served_model_name: str | None = Field(None, alias="PD_SERVED_MODEL_NAME")
    port: int = Field(8200, alias="PD_PORT", ge=1, le=65535)
    kv_host: str = Field(default_factory=socket.getfqdn, alias="PD_KV_HOST", min_length=1)
    kv_port: int = Field(8300, alias="PD_KV_PORT", ge=1, le=65535)
    engine: Literal["tilert", "reference"] = Field("tilert", alias="PD_ENGINE")
    slots: int = Field(1, alias="PD_SLOTS", ge=1)
    max_seq_len: int = Field(16384, alias="PD_MAX_SEQ_LEN", ge=1)
    num_mtp: int = Field(3, alias="PD_NUM_MTP", ge=1, description="MTP is required")
    kv_device: str | None = Field(None, alias="PD_KV_DEVICE", pattern=r"^(cpu|cuda:\d+)$")


class RouterEnv(_Env):
    prefill_urls: list[str] = Field(alias="PD_PREFILL_URLS", min_length=1)
    decode_urls: list[str] = Field(alias="PD_DECODE_URLS", min_length=1)
    port: int = Field(8000, alias="PD_PORT", ge=1, le=65535)

    _split = field_validator("prefill_urls", "decode_urls", mode="before")(_csv)


ROLES: dict[str, type[_Env]] = {"prefill": PrefillEnv, "decode": DecodeEnv, "router": RouterEnv}


def parse_env(role: str, environ: Mapping[str, str]) -> _Env:
    if role not in ROLES:
        raise LaunchError(f"role {role!r}: expected one of {', '.join(ROLES)}")
    try:
        return ROLES[role].model_validate({k: v for k, v in environ.items() if k.startswith("PD_")})
    except ValidationError as exc:
        fields = ROLES[role].model_fields
        lines = []
        for e in exc.errors():
            name = str(e["loc"][0]) if e["loc"] else "?"
            var = fields[name].alias if name in fields else name
            shown = environ.get(var or "", "<unset>")
            lines.append(f"{var}={shown!r}: {e['msg']}")
        raise LaunchError(f"{role}: invalid settings:\n  " + "\n  ".join(lines)) from None


def build_argv(role: str, environ: Mapping[str, str], extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of ``role`` from ``environ``'s PD_* settings."""
    s = parse_env(role, environ)
    if isinstance(s, PrefillEnv):
        argv = vllm_prefill_argv(
            PrefillSpec(
                model=s.model,
                port=s.port,
                host=s.host,
                mtp=s.mtp,
                num_speculative_tokens=s.num_speculative_tokens,
                profile=s.profile,
                decode_endpoints=tuple(s.decode_kv_endpoints),
                enforce_eager=s.enforce_eager,
                tensor_parallel=s.tensor_parallel,
                max_model_len=s.max_model_len,
                served_model_name=s.served_model_name,
                python=s.python,
                extra_args=tuple(extra),
            )
        )
        return argv, {**PREFILL_ENV, **environ}
    if isinstance(s, DecodeEnv):
        from decode_server.settings import DEFAULT_KV_DEVICE  # the decode image has it

        argv = decode_server_argv(
            DecodeSpec(
                model=s.model,
                port=s.port,
                kv_port=s.kv_port,
                host=s.host,
                engine=s.engine,
                slots=s.slots,
                max_seq_len=s.max_seq_len,
                num_mtp=s.num_mtp,
                served_model_name=s.served_model_name,
                kv_device=s.kv_device or DEFAULT_KV_DEVICE[s.engine],
                python=s.python,
                extra_args=("--kv-host", s.kv_host, *extra),
            )
        )
        return argv, {**DECODE_ENV, **environ}
    if isinstance(s, RouterEnv):
        argv = router_argv(
            RouterSpec(
                prefill_urls=tuple(s.prefill_urls),
                decode_urls=tuple(s.decode_urls),
                port=s.port,
                host=s.host,
                python=s.python,
                extra_args=tuple(extra),
            )
        )
        return argv, dict(environ)
    raise LaunchError(f"role {role!r} has no command")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(f"usage: entrypoint.sh {{{','.join(ROLES)}}} [extra server args...]", file=sys.stderr)
        return 2
    if args[0] == "wait-ready":
        return wait_ready(args[1:], os.environ)
    try:
        command, env = build_argv(args[0], os.environ, args[1:])
    except LaunchError as exc:
        print(f"entrypoint: {exc}", file=sys.stderr)
        return 2
    print(f"entrypoint: {' '.join(command)}", file=sys.stderr, flush=True)
    os.execvpe(command[0], command, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
