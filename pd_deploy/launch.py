"""The images' entrypoint: ``python -m pd_deploy.launch ROLE [EXTRA ARGS...]`` (or
``wait-ready URL...``, see :mod:`pd_deploy.wait`). Arguments after ROLE are appended to the
server's command line; the server replaces this process.

=========  ==============================================================================
role       settings (``PD_<COMPONENT>_<OPTION>`` environment variables, as everywhere)
=========  ==============================================================================
prefill    :class:`PrefillLaunchSettings`, ``PD_PREFILL_*``: the vLLM command line with
           TileRTConnector and MTP is built by :mod:`pd_deploy.commands` (the builders of
           the local launcher and the Slurm plan)
decode     the decode server's own settings, ``PD_DECODE_*`` (``python -m decode_server
           --help``), with the image's defaults below for those not set
router     the router's own settings, ``PD_ROUTER_*`` (``python -m pd_router --help``), with
           ``PD_ROUTER_HOST=0.0.0.0`` unless set
all        ``PD_LAUNCH_SERVER_PYTHON``: the interpreter that runs the server (default: the
           one running this entrypoint)
=========  ==============================================================================

The decode image's defaults (:data:`DECODE_IMAGE_DEFAULTS`): TileRT on all interfaces,
HTTP 8200, KV control 8300 advertised under this host's FQDN (what prefill connects to),
16384 tokens, 3 MTP drafts. The decode role refuses ``PD_DECODE_NUM_MTP=0``: prefill
sends the MTP layer's KV, so a decode server without MTP would reject every handshake.

This module imports no router and no decode-server code: it runs in the prefill image,
which has neither.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from connector.control import parse_endpoint
from pd_deploy.commands import DECODE_ENV, PREFILL_ENV, PrefillSpec, vllm_prefill_argv
from pd_deploy.wait import wait_ready
from pd_settings.loader import EntrySettings, load, split_list
from pd_settings.parsers import ReasoningParser, ToolCallParser
from pd_settings.problems import Problem, SettingsError
from pd_settings.servers import checked_name_ports, checked_servers_file

ROLES = ("prefill", "decode", "router")
DECODE_IMAGE_DEFAULTS = {
    "PD_DECODE_ENGINE": "tilert",
    "PD_DECODE_HOST": "0.0.0.0",
    "PD_DECODE_PORT": "8200",
    "PD_DECODE_KV_PORT": "8300",
    "PD_DECODE_MAX_SEQ_LEN": "16384",
    "PD_DECODE_NUM_MTP": "3",
}
ROUTER_IMAGE_DEFAULTS = {"PD_ROUTER_HOST": "0.0.0.0"}


class LaunchSettings(EntrySettings):
    """What the entrypoint itself reads."""

    model_config = SettingsConfigDict(env_prefix="PD_LAUNCH_")

    server_python: str = Field(default_factory=lambda: sys.executable, min_length=1,
                               description="the interpreter that runs the server")


class PrefillLaunchSettings(EntrySettings):
    """The prefill image's vLLM server with TileRTConnector and MTP."""

    model_config = SettingsConfigDict(env_prefix="PD_PREFILL_")

    model: str = Field(min_length=1, description="the checkpoint directory")
    served_model_name: str | None = Field(None, min_length=1, description="default: the directory's name")
    host: str = Field("0.0.0.0", min_length=1)
    port: int = Field(8100, ge=1, le=65535)
    profile: Literal["glm5.1", "tiny", "auto"] = Field("glm5.1", description="the connector's model profile")
    tensor_parallel: int = Field(8, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    mtp: bool = Field(True, description="required: the decode side expects the MTP layer's KV")
    num_speculative_tokens: int = Field(1, ge=1)
    decode_kv_endpoints: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="host:port of every decode server's KV endpoint (comma-separated)")
    decode_kv_dns: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="NAME:PORT resolving to the decode servers' KV endpoints (a headless Service), "
        "re-resolved by the connector at runtime (comma-separated)")
    servers_file: str | None = Field(None, min_length=1, description="the servers file the router reads too: "
                                     "its decode servers' kv_endpoint, followed at runtime")
    enforce_eager: bool = False
    kv_secret_file: str | None = Field(None, min_length=1, description="file holding the KV channel's shared "
                                       "secret (the decode servers' PD_DECODE_KV_SECRET_FILE)")
    tool_call_parser: ToolCallParser = Field("glm47", description="the decode servers' "
                                             "PD_DECODE_TOOL_CALL_PARSER: the first token of a chat with tools "
                                             "sampled under the same tool-call grammar")
    reasoning_parser: ReasoningParser = Field("none", description="the decode servers' "
                                              "PD_DECODE_REASONING_PARSER: a grammar holds once the reasoning "
                                              "ended, on both sides")

    _split = field_validator("decode_kv_endpoints", "decode_kv_dns", mode="before")(split_list)
    _servers_file = field_validator("servers_file")(checked_servers_file)

    @field_validator("mtp")
    @classmethod
    def _mtp_required(cls, value: bool) -> bool:
        if not value:
            raise ValueError("MTP is required: the decode side expects the MTP layer's KV (unset it or set 1)")
        return value

    @field_validator("decode_kv_endpoints")
    @classmethod
    def _endpoints(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for endpoint in value:
            parse_endpoint(endpoint)
        return value

    _dns = field_validator("decode_kv_dns")(checked_name_ports)


def build_argv(role: str, environ: Mapping[str, str], extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of ``role``; raises :class:`SettingsError`."""
    python = load(LaunchSettings, None, environ).server_python
    if role == "prefill":
        s = load(PrefillLaunchSettings, None, environ)
        spec = PrefillSpec(model=s.model, port=s.port, host=s.host, mtp=s.mtp,
                           num_speculative_tokens=s.num_speculative_tokens, profile=s.profile,
                           decode_endpoints=s.decode_kv_endpoints, decode_kv_dns=s.decode_kv_dns,
                           servers_file=s.servers_file, enforce_eager=s.enforce_eager,
                           tensor_parallel=s.tensor_parallel, max_model_len=s.max_model_len,
                           served_model_name=s.served_model_name, kv_secret_file=s.kv_secret_file,
                           tool_call_parser=s.tool_call_parser, reasoning_parser=s.reasoning_parser,
                           python=python, extra_args=tuple(extra))
        return vllm_prefill_argv(spec), {**PREFILL_ENV, **environ}
    if role == "decode":
        env = {**DECODE_ENV, **DECODE_IMAGE_DEFAULTS, "PD_DECODE_KV_HOST": socket.getfqdn(), **environ}
        mtp = env["PD_DECODE_NUM_MTP"].strip()
        if mtp == "0":
            raise SettingsError([Problem("PD_DECODE_NUM_MTP", mtp, "MTP is required: prefill sends the MTP "
                                         "layer's KV (use 3 with TileRT)")])
        return [python, "-m", "decode_server", *extra], env
    if role == "router":
        return [python, "-m", "pd_router", *extra], {**ROUTER_IMAGE_DEFAULTS, **environ}
    raise SettingsError([Problem("ROLE", role, f"expected one of {', '.join(ROLES)}")])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(f"usage: entrypoint.sh {{{'|'.join(ROLES)}}} [extra server args...]", file=sys.stderr)
        return 2
    if args[0] == "wait-ready":
        return wait_ready(args[1:], os.environ)
    try:
        command, env = build_argv(args[0], os.environ, args[1:])
    except SettingsError as exc:
        print(f"entrypoint: {args[0]}: {exc}", file=sys.stderr)
        return 2
    print(f"entrypoint: {' '.join(command)}", file=sys.stderr, flush=True)
    os.execvpe(command[0], command, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
