"""``python -m pd_deploy.stack`` (console script ``pd-stack``): run the whole PD stack locally.

With no ``--model-dir`` it generates the embedded default, the tiny GLM-family model
(MLA + MoE + 1 MTP layer), once, under ``--cache-dir``. Every option is also
``PD_STACK_<OPTION>`` or a key of the ``--config`` YAML file (:mod:`pd_settings.loader`).
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import SettingsConfigDict

from pd_deploy.stack.launcher import Stack, StackConfig, usage_text
from pd_deploy.stack.ports import PortInUse, check_free
from pd_http.tracing import check_endpoint
from pd_settings.loader import EntrySettings, load
from pd_settings.parsers import ReasoningParser, ToolCallParser
from pd_settings.problems import SettingsError

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL_NAME = "tiny-glm"  # the served name of the generated default model


class StackSettings(EntrySettings):
    """Run the whole PD stack locally: decode server(s), vLLM prefill with TileRTConnector, the router."""

    model_config = SettingsConfigDict(env_prefix="PD_STACK_", cli_prog_name="pd-stack")

    model_dir: Path | None = Field(None, description="HF checkpoint to serve (default: the generated tiny model)")
    served_model_name: str | None = Field(
        None, min_length=1,
        description=f"model name clients use (default: {TINY_MODEL_NAME!r} for the tiny model, "
                    "else the directory name)")
    cache_dir: Path = Field(REPO / ".cache" / "tiny-model", description="where the tiny model is generated and cached")
    seed: int = Field(0, description="tiny model seed")
    layers: int = Field(2, ge=1, description="tiny model main layers (+1 MTP)")
    log_dir: Path = Field(REPO / "run" / "logs", description="one log file per process")
    host: str = Field("127.0.0.1", min_length=1, description="bind address of every server")
    router_port: int = Field(8000, ge=1, le=65535, description="router HTTP port")
    prefill_port: int = Field(8100, ge=1, le=65535, description="vLLM prefill HTTP port")
    decode_port: int = Field(8200, ge=1, le=65535, description="HTTP port of the first decode server (+i for the i-th)")
    kv_port: int = Field(9100, ge=1, le=65535,
                         description="KV control port of the first decode server (+i for the i-th)")
    num_decode: int = Field(1, ge=1, description="decode servers")
    engine: Literal["reference", "tilert"] = Field("reference", description="decode engine")
    decode_slots: int = Field(1, ge=1, description="concurrent sequences per decode server")
    max_seq_len: int = Field(4096, ge=1, description="longest prompt + output, in tokens")
    prefill_mtp: bool = Field(True, description="start vLLM with MTP (--no-prefill-mtp: see the handshake reject it)")
    start_timeout: float = Field(300.0, gt=0, description="seconds per readiness gate")
    tool_call_parser: ToolCallParser = Field("glm47", description="the decode servers' GLM tool-call parser "
                                             "(vLLM's names; none: tool calls stay in the content)")
    reasoning_parser: ReasoningParser = Field(
        "none", description="the decode servers' reasoning parser: glm45 splits <think>..</think> into "
        "reasoning, as vLLM's --reasoning-parser glm45 (none: the thinking stays in the content, as vLLM "
        "answers without the flag)")
    otlp_traces_endpoint: str | None = Field(
        None, description="OTLP/gRPC collector (e.g. http://127.0.0.1:4317) the router, vLLM and the decode servers "
        "send their spans to: one trace per request (docs/observability.md)")

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _otlp(cls, value: str | None) -> str | None:
        return None if value is None else check_endpoint(value)

    @field_validator("decode_slots")
    @classmethod
    def _tilert_batch(cls, value: int, info: ValidationInfo) -> int:
        if info.data.get("engine") == "tilert" and value != 1:
            raise ValueError("the tilert engine serves batch size 1")
        return value

    @field_validator("model_dir")
    @classmethod
    def _checkpoint(cls, value: Path | None) -> Path | None:
        if value is not None and not (value / "config.json").is_file():
            raise ValueError("no config.json there")
        return value


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> StackSettings:
    return load(StackSettings, sys.argv[1:] if argv is None else argv, env)


def _config(args: StackSettings, model_dir: Path, served: str | None) -> StackConfig:
    return StackConfig(model_dir=model_dir.resolve(), log_dir=args.log_dir.resolve(), host=args.host,
                       router_port=args.router_port, prefill_port=args.prefill_port, decode_port=args.decode_port,
                       kv_port=args.kv_port, num_decode=args.num_decode, engine=args.engine,
                       decode_slots=args.decode_slots, max_seq_len=args.max_seq_len, prefill_mtp=args.prefill_mtp,
                       start_timeout_s=args.start_timeout, served_model_name=served,
                       otlp_traces_endpoint=args.otlp_traces_endpoint, tool_call_parser=args.tool_call_parser,
                       reasoning_parser=args.reasoning_parser)


def main(argv: list[str] | None = None) -> int:
    try:
        args = load_settings(argv)
    except SettingsError as exc:
        print(f"pd-stack: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pd-stack %(message)s", datefmt="%H:%M:%S")
    log = logging.getLogger("pd_stack")
    model_dir, served = args.model_dir, args.served_model_name
    try:  # before the model is generated: a busy port fails at once
        check_free(_config(args, model_dir or args.cache_dir, served).port_needs())
    except PortInUse as exc:
        log.error("start-up failed: %s", exc)
        return 1
    if model_dir is None:
        served = served or TINY_MODEL_NAME
        from decode_server.tiny_model import ensure_tiny_model

        log.info("tiny model: generating or reusing under %s", args.cache_dir)
        model_dir = ensure_tiny_model(args.cache_dir, seed=args.seed, layers=args.layers)
        log.info("tiny model: %s", model_dir)
    cfg = _config(args, model_dir, served)
    stack = Stack(cfg)

    def _terminate(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    # Ctrl-C stops the stack even when started from a shell that ignores SIGINT for
    # background jobs (the children inherit an ignored SIGINT; Python then installs no handler)
    signal.signal(signal.SIGINT, _terminate)
    try:
        stack.start()
        print(usage_text(cfg), flush=True)
        while True:
            dead = stack.dead()
            if dead:
                log.error("%s exited with %s; stopping the stack. Log tail:\n%s", dead[0].name,
                          dead[0].proc.returncode, dead[0].log_tail())
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        log.info("stopping")
        return 0
    except Exception as exc:  # a failed gate: say why, stop everything
        log.error("start-up failed: %s", exc)
        return 1
    finally:
        stack.stop()
        log.info("all processes stopped")


if __name__ == "__main__":
    sys.exit(main())
