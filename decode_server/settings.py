"""Decode server settings: command line, then ``DECODE_SERVER_<OPTION>`` environment
variables, then defaults; validated once at start-up. An invalid value stops the
server with a message naming the option, the value and the reason."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decode_server.model_dir import missing_files

ENV_PREFIX = "DECODE_SERVER_"
# Where each engine receives KV by default: TileRT (GPU hosts) into VRAM, where its conversion
# (dequantization + Hadamard) then runs; the reference engine computes on the CPU.
DEFAULT_KV_DEVICE = {"tilert": "cuda:0", "reference": "cpu"}


class SettingsError(ValueError):
    """Invalid settings; the message names option, value and reason."""


class DecodeServerSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: Literal["reference", "tilert"] = Field(description="decode engine")
    model: Path = Field(description="model directory (weights, config.json, tokenizer.json)")
    host: str = Field("127.0.0.1", min_length=1, description="HTTP address to listen on")
    port: int = Field(8200, ge=1, le=65535, description="HTTP port")
    kv_host: str = Field("127.0.0.1", min_length=1, description="address of the KV control endpoint")
    kv_port: int = Field(9100, ge=0, le=65535, description="port of the KV control endpoint (0: any free port)")
    slots: int = Field(1, ge=1, le=1024, description="concurrent sequences (forced to 1 for tilert)")
    max_seq_len: int = Field(4096, ge=2, description="longest prompt + output, in tokens")
    num_mtp: int = Field(1, ge=0, le=8, description="MTP draft tokens per step (0: no MTP)")
    kv_timeout: float = Field(30.0, gt=0, le=3600, description="seconds to wait for a request's KV (then 504)")
    served_model_name: str | None = Field(None, min_length=1, description="model name (default: model dir name)")
    reasoning_parser: Literal["none", "glm45"] = Field(
        "none", description="glm45: split <think>..</think> into reasoning_content (chat)")
    tool_call_parser: Literal["none", "glm45"] = Field(
        "none", description="glm45: parse <tool_call>..</tool_call> into tool_calls (chat, when tools are given)")
    kv_device: str = Field("cpu", pattern=r"^(cpu|cuda:\d+)$",
                           description="where the KV receive buffer lives: cpu, or cuda:N (tilert) to receive into "
                                       "VRAM (default: cuda:0 for tilert, cpu for reference)")
    kv_dtype: Literal["bfloat16", "float32", "float16"] | None = Field(
        None, description="reference engine: dtype of the received KV (default: the model's torch_dtype)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="log level")

    @field_validator("model")
    @classmethod
    def _model_dir(cls, value: Path) -> Path:
        if not value.is_dir():
            raise ValueError(f"{str(value)!r} is not a directory")
        if not (value / "tokenizer.json").is_file():
            raise ValueError(f"{str(value)!r} has no tokenizer.json")
        return value.resolve()

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _default_kv_device(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("kv_device") is None and data.get("engine") in DEFAULT_KV_DEVICE:
            data = {**data, "kv_device": DEFAULT_KV_DEVICE[data["engine"]]}
        return data

    @model_validator(mode="after")
    def _engine_rules(self) -> DecodeServerSettings:
        if self.engine == "reference" and self.kv_device != "cpu":
            raise ValueError(f"kv_device={self.kv_device!r}: the reference engine runs on the CPU; use cpu")
        if self.engine == "tilert":
            from decode_server.engine.tilert import TILERT_NUM_MTP  # torch: only for that engine

            if self.num_mtp not in (0, TILERT_NUM_MTP):
                raise ValueError(f"num_mtp={self.num_mtp}: TileRT's GLM-5 MTP drafts {TILERT_NUM_MTP} tokens per "
                                 f"step; use {TILERT_NUM_MTP} or 0")
        missing = missing_files(self.model, self.engine)
        if missing:
            raise ValueError(
                f"model={str(self.model)!r} lacks {', '.join(missing)}, which the {self.engine} decode server reads "
                "from its model directory: convert with deploy/slurm/setup_deps.sh (it copies them from the "
                "checkpoint), or run `python -m decode_server.model_dir complete --source CHECKPOINT DIR`")
        return self

    @property
    def effective_slots(self) -> int:
        return 1 if self.engine == "tilert" else self.slots

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decode_server",
        description="PD decode server: OpenAI completions/chat over KV received from vLLM prefill. Every option "
                    f"can also be set as {ENV_PREFIX}<OPTION> (e.g. {ENV_PREFIX}KV_TIMEOUT=60); the command line wins.")
    for name, field in DecodeServerSettings.model_fields.items():
        default = "required" if field.is_required() else f"default: {field.default}"
        parser.add_argument(_flag(name), dest=name, default=None,
                            help=f"{field.description} ({default}; env {ENV_PREFIX}{name.upper()})")
    return parser


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> DecodeServerSettings:
    """Parse and validate; raises :class:`SettingsError` naming option, value and reason."""
    env = os.environ if env is None else env
    args = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    for name in DecodeServerSettings.model_fields:
        if args.get(name) is not None:
            values[name] = args[name]
        elif f"{ENV_PREFIX}{name.upper()}" in env:
            values[name] = env[f"{ENV_PREFIX}{name.upper()}"]
    try:
        return DecodeServerSettings.model_validate(values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            name = str(err["loc"][0]) if err.get("loc") else ""
            if name:
                problems.append(f"{_flag(name)} {values.get(name)!r}: {err['msg']}")
            else:
                problems.append(err["msg"])
        raise SettingsError("invalid settings: " + "; ".join(problems)) from exc
