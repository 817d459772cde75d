"""Decode server overhead per output token: a scripted engine (tests/fakes/fake_engine.py)
driven (a) directly in a loop (baseline) and (b) through the real server on loopback
(SSE streaming, C concurrent clients; the server runs in its own process, on uvloop and
httptools as ``python -m decode_server`` runs it, or ``--loop asyncio``). Prints
tokens/s of both and their ratios, measured in the same run.

    python bench/decode_server_overhead.py [--step-ms 3.19] [--tokens 256] [--concurrency 1 4]
        [--steps-per-call 8 --mtp 3 --accept 0.8] [--gil-us 100] [--gpu-wait spin] [--load]
        [--engine-in thread process] [--timeline] [--loop asyncio]

An engine call is ``--steps-per-call`` GPU steps of ``--step-ms`` (the TileRT adapter's
``ar_steps``: 8, 1 under structured output), each emitting 1 + the MTP drafts accepted (a
seeded draw, the same alone and through the server); ``--gil-us`` of each call hold the GIL,
the rest is waited for sleeping or, ``--gpu-wait spin``, spinning without the GIL (as CUDA).

Three ratios per run against the engine alone: tokens/s per user (C streams' tokens over
the time to the last one's end, TTFT included, over C), each stream's own tokens/s, and the
*pace*, tokens/s from each stream's first chunk to its last (the TPOT the user sees).
The measured client is aiohttp (as vLLM's benchmark and AIPerf), its C connections open
before the streams start (as a router's pool holds them).
``--load`` runs the measured streams beside a realistic load (:func:`realistic_load`).
``--engine-in``: the server's engine on the slot's worker thread, or in a process of its
own (``--engine-process``), each against the same baseline. ``--engine reference``: the
reference engine decoding the tiny model on this CPU (after ``--context`` tokens of zero KV,
``--mtp`` drafts) instead of the scripted engine.

``--timeline`` (engine on a thread): the server process also records, on each slot's worker
thread, when each engine call starts and ends and how long the work between two calls takes
by part (the sequence processor's work there, ``proc``: its ``cut``, the token-level stop
conditions, or before issue 50 its whole ``feed``; the metrics; the post of the tokens to the
event loop); the rest of a gap is the thread waiting for the GIL and the loop's own work.
Printed per run: the gap between one call's end and the next one's start, p50 / p90 / mean,
its mean by part, and a call's mean time against the engine alone. The wrappers cost ~1 us
per call, counted in the gap.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from decode_server.engine.base import Engine, SamplingParams
from decode_server.engine.build import EngineBuild
from pd_wire.decode import CAPABILITIES_PATH
from pd_wire.handoff import HandoffClaim, HandoffResult, SlotWait
from tests.decode_server.conftest import build_model_dir, start_server
from tests.fakes.fake_engine import FakeEngine, FakeEngineConfig
from tests.fakes.fake_receiver import zero_kv


def baseline(engine: Engine, tokens: int, prompt_tokens: int) -> tuple[float, float]:
    """The engine alone, a sequence of ``tokens`` (the first, prefill's, free) after a prompt of
    ``prompt_tokens``: tokens/s and seconds per call."""
    h = HandoffResult(handoff_id="b", kv_endpoint="x:1", num_prompt_tokens=prompt_tokens, first_token_id=5,
                      last_prompt_token_id=1, status="sent")
    kv = zero_kv(engine.kv_layout, prompt_tokens, "b")  # as the server's (fake) receiver hands it over
    warm = engine.start(kv, h, SamplingParams(max_tokens=8))
    warm.step()  # the spinning wait, the reference engine's attention loop: compiled on their first use
    warm.close()
    session = engine.start(kv, h, SamplingParams(max_tokens=tokens))
    t0 = time.perf_counter()
    produced = calls = 1
    while produced < tokens:
        produced += len(session.step())
        calls += 1
    dt = time.perf_counter() - t0
    session.close()
    return tokens / dt, dt / (calls - 1)


async def through_server(url: str, tokens: int, concurrency: int, on_warm: Callable[[], None] | None = None,
                         on_measured: Callable[[], None] | None = None, load: bool = False,
                         prompt_tokens: int = 4, slow_tokens: int | None = None) -> tuple[float, float, float, float]:
    """Tokens/s of ``concurrency`` streams at once, their pace (tokens/s from the first chunk
    to the last, per stream: the TPOT the user sees, without the TTFT), each stream's own
    tokens/s (from its request to its last chunk, mean over the streams), and the median time
    to the first chunk of 20 sequential requests; ``on_warm``
    runs after the warm-up request, ``on_measured`` after the concurrent streams. ``load``:
    the concurrent streams run beside :func:`realistic_load` (its slow reader's stream:
    ``slow_tokens``, default 16 times ``tokens``). Tokens are counted from the
    final usage; the first chunk is the first token alone."""
    ttfts: list[float] = []
    paces: list[float] = []
    users: list[float] = []  # per stream: its tokens over its own time, its TTFT included

    async def one(client: aiohttp.ClientSession, i: int) -> int:
        body = {"prompt": "x", "max_tokens": tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
                "kv_transfer_params": {"handoff_id": f"b{i}-{time.monotonic_ns()}", "kv_endpoint": "x:1",
                                       "num_prompt_tokens": prompt_tokens, "first_token_id": 5,
                                       "last_prompt_token_id": 1, "status": "sent"}}
        n = 0
        data = json.dumps(body).encode()
        t0 = time.perf_counter()
        first = last = 0.0
        async with client.post(url + "/v1/completions", data=data, headers=JSON) as r:
            if r.status != 200:
                raise RuntimeError(f"the server answered {r.status}: {(await r.read())[:300]!r}")
            async for line in r.content:  # the SSE lines
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    if event["choices"]:
                        last = time.perf_counter()
                        if not first:
                            first = last
                            ttfts.append(first - t0)
                    if event.get("usage"):
                        n = event["usage"]["completion_tokens"]
        if n != tokens:
            raise RuntimeError(f"a stream had {n} tokens of {tokens}")
        paces.append((n - 1) / (last - first))
        users.append(n / (last - t0))
        return n

    async def capabilities(client: aiohttp.ClientSession) -> dict:
        async with client.get(url + CAPABILITIES_PATH) as r:
            return await r.json()

    async def settled(client: aiohttp.ClientSession, busy: int) -> None:
        """Until the server holds ``busy`` slots (an answer's slot is given back just after its
        last byte: a request sent at once could find it still taken)."""
        for _ in range(2000):  # the server's state polled (at most 10 s)
            if (await capabilities(client))["busy_slots"] <= busy:
                return
            await asyncio.sleep(0.005)
        raise RuntimeError(f"the server never came down to {busy} busy slots")

    # the measured client: aiohttp (vLLM's benchmark and AIPerf's), its ``concurrency``
    # connections opened before the streams, as a router's pool holds its connections open
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as client:
        await one(client, -1)  # warm-up (first request imports torch in the fake receiver)
        if on_warm is not None:
            on_warm()
        paces.clear()
        # the load from a process of its own: its work competes with the server, not with this client
        loader = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--load-gen", url, str(concurrency), str(slow_tokens or 16 * tokens),
            str(prompt_tokens),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, cwd=REPO) if load else None
        if loader is not None and loader.stdout is not None:  # started, its slow reader reading: the steady load
            await asyncio.wait_for(loader.stdout.readline(), 60)
        await settled(client, 1 if load else 0)
        await asyncio.gather(*(capabilities(client) for _ in range(concurrency)))  # the connections, open
        users.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(concurrency)))
        dt = time.perf_counter() - t0
        if loader is not None and loader.stdin is not None:
            loader.stdin.close()  # it stops
            await asyncio.wait_for(loader.wait(), 30)
        if on_measured is not None:
            on_measured()
        pace, user = statistics.fmean(paces), statistics.fmean(users)
        ttfts.clear()
        for i in range(20):  # time to first chunk, sequential requests
            await settled(client, 0)
            await one(client, 1000 + i)
    return concurrency * tokens / dt, pace, user, statistics.median(ttfts)


JSON = {"content-type": "application/json"}
ROUTERS = 4  # --load: routers sharing the server, each with a standing decode request and probes
PROBE_S = 2.0  # a router's probe interval
SCRAPE_S = 5.0  # Prometheus's scrape interval


async def realistic_load(url: str, concurrency: int, tokens: int, prompt_tokens: int,
                         reading: asyncio.Event | None = None) -> None:
    """What a decode server meets while it decodes, beside the measured streams (until cancelled):
    a client reading its own stream slowly (its slot is the one the server has beside the
    measured ones), and, once every slot is busy, one standing decode request per router in the
    queue (a claim with a wait, as each router keeps one), each router's probe every
    ``PROBE_S`` and a Prometheus scrape every ``SCRAPE_S``. The slow reader's answer is
    ``tokens`` long; ``reading`` is set once it has its first bytes."""
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=2 * ROUTERS + 4)) as client:
        tasks = [asyncio.ensure_future(_slow_reader(client, url, tokens, prompt_tokens, reading or asyncio.Event()))]
        try:
            for _ in range(2000):  # the server's state polled (at most 10 s), not the load timed
                if (await client.get(url + CAPABILITIES_PATH)).json()["busy_slots"] >= concurrency + 1:
                    break
                await asyncio.sleep(0.005)
            else:
                raise RuntimeError("the measured streams and the slow reader never held every slot")
            tasks += [asyncio.ensure_future(_standing(client, url, r)) for r in range(ROUTERS)]
            tasks += [asyncio.ensure_future(_every(client, url + CAPABILITIES_PATH, PROBE_S, r / ROUTERS))
                      for r in range(ROUTERS)]
            tasks.append(asyncio.ensure_future(_every(client, url + "/metrics", SCRAPE_S, 0.0)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def load_until_stdin_closes(url: str, concurrency: int, tokens: int, prompt_tokens: int) -> None:
    """``--load-gen``: :func:`realistic_load` until the parent closes this process's stdin;
    prints a line once the slow reader reads."""
    reading = asyncio.Event()
    load = asyncio.ensure_future(realistic_load(url, concurrency, tokens, prompt_tokens, reading))
    await reading.wait()
    print("reading", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    load.cancel()
    await asyncio.gather(load, return_exceptions=True)


async def _slow_reader(client: httpx.AsyncClient, url: str, tokens: int, prompt_tokens: int,
                       reading: asyncio.Event) -> None:
    body = {"prompt": "x", "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "kv_transfer_params": {"handoff_id": f"slow-{time.monotonic_ns()}", "kv_endpoint": "x:1",
                                   "num_prompt_tokens": prompt_tokens, "first_token_id": 5,
                                   "last_prompt_token_id": 1, "status": "sent"}}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for _ in r.aiter_raw(1024):
            reading.set()
            await asyncio.sleep(0.1)  # the slow client's reading pace (load, not synchronisation)


async def _standing(client: httpx.AsyncClient, url: str, router: int) -> None:
    now = time.monotonic()
    claim = HandoffClaim(handoff_id=f"standing-{router}-{time.monotonic_ns()}", result="with_kv",
                         wait=SlotWait(wait_s=600, holder=f"router-{router}", arrived_at=now, sent_at=now))
    body = {"prompt": "x", "max_tokens": 4, "stream": True, "kv_transfer_params": claim.model_dump()}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for _ in r.aiter_raw():
            pass


async def _every(client: httpx.AsyncClient, url: str, period: float, phase: float) -> None:
    await asyncio.sleep(phase * period)
    while True:
        await client.get(url)
        await asyncio.sleep(period)  # the prober's own interval


class Timeline:
    """Per worker thread, the steps' (start, end) and the parts of the work between them."""

    PARTS = ("proc", "metrics", "post")

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._round = 0  # take() starts a new round: each thread then starts a new record
        self.threads: list[dict[str, list]] = []

    def _mine(self) -> dict[str, list]:
        if getattr(self._local, "round", None) != self._round:
            self._local.round = self._round
            self._local.rec = {"steps": [], **{p: [] for p in self.PARTS}}
            with self._lock:
                self.threads.append(self._local.rec)
        return self._local.rec

    def wrap(self, owner: type, name: str, part: str | None) -> None:
        """Time ``owner.name`` on the calling thread: a step (``part`` None) or a part of a gap."""
        inner = getattr(owner, name)
        clock = time.perf_counter

        def timed(*a, **kw):
            t0 = clock()
            try:
                return inner(*a, **kw)
            finally:
                t1 = clock()
                rec = self._mine()
                if part is None:
                    rec["steps"].append((t0, t1))
                else:  # after step k: its gap's part
                    rec[part].append((len(rec["steps"]), t1 - t0))
        setattr(owner, name, timed)

    def take(self) -> list[dict[str, list]]:
        """The records so far; the next calls start new ones."""
        with self._lock:
            out, self.threads = self.threads, []
            self._round += 1
        return out


def gaps(records: list[dict[str, list]]) -> dict[str, float]:
    """Between consecutive steps of one worker thread: the gap and its parts, in microseconds."""
    gap: list[float] = []
    step: list[float] = []
    parts: dict[str, float] = {p: 0.0 for p in Timeline.PARTS}
    for rec in records:
        steps = rec["steps"]
        step.extend((end - begin) * 1e6 for begin, end in steps)
        for k in range(1, len(steps)):
            gap.append((steps[k][0] - steps[k - 1][1]) * 1e6)
        for p in Timeline.PARTS:  # only what falls between two steps of the same thread
            parts[p] += sum(d for after, d in rec[p] if 0 < after < len(steps)) * 1e6
    if not gap:
        return {}
    q = statistics.quantiles(gap, n=10)
    out = {"n": len(gap), "p50": statistics.median(gap), "p90": q[8], "mean": statistics.fmean(gap),
           "step": statistics.fmean(step)}
    out.update({p: parts[p] / len(gap) for p in Timeline.PARTS})
    out["other"] = out["mean"] - sum(out[p] for p in Timeline.PARTS)
    return out


def engine_build(args: argparse.Namespace, cfg: FakeEngineConfig) -> Callable[[], Engine]:
    """The engine under test, as a picklable callable (the engine process builds it too)."""
    if args.engine == "scripted":
        return functools.partial(FakeEngine, cfg)
    return EngineBuild("reference", reference_model(), slots=cfg.slots, max_seq_len=max_seq_len(args),
                       num_mtp=args.mtp)


def reference_model() -> Path:
    """The tiny GLM-family model the tests use (generated once per host)."""
    from decode_server.tiny_model import ensure_tiny_model

    return ensure_tiny_model(REPO / ".cache" / "tiny-model", seed=0)


def max_seq_len(args: argparse.Namespace) -> int:
    """Room for the prompt and the slow reader's long answer (the tiny model: 4096 positions)."""
    room = prompt_tokens(args) + 16 * args.tokens + 16
    return room if args.engine == "scripted" else min(room, 4096)


def slow_tokens(args: argparse.Namespace) -> int:
    return max_seq_len(args) - prompt_tokens(args) - 16


def prompt_tokens(args: argparse.Namespace) -> int:
    return args.context if args.engine == "reference" else 4


def serve(args: argparse.Namespace, cfg: FakeEngineConfig) -> None:
    """Child process: the real server app with the engine under test; prints its URL. With
    ``--timeline``, a line of the timeline's gaps (JSON) on stdout after each ``timeline``
    line on stdin."""
    timeline = None
    if args.timeline:
        from decode_server.engine.reference import ReferenceSession
        from decode_server.server.generation import Job
        from decode_server.server.metrics import DecodeMetrics
        from decode_server.server.sequence import SequenceProcessor
        from tests.fakes.fake_engine import FakeSession

        timeline = Timeline()
        timeline.wrap(FakeSession if args.engine == "scripted" else ReferenceSession, "step", None)
        # the sequence processor's work on the worker: its token-level half (before issue 50: all of it)
        timeline.wrap(SequenceProcessor, "cut" if hasattr(SequenceProcessor, "cut") else "feed", "proc")
        timeline.wrap(DecodeMetrics, "step", "metrics")
        timeline.wrap(DecodeMetrics, "spec", "metrics")
        timeline.wrap(Job, "_post", "post")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model_dir(Path(tmp) / "m") if args.engine == "scripted" else reference_model()
        build = engine_build(args, cfg)
        if args.engine_in == ["process"]:  # python -m decode_server --engine-process
            from decode_server.engine.process import ProcessEngine

            engine = ProcessEngine(build, log_level="warning")
        else:
            engine = build()
        # --load: a slot for the slow reader beside the measured streams
        srv, server, thread = start_server(model, cfg, slots=max(args.concurrency) + args.load,
                                           max_seq_len=max_seq_len(args), loop=args.loop, engine=engine,
                                           kv_tokens=prompt_tokens(args))
        print(srv.url, flush=True)
        for line in sys.stdin:  # until the parent closes our stdin
            if line.strip() == "timeline" and timeline is not None:
                print(json.dumps(gaps(timeline.take())), flush=True)
        server.should_exit = True
        thread.join(10)
        if engine is not None:
            engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-ms", type=float, default=3.19, help="GPU step time (TileRT GLM-5.1's TPOT, 3.19 ms; "
                    "with --mtp, a step's time is its tokens' time)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--gil-us", type=float, default=0.0, help="of each call, the microseconds the engine holds "
                    "the GIL (its own Python: launching the steps, reading the tokens back), the rest released "
                    "(the GPU's time)")
    ap.add_argument("--steps-per-call", type=int, default=1, help="GPU steps per engine call (the TileRT adapter's "
                    "ar_steps: 8, 1 under structured output), fewer when max_tokens is near")
    ap.add_argument("--mtp", type=int, default=0, help="MTP drafts per GPU step (TileRT GLM-5.1: 3)")
    ap.add_argument("--accept", type=float, help="each draft accepted (after the one before it) with this "
                    "probability, a seeded draw the same for the engine alone and the server (default: all)")
    ap.add_argument("--gpu-wait", choices=("sleep", "spin"), default="sleep",
                    help="how the engine waits for the rest of its step (the GPU's time): sleeping, or spinning "
                    "with the GIL released, as CUDA waits by default on a host with more cores than GPUs (a core "
                    "per spinning sequence: on a small machine, use it at C=1)")
    ap.add_argument("--timeline", action="store_true", help="also the gaps between engine steps in the server, "
                    "and what fills them")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="the server's event loop (python -m decode_server runs uvloop)")
    ap.add_argument("--load", action="store_true", help="the measured streams beside a realistic load: a slow "
                    f"reader's stream, {ROUTERS} routers' standing decode requests and probes every {PROBE_S:g} s, "
                    f"a Prometheus scrape every {SCRAPE_S:g} s")
    ap.add_argument("--switch-interval", type=float, help="the server process's sys.setswitchinterval (s): how "
                    "long a thread waiting for the GIL lets its holder run before asking it to let go "
                    "(Python's default 0.005)")
    ap.add_argument("--engine-in", nargs="+", choices=("thread", "process"), default=["thread", "process"],
                    help="where the server runs the engine: on a worker thread of its own process, or in a process "
                    "of its own (decode_server/engine/process.py: python -m decode_server --engine-process); each is "
                    "measured, in this order, against the same baseline")
    ap.add_argument("--engine", choices=("scripted", "reference"), default="scripted",
                    help="the engine under test: the scripted one (tests/fakes/fake_engine.py), or the reference "
                    "engine decoding the tiny model on this CPU (--mtp drafts, after a prompt of --context tokens of "
                    "zero KV; the step options do not apply)")
    ap.add_argument("--context", type=int, default=1024, help="the reference engine's prompt, in tokens")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--load-gen", nargs=4, metavar=("URL", "C", "TOKENS", "PROMPT_TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_gen:
        url, c, tokens, prompt = args.load_gen
        asyncio.run(load_until_stdin_closes(url, int(c), int(tokens), int(prompt)))
        return
    filler = 200  # one byte-level token: one character per token
    if not 0 <= args.gil_us <= args.step_ms * 1000:
        ap.error("--gil-us must be within the step")
    if args.steps_per_call < 1 or args.mtp < 0 or (args.accept is not None and not 0 <= args.accept <= 1):
        ap.error("--steps-per-call >= 1, --mtp >= 0, --accept in [0, 1]")
    cfg = FakeEngineConfig(script=[], filler_token=filler, step_delay=args.step_ms / 1000, step_gil=args.gil_us / 1e6,
                           per_step=args.mtp + 1, accept=args.accept, steps_per_call=args.steps_per_call,
                           gpu_wait=args.gpu_wait,
                           slots=max(args.concurrency) + args.load)
    if args.serve:
        serve(args, cfg)
        return
    alone = engine_build(args, cfg)()
    base, base_step = baseline(alone, args.tokens, prompt_tokens(args))
    alone.shutdown()
    what = (f"GPU step {args.step_ms} ms, {args.steps_per_call} per call, {args.mtp} MTP drafts"
            + (f" accepted at {args.accept:g}" if args.accept is not None else "") if args.engine == "scripted"
            else f"the reference engine, tiny model, {args.context}-token prompt, {args.mtp} MTP drafts")
    print(f"engine alone: {base:8.1f} tok/s ({1000 / base:.2f} ms/token, {base_step * 1000:.2f} ms/call; "
          f"{what}; 1 sequence)")
    runs = [(c, where) for c in args.concurrency for where in args.engine_in]
    for c, where in runs:  # a server per run: its slots are the measured streams (+ the slow reader)
        argv = ["--engine", args.engine, "--context", str(args.context),
                "--step-ms", str(args.step_ms), "--tokens", str(args.tokens), "--gil-us", str(args.gil_us),
                "--gpu-wait", args.gpu_wait, "--steps-per-call", str(args.steps_per_call), "--mtp", str(args.mtp),
                *(["--accept", str(args.accept)] if args.accept is not None else []),
                "--engine-in", where,
                "--loop", args.loop, "--concurrency", str(c), *(["--timeline"] if args.timeline else []),
                *(["--load"] if args.load else []),
                *(["--switch-interval", str(args.switch_interval)] if args.switch_interval is not None else [])]
        child = subprocess.Popen([sys.executable, __file__, "--serve", *argv],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        try:
            url = child.stdout.readline().strip()
            measured: dict[str, float] = {}

            def ask(child: subprocess.Popen = child) -> dict[str, float]:
                child.stdin.write("timeline\n")
                child.stdin.flush()
                return json.loads(child.stdout.readline())

            hooks = (lambda: ask(), lambda m=measured: m.update(ask())) if args.timeline else (None, None)
            rate, pace, user, ttft = asyncio.run(through_server(url, args.tokens, c, *hooks, load=args.load,
                                                                prompt_tokens=prompt_tokens(args),
                                                                slow_tokens=slow_tokens(args)))
            print(f"server C={c:<3} engine in {where:<7} {rate:8.1f} tok/s total, {rate / c:8.1f} tok/s/user, "
                  f"ratio per user vs engine alone {rate / c / base:.3f}, pace ratio {pace / base:.3f} "
                  f"(each stream's own {user / base:.3f}); time to first chunk p50 {ttft * 1000:.2f} ms"
                  + (" [load]" if args.load else ""))
            if measured:
                print(f"  gap between steps (us, {measured['n']:.0f} gaps): p50 {measured['p50']:.0f}, "
                      f"p90 {measured['p90']:.0f}, mean {measured['mean']:.0f} = "
                      + ", ".join(f"{p} {measured[p]:.0f}" for p in (*Timeline.PARTS, "other"))
                      + f"; a call's mean {measured['step']:.0f} (alone {base_step * 1e6:.0f})")
        finally:
            child.stdin.close()
            try:
                child.wait(15)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(5)


if __name__ == "__main__":
    main()
