"""A scripted decode engine implementing decode_server.engine.base.Engine, for unit tests.

Each session replays a token script (after the handoff's first token) ``per_step``
tokens per GPU step (or a seeded draw of MTP's accepted drafts), ``steps_per_call`` GPU
steps per ``step()``, optionally waiting ``step_delay`` seconds per GPU step (sleeping in
small slices, so that ``cancel`` interrupts it at once, or spinning without the GIL). It
records every start/close and counts live sessions, so tests can check that nothing leaks.
"""

from __future__ import annotations

import functools
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from connector.layout import KVLayout, cpu_mla_layout
from decode_server.engine.base import (
    Cancelled,
    DecodeSession,
    Engine,
    EngineCapabilities,
    EngineError,
    SamplingParams,
    TokenOut,
)
from pd_wire.decode import EngineFeatures


def fake_logprob(token_id: int) -> float:
    return -0.25 - (token_id % 7) * 0.1


@dataclass
class FakeEngineConfig:
    script: list[int] = field(default_factory=list)  # tokens after the first one
    per_step: int = 1  # >1 emulates MTP (accepted drafts + bonus)
    # None: every GPU step emits per_step tokens; p: 1 + the drafts accepted in a row, each with probability p
    # (a seeded draw, the same in every session), as MTP's verify
    accept: float | None = None
    steps_per_call: int = 1  # GPU steps per step() call, fewer when max_tokens is near (TileRT's ar_steps)
    step_delay: float = 0.0  # seconds per GPU step
    step_gil: float = 0.0  # seconds of each call's delay spent holding the GIL (Python work), the rest released
    # how the rest is waited for: "sleep" (in slices: cancel interrupts at once), or "spin": a busy wait with the
    # GIL released, in one piece, as CUDA waits for a GPU by default on a host with more cores than GPUs
    gpu_wait: str = "sleep"
    slots: int = 4
    supports_logprobs: bool = True
    fail_start: str | None = None  # EngineError message raised by start()
    fail_at_step: int | None = None  # EngineError raised by this step (1-based)
    filler_token: int = 0  # emitted once the script is exhausted
    hold_start: bool = False  # start() (KV injection) waits for engine.release_start; engine.in_start says it began
    close_delay: float = 0.0  # seconds close() takes (engine state reset)


def spin_for(seconds: float) -> None:
    """Busy-wait ``seconds`` without the GIL (a compiled loop reading the monotonic clock)."""
    if seconds > 0:
        spin_until, clock = _spinner()
        spin_until(time.monotonic_ns() + int(seconds * 1e9), clock)


@functools.cache
def _spinner() -> tuple[Any, Any]:
    import ctypes

    import numba
    import numpy as np

    clock_gettime = ctypes.CDLL(None).clock_gettime
    clock_gettime.argtypes = [ctypes.c_int, ctypes.c_void_p]
    clock_gettime.restype = ctypes.c_int
    monotonic = time.CLOCK_MONOTONIC

    @numba.njit(nogil=True)
    def spin_until(deadline_ns: int, ts: Any) -> None:
        while True:
            clock_gettime(monotonic, ts.ctypes.data)
            if ts[0] * 1_000_000_000 + ts[1] >= deadline_ns:
                return

    ts = np.zeros(2, dtype=np.int64)  # struct timespec
    spin_until(0, ts)  # compiled here, not in the first step
    return spin_until, ts


class FakeSession(DecodeSession):
    def __init__(self, engine: FakeEngine, params: SamplingParams, script: list[int]) -> None:
        self._engine = engine
        self._params = params
        self._script = script
        self._pos = 0
        self._steps = 0
        self._produced = 1  # the first token (prefill's) counts toward max_tokens
        self._draws = random.Random(0)  # MTP acceptance: the same tokens per step in every session
        super().__init__()
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            time.sleep(self._engine.config.close_delay)
            self._engine._session_closed(self)

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self._cancel.is_set():
                raise Cancelled("cancelled")
            time.sleep(min(0.002, max(0.0, end - time.monotonic())))

    def _gpu_steps(self) -> int:
        """This call's GPU steps: ``steps_per_call``, fewer when ``max_tokens`` is near (as
        the TileRT adapter limits ``ar_steps``)."""
        cfg = self._engine.config
        left = self._params.max_tokens - self._produced
        return max(1, min(cfg.steps_per_call, -(-left // cfg.per_step)))

    def _step_tokens(self) -> int:
        cfg = self._engine.config
        if cfg.accept is None:
            return cfg.per_step
        n = 1
        while n < cfg.per_step and self._draws.random() < cfg.accept:
            n += 1
        return n

    def step(self) -> list[TokenOut]:
        cfg = self._engine.config
        if self._cancel.is_set():
            raise Cancelled("cancelled")
        self._steps += 1
        self._engine.steps += 1
        gpu_steps = self._gpu_steps()
        if cfg.step_gil > 0:  # a Python busy loop: the GIL held, as an engine's own Python per call
            end = time.perf_counter() + cfg.step_gil
            while time.perf_counter() < end:
                pass
        if cfg.gpu_wait == "spin":
            spin_for(cfg.step_delay * gpu_steps - cfg.step_gil)
        else:
            self._sleep(cfg.step_delay * gpu_steps - cfg.step_gil)
        if cfg.fail_at_step is not None and self._steps == cfg.fail_at_step:
            raise EngineError(f"scripted failure at step {self._steps}")
        out: list[TokenOut] = []
        for _ in range(gpu_steps):
            n = self._step_tokens()
            for _ in range(n):
                tok = self._script[self._pos] if self._pos < len(self._script) else cfg.filler_token
                self._pos += 1
                if self._params.logprobs is not None:
                    top = tuple((tok + k, fake_logprob(tok) - 0.5 * k) for k in range(max(self._params.logprobs, 0)))
                    out.append(TokenOut(tok, fake_logprob(tok), top))
                else:
                    out.append(TokenOut(tok))
            if cfg.per_step > 1:
                self._stats.steps += 1
                self._stats.drafted += cfg.per_step - 1
                self._stats.accepted += n - 1
        self._produced += len(out)
        return out


class FakeEngine(Engine):
    def __init__(self, config: FakeEngineConfig | None = None, layout: KVLayout | None = None) -> None:
        self.config = config or FakeEngineConfig()
        self._layout = layout or cpu_mla_layout(2, 1)
        self._lock = threading.Lock()
        self.live: set[FakeSession] = set()
        self.started: list[tuple[str, SamplingParams]] = []
        self.closed = 0
        self.steps = 0
        self.scripts: dict[str, list[int]] = {}  # per handoff id, overrides config.script
        self.in_start = threading.Event()  # a start() began
        self.release_start = threading.Event()  # with hold_start: lets start() return

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(model="fake", engine="fake", slots=self.config.slots, max_seq_len=1 << 20,
                                  num_mtp=self.config.per_step - 1, features=EngineFeatures(
            logprobs=self.config.supports_logprobs))

    @property
    def kv_layout(self) -> KVLayout:
        return self._layout

    def start(self, kv, handoff, params: SamplingParams) -> FakeSession:
        if kv.handoff_id != handoff.handoff_id:
            raise EngineError(f"KV of {kv.handoff_id!r} given for handoff {handoff.handoff_id!r}")
        if self.config.fail_start:
            raise EngineError(self.config.fail_start)
        self.in_start.set()
        if self.config.hold_start and not self.release_start.wait(30):
            raise EngineError("start() held for 30 s: the test never released it")
        session = FakeSession(self, params, list(self.scripts.get(handoff.handoff_id, self.config.script)))
        with self._lock:
            self.live.add(session)
            self.started.append((handoff.handoff_id, params))
        return session

    def _session_closed(self, session: FakeSession) -> None:
        with self._lock:
            self.live.discard(session)
            self.closed += 1

    def live_sessions(self) -> int:
        with self._lock:
            return len(self.live)
