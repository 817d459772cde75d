"""Decode server settings: one pydantic-settings model (:mod:`pd_settings.loader`): the
command line, ``PD_DECODE_<OPTION>`` environment variables and a YAML file (``--config``),
validated once at start-up. An invalid value stops the server with exit status 2 and a
message naming the option as it was given, the value and the reason."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from decode_server.model_dir import missing_files
from pd_grammar.spec import (
    DEFAULT_MAX_SCHEMA_BYTES,
    DEFAULT_MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    JsonWhitespace,
)
from pd_http.logs import LogFormat
from pd_http.tracing import OtlpProtocol, check_endpoint
from pd_settings.loader import EntrySettings, load
from pd_settings.parsers import ReasoningParser, ToolCallParser
from pd_settings.problems import SettingsError
from pd_settings.secrets import is_loopback, read_secret

ENV_PREFIX = "PD_DECODE_"
# Where each engine receives KV by default: TileRT (GPU hosts) into VRAM, where its conversion
# (dequantization + Hadamard) then runs; the reference engine computes on the CPU.
DEFAULT_KV_DEVICE = {"tilert": "cuda:0", "reference": "cpu"}
# GLM's output parsers, named as vLLM names them (vLLM maps glm45 and glm47 to one parser each)

__all__ = ["DEFAULT_KV_DEVICE", "ENV_PREFIX", "DecodeServerSettings", "ReasoningParser", "SettingsError",
           "ToolCallParser", "load_settings"]


class DecodeServerSettings(EntrySettings):
    """PD decode server: OpenAI completions/chat over KV received from vLLM prefill."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, cli_prog_name="decode_server")

    # engine comes first: the checks of later fields depend on it
    engine: Literal["reference", "tilert"] = Field(description="decode engine")
    model: Path = Field(description="model directory (weights, config.json, tokenizer.json)")
    host: str = Field("127.0.0.1", min_length=1, description="HTTP address to listen on")
    port: int = Field(8200, ge=1, le=65535, description="HTTP port")
    kv_host: str = Field("127.0.0.1", min_length=1, description="address of the KV control endpoint")
    kv_port: int = Field(9100, ge=0, le=65535, description="port of the KV control endpoint (0: any free port)")
    slots: int = Field(1, ge=1, le=1024, description="concurrent sequences (forced to 1 for tilert)")
    max_seq_len: int = Field(4096, ge=2, description="longest prompt + output, in tokens")
    num_mtp: int = Field(1, ge=0, le=8, description="MTP draft tokens per step (0: no MTP)")
    kv_timeout: float = Field(30.0, gt=0, le=3600, description="seconds to wait for a request's KV (then 504; "
                              "its slot is free: a router that stopped before its prefill)")
    write_timeout: float = Field(60.0, gt=0, le=3600, description="seconds an answer may wait for its client (the "
                                 "router) to take the next bytes; then its generation ends and its slot is free (a "
                                 "router stopped mid-stream)")
    max_queue: int = Field(4096, ge=0, le=1_000_000, description="decode requests that may wait for a slot "
                           "(from all routers together); more are refused with 429")
    drain_timeout: float = Field(
        600.0, ge=0, description="on SIGTERM: seconds generations in flight may take to finish (new requests "
        "get 503) before the rest are ended with an error")
    dead_peer_timeout: float = Field(
        10.0, ge=3, le=3600, description="seconds after its last byte in which a router or prefill that vanished "
        "from the network (link down, host gone) is given up: its generation ends and its slot and KV are freed "
        "(TCP keepalive and user timeout, on HTTP and KV control connections; a slow peer is never cut)")
    served_model_name: str | None = Field(None, min_length=1, description="model name (default: model dir name)")
    reasoning_parser: ReasoningParser = Field(
        "none", description="glm45 (or glm47, the same parser): split <think>..</think> into reasoning "
        "(chat), as vLLM's --reasoning-parser glm45; for a model that reasons (GLM-5.1)")
    tool_call_parser: ToolCallParser = Field(
        "glm47", description="glm47 (or glm45, the same parser): parse <tool_call>..</tool_call> into tool_calls "
        "(chat with tools, tool_choice auto or none given), as vLLM's --tool-call-parser glm47; none: the "
        "calls stay in the content")
    max_schema_bytes: int = Field(DEFAULT_MAX_SCHEMA_BYTES, ge=2, le=MAX_SCHEMA_BYTES,
                                  description="structured output: largest JSON schema a request may bring (bytes)")
    max_schema_depth: int = Field(DEFAULT_MAX_SCHEMA_DEPTH, ge=1, le=MAX_SCHEMA_DEPTH,
                                  description="structured output: deepest nesting of a request's JSON schema")
    json_whitespace: JsonWhitespace = Field(
        "any", description="structured output: whitespace between JSON tokens, as prefill's vLLM compiles it: any "
        "(vLLM's default) or compact (vLLM --structured-outputs-config '{\"backend\": \"xgrammar\", "
        "\"disable_any_whitespace\": true}')")
    kv_device: str = Field("cpu", pattern=r"^(cpu|cuda:\d+)$",
                           description="where the KV receive buffer lives: cpu, or cuda:N (tilert) to receive into "
                                       "VRAM (default: cuda:0 for tilert, cpu for reference)")
    kv_dtype: Literal["bfloat16", "float32", "float16"] | None = Field(
        None, description="reference engine: dtype of the received KV (default: the model's torch_dtype)")
    attention_kernel: bool = Field(
        True, description="reference engine: attention over the cache as a compiled loop (numba; "
        "decode_server/reference/latent_kernel.py) where it applies (numba installed, a float32 model on the CPU): "
        "1.1-1.5x faster decode; --no-attention-kernel: PyTorch's products")
    keep_kv: bool = Field(
        True, description="keep a cleanly ended answer's KV (prompt and answer) in its slot until the slot is "
        "needed, so that the conversation's next turn moves only its new tokens' KV (docs/kv_reuse.md); where the "
        "engine supports it (the reference engine in this process); --no-keep-kv: every handoff moves the whole "
        "prompt's KV")
    engine_process: bool = Field(
        False, description="run the engine in a process of its own, which steps each sequence back to back while "
        "this one serves HTTP (the two never wait for one interpreter lock; vLLM's EngineCore process); default: "
        "on the slot's worker thread in this process (docs/decode_server.md, \"Where the engine runs\")")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="log level")
    log_format: LogFormat = Field(
        "text", description="text, or json: one JSON object per line, request lines with request_id and trace_id")
    otlp_traces_endpoint: str | None = Field(
        None, description="send OpenTelemetry traces (spans per request: KV wait, engine start, generation) to "
        "this OTLP endpoint, e.g. http://127.0.0.1:4317; tracing is off without it")
    otlp_traces_protocol: OtlpProtocol = Field(
        "grpc", description="OTLP transport of --otlp-traces-endpoint: grpc, or http/protobuf")
    # Secrets by reference only (a file, or the name of an environment variable), never on the command line.
    api_key_env: str | None = Field(None, min_length=1, description="name of an environment variable holding the "
                                    "HTTP API key (clients send 'Authorization: Bearer KEY')")
    api_key_file: Path | None = Field(
        None, validate_default=True,
        description="file holding the HTTP API key required on every route but /health, /ready and /metrics; "
                    "required when --host is not a loopback address")
    kv_secret_env: str | None = Field(None, min_length=1, description="name of an environment variable holding "
                                      "the KV control channel's shared secret")
    kv_secret_file: Path | None = Field(
        None, validate_default=True,
        description="file holding the shared secret prefill connectors must prove on the KV control channel "
                    "(HMAC challenge-response); required when --kv-host is not a loopback address")

    @model_validator(mode="before")
    @classmethod
    def _default_kv_device(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("kv_device") is None and data.get("engine") in DEFAULT_KV_DEVICE:
            data = {**data, "kv_device": DEFAULT_KV_DEVICE[data["engine"]]}
        return data

    @field_validator("model")
    @classmethod
    def _model_dir(cls, value: Path, info: ValidationInfo) -> Path:
        if not value.is_dir():
            raise ValueError(f"{str(value)!r} is not a directory")
        if not (value / "tokenizer.json").is_file():
            raise ValueError(f"{str(value)!r} has no tokenizer.json")
        engine = info.data.get("engine")
        missing = missing_files(value, engine) if engine else []
        if missing:
            raise ValueError(
                f"lacks {', '.join(missing)}, which the {engine} decode server reads from its model directory: "
                "convert with deploy/slurm/setup_deps.sh (it copies them from the checkpoint), or run "
                "`python -m decode_server.model_dir complete --source CHECKPOINT DIR`")
        return value.resolve()

    @field_validator("num_mtp")
    @classmethod
    def _tilert_mtp(cls, value: int, info: ValidationInfo) -> int:
        if info.data.get("engine") == "tilert":
            from decode_server.engine.tilert import TILERT_NUM_MTP  # torch: only for that engine

            if value not in (0, TILERT_NUM_MTP):
                raise ValueError(f"TileRT's GLM-5 MTP drafts {TILERT_NUM_MTP} tokens per step; use "
                                 f"{TILERT_NUM_MTP} or 0")
        return value

    @field_validator("kv_device")
    @classmethod
    def _device_of_the_engine(cls, value: str, info: ValidationInfo) -> str:
        if info.data.get("engine") == "reference" and value != "cpu":
            raise ValueError("the reference engine runs on the CPU; use cpu")
        return value

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _otlp(cls, value: str | None) -> str | None:
        return None if value is None else check_endpoint(value)

    @field_validator("api_key_file")
    @classmethod
    def _api_key(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return _secret_check(value, info.data.get("api_key_env"), info.data.get("host"), "--host",
                             "the HTTP API", "--api-key-file or --api-key-env")

    @field_validator("kv_secret_file")
    @classmethod
    def _kv_secret(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return _secret_check(value, info.data.get("kv_secret_env"), info.data.get("kv_host"), "--kv-host",
                             "the KV control endpoint", "--kv-secret-file or --kv-secret-env")

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @property
    def effective_slots(self) -> int:
        return 1 if self.engine == "tilert" else self.slots

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name

    def api_key(self) -> str | None:
        """The HTTP API key (read again from its file or variable), None when none is set."""
        return read_secret(self.api_key_file, self.api_key_env)

    def kv_secret(self) -> bytes | None:
        """The KV control channel's shared secret, None when none is set."""
        secret = read_secret(self.kv_secret_file, self.kv_secret_env)
        return secret.encode() if secret is not None else None


def _secret_check(file: Path | None, env_var: str | None, host: str | None, host_option: str, what: str,
                  options: str) -> Path | None:
    secret = read_secret(file, env_var)  # ValueError (never quoting the secret) names what is wrong
    if secret is None and host is not None and not is_loopback(host):
        raise ValueError(f"{host_option} {host} exposes {what} beyond this host: set {options} "
                         "(or listen on 127.0.0.1)")
    return file


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> DecodeServerSettings:
    """Settings from ``argv`` (default ``sys.argv[1:]``), ``env`` (default ``os.environ``)
    and the ``--config`` file; raises :class:`SettingsError` naming option, value and reason."""
    import sys

    return load(DecodeServerSettings, sys.argv[1:] if argv is None else argv, env)
