"""The decode server's state: its configuration, engine, KV receiver, slots and metrics, and
how it loads, drains and shuts down. The routes (:mod:`decode_server.server.routes`) and the app
(:mod:`decode_server.server.app`) import it; it imports neither."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from connector.layout import KVLayout
from connector.receiver import SlotSource
from connector.receiver_state import ReceiverStats
from decode_server.engine.base import Engine
from decode_server.engine.process import GrammarRequests, ProcessEngine
from decode_server.engine.structured import GrammarCompiler
from decode_server.server.generation import GenerationContext, Receiver
from decode_server.server.metrics import DecodeMetrics
from decode_server.server.request_plan import ServerLimits
from decode_server.server.slots import SlotTable
from decode_server.server.text import GenerationDefaults, TextTokenizer
from pd_build.info import BuildInfo, collect
from pd_grammar.spec import JsonWhitespace, SchemaLimits, warm_up
from pd_http.drain import wait_then_cut
from pd_http.heap import freeze_startup_heap
from pd_http.tracing import Tracing
from pd_wire.handoff import HandoffResult

log = logging.getLogger(__name__)
DRAIN_ABORT_WAIT_S = 5.0  # after the drain timeout: how long aborted generations may take to end


class ManagedReceiver(Receiver, Protocol):
    """The full receiver surface the app drives (see connector.receiver.KVReceiver)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    @property
    def endpoint(self) -> str: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def listening(self) -> bool: ...

    def peers(self) -> list[Any]: ...

    def busy_slots(self) -> int: ...

    @property
    def stats(self) -> ReceiverStats: ...

    def use_slots(self, slots: SlotSource) -> None: ...

    async def post_result(self, result: HandoffResult) -> bool: ...


@dataclass(frozen=True)
class AppConfig:
    """What the app needs from the settings (see :mod:`decode_server.settings`)."""

    model_dir: Path
    served_model_name: str
    engine: str
    slots: int
    max_seq_len: int
    num_mtp: int
    kv_timeout: float
    write_timeout: float = 60.0  # an answer's wait for its client to take the next bytes (then aborted)
    max_queue: int = 4096  # decode requests that may wait for a slot (from all routers together)
    reasoning_parser: bool = False
    tool_call_parser: bool = False
    schema_limits: SchemaLimits = SchemaLimits()  # structured output's bounds on a request's schemas
    json_whitespace: JsonWhitespace = "any"  # structured output's JSON whitespace (as prefill's vLLM)
    api_key: str | None = field(default=None, repr=False)  # Bearer, on all routes but /health, /ready, /metrics
    # freeze the start-up heap once loaded (pd_http.heap): the process entry point's, not a test's
    freeze_heap: bool = False
    # keep a cleanly ended sequence's KV in its slot for the conversation's next turn (where the
    # engine can decode from kept KV: EngineCapabilities.keeps_kv)
    keep_kv: bool = True


EngineFactory = Callable[[], Engine]
ReceiverFactory = Callable[[KVLayout, int, int], ManagedReceiver]  # (layout, slots, max_tokens)


@dataclass
class DecodeState:
    config: AppConfig
    tokenizer: TextTokenizer
    defaults: GenerationDefaults
    slots: SlotTable
    metrics: DecodeMetrics
    engine: Engine | None = None
    receiver: ManagedReceiver | None = None
    context: GenerationContext | None = None
    limits: ServerLimits | None = None
    load_error: str | None = None
    executor: ThreadPoolExecutor | None = None
    draining: bool = False
    tracing: Tracing | None = None  # None: tracing off

    @property
    def ready(self) -> bool:
        return (self.context is not None and self.receiver is not None and self.receiver.listening
                and not self.draining and (self.engine is None or self.engine.failure() is None))

    def not_ready_reason(self) -> str:
        if self.draining:
            return "draining (shutting down)"
        if self.load_error:
            return f"engine or KV receiver failed to start: {self.load_error}"
        if self.engine is None:
            return "engine is loading"
        if (failure := self.engine.failure()) is not None:
            return f"engine failed: {failure}"
        if self.receiver is None or not self.receiver.listening:
            return "KV receiver is not listening"
        return "starting"

    async def load(self, engine_factory: EngineFactory, receiver_factory: ReceiverFactory) -> None:
        cfg = self.config
        self.engine = await asyncio.to_thread(engine_factory)
        caps = self.engine.capabilities
        if caps.slots < cfg.slots:
            raise RuntimeError(f"--slots {cfg.slots}: the {caps.engine} engine supports {caps.slots}")
        problem = self.defaults.unsupported_by(caps.features)
        if problem is not None:  # vLLM would apply it to the first token, this engine not to the rest
            raise RuntimeError(f"{problem}, which the {caps.engine} engine does not implement (vLLM prefill "
                               "applies it to the first token): remove it from generation_config.json")
        receiver = receiver_factory(self.engine.kv_layout, cfg.slots, cfg.max_seq_len)
        receiver.use_slots(_KVSlots(self.slots))  # a KV push lands on its decode request's slot
        self.slots.keeps_kv = cfg.keep_kv and caps.keeps_kv
        await receiver.start()
        self.receiver = receiver
        self.metrics.set_build(build_info(cfg, receiver.fingerprint))
        self.executor = ThreadPoolExecutor(max_workers=cfg.slots, thread_name_prefix="decode-slot")
        self.limits = ServerLimits(max_seq_len=cfg.max_seq_len, features=caps.features,
                                   engine=caps.engine, model_name=cfg.served_model_name,
                                   reasoning_parser=cfg.reasoning_parser, tool_call_parser=cfg.tool_call_parser,
                                   schema_limits=cfg.schema_limits)
        grammars = None
        if caps.features.structured_output:  # compiled where the engine runs
            grammars = GrammarRequests() if isinstance(self.engine, ProcessEngine) else \
                GrammarCompiler(cfg.model_dir, cfg.json_whitespace)
        # the schema checks' imports before the first request plans one (xgrammar only with an engine using it)
        await asyncio.to_thread(warm_up, caps.features.structured_output)
        self.context = GenerationContext(engine=self.engine, receiver=receiver, tokenizer=self.tokenizer,
                                         slots=self.slots, metrics=self.metrics, executor=self.executor,
                                         kv_timeout=cfg.kv_timeout, write_timeout=cfg.write_timeout,
                                         tracing=self.tracing, grammars=grammars)
        if cfg.freeze_heap:
            freeze_startup_heap("decode server")
        log.info("decode server ready: engine=%s slots=%d kv_endpoint=%s", caps.engine, cfg.slots, receiver.endpoint)

    async def drain(self, timeout: float) -> None:
        """SIGTERM: ``/ready`` turns 503 and new requests are refused (503 + Retry-After; the
        router runs them on another decode server); generations in flight may finish for
        ``timeout`` seconds, then end with an error (as at shutdown)."""
        self.draining = True
        self.slots.close()

        def cut() -> None:
            for job in self.slots.jobs():
                job.abort("shutdown")

        await wait_then_cut(self.slots.wait_idle, lambda: self.slots.busy, cut, timeout, DRAIN_ABORT_WAIT_S,
                            "generation(s)")

    async def shutdown(self) -> None:
        for job in self.slots.jobs():
            job.abort("shutdown")
        if self.receiver is not None:
            await self.receiver.stop()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        if self.tracing is not None:  # exports what is still queued
            await asyncio.to_thread(self.tracing.shutdown)


@dataclass(frozen=True)
class _KVSlots:
    """The receive slots of the KV receiver are the slot table's: an Admit for a handoff lands
    on the slot its decode request holds (or a free one nobody waits for)."""

    table: SlotTable

    def take(self, handoff_id: str) -> int | None:
        return self.table.take_for_kv(handoff_id)

    def give(self, handoff_id: str, slot: int) -> None:
        self.table.release(handoff_id, "kv")

    def reuse(self, handoff_id: str, slot: int, prefix: Sequence[str], num_tokens: int) -> int:
        return self.table.reuse(handoff_id, prefix, num_tokens)


def build_info(config: AppConfig, kv_layout: str | None = None) -> BuildInfo:
    """What this decode server runs (``kv_layout``: the receiver's layout fingerprint, once loaded)."""
    return collect("decode", model=config.served_model_name, model_dir=config.model_dir, kv_layout=kv_layout)


