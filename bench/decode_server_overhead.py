"""Decode server overhead per output token: a scripted engine with a fixed step time,
driven (a) directly in a loop (baseline) and (b) through the real server on loopback
(SSE streaming, C concurrent clients; the server runs in its own process, on uvloop and
httptools as ``python -m decode_server`` runs it, or ``--loop asyncio``). Prints
tokens/s of both and their ratio, measured in the same run.

    python bench/decode_server_overhead.py [--step-ms 3.19] [--tokens 256] [--concurrency 1 4]
        [--timeline] [--loop asyncio] [--gil-us 50]

``--timeline``: the server process also records, on each slot's worker thread, when each
engine step starts and ends and how long the work between two steps takes by part (the
sequence processor's ``feed``: detokenizing and stop strings; the metrics; the post of the
delta to the event loop); the rest of a gap is the thread waiting for the GIL and the loop's
own work. Printed per concurrency: the gap between one step's end and the next one's start,
p50 / p90 / mean, and its mean by part. The wrappers cost ~1 us per call, counted in the gap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from connector.receiver import ReceivedKV
from decode_server.engine.base import SamplingParams
from pd_wire.handoff import HandoffResult
from tests.decode_server.conftest import build_model_dir, start_server
from tests.fakes.fake_engine import FakeEngine, FakeEngineConfig


def baseline(cfg: FakeEngineConfig, tokens: int) -> float:
    engine = FakeEngine(cfg)
    h = HandoffResult(handoff_id="b", kv_endpoint="x:1", num_prompt_tokens=4, first_token_id=5,
                      last_prompt_token_id=1, status="sent")
    session = engine.start(ReceivedKV("b", 4, []), h, SamplingParams(max_tokens=tokens))
    t0 = time.perf_counter()
    produced = 1
    while produced < tokens:
        produced += len(session.step())
    dt = time.perf_counter() - t0
    session.close()
    return produced / dt


async def through_server(url: str, tokens: int, concurrency: int, on_warm: Callable[[], None] | None = None,
                         on_measured: Callable[[], None] | None = None) -> tuple[float, float, float]:
    """Tokens/s of ``concurrency`` streams at once, mean chunks per response, and the median
    time to the first chunk of 20 sequential requests; ``on_warm`` runs after the warm-up
    request, ``on_measured`` after the concurrent streams."""
    ttfts: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": "x", "max_tokens": tokens, "ignore_eos": True, "stream": True,
                "kv_transfer_params": {"handoff_id": f"b{i}-{time.monotonic_ns()}", "kv_endpoint": "x:1",
                                       "num_prompt_tokens": 4, "first_token_id": 5, "last_prompt_token_id": 1,
                                       "status": "sent"}}
        n = 0
        t0 = time.perf_counter()
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not n and line.startswith("data: {"):
                    ttfts.append(time.perf_counter() - t0)
                n += line.startswith("data: {")
        return n

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
        await one(client, -1)  # warm-up (first request imports torch in the fake receiver)
        if on_warm is not None:
            on_warm()
        t0 = time.perf_counter()
        chunks = await asyncio.gather(*(one(client, i) for i in range(concurrency)))
        dt = time.perf_counter() - t0
        if on_measured is not None:
            on_measured()
        ttfts.clear()
        for i in range(20):  # time to first chunk, sequential requests
            await one(client, 1000 + i)
    return concurrency * tokens / dt, statistics.mean(chunks), statistics.median(ttfts)


class Timeline:
    """Per worker thread, the steps' (start, end) and the parts of the work between them."""

    PARTS = ("feed", "metrics", "post")

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
    parts: dict[str, float] = {p: 0.0 for p in Timeline.PARTS}
    for rec in records:
        steps = rec["steps"]
        for k in range(1, len(steps)):
            gap.append((steps[k][0] - steps[k - 1][1]) * 1e6)
        for p in Timeline.PARTS:  # only what falls between two steps of the same thread
            parts[p] += sum(d for after, d in rec[p] if 0 < after < len(steps)) * 1e6
    if not gap:
        return {}
    q = statistics.quantiles(gap, n=10)
    out = {"n": len(gap), "p50": statistics.median(gap), "p90": q[8], "mean": statistics.fmean(gap)}
    out.update({p: parts[p] / len(gap) for p in Timeline.PARTS})
    out["other"] = out["mean"] - sum(out[p] for p in Timeline.PARTS)
    return out


def serve(args: argparse.Namespace, cfg: FakeEngineConfig) -> None:
    """Child process: the real server app with the scripted engine; prints its URL. With
    ``--timeline``, a line of the timeline's gaps (JSON) on stdout after each ``timeline``
    line on stdin."""
    timeline = None
    if args.timeline:
        from decode_server.server.generation import Job
        from decode_server.server.metrics import DecodeMetrics
        from decode_server.server.sequence import SequenceProcessor
        from tests.fakes.fake_engine import FakeSession

        timeline = Timeline()
        timeline.wrap(FakeSession, "step", None)
        timeline.wrap(SequenceProcessor, "feed", "feed")
        timeline.wrap(DecodeMetrics, "step", "metrics")
        timeline.wrap(DecodeMetrics, "spec", "metrics")
        timeline.wrap(Job, "_post", "post")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model_dir(Path(tmp) / "m")
        srv, server, thread = start_server(model, cfg, slots=max(args.concurrency), max_seq_len=args.tokens + 16,
                                           loop=args.loop)
        print(srv.url, flush=True)
        for line in sys.stdin:  # until the parent closes our stdin
            if line.strip() == "timeline" and timeline is not None:
                print(json.dumps(gaps(timeline.take())), flush=True)
        server.should_exit = True
        thread.join(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-ms", type=float, default=3.19, help="engine step time (TileRT GLM-5.1 TPOT: 3.19 ms)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--gil-us", type=float, default=0.0, help="of each step, the microseconds the engine holds "
                    "the GIL (its own Python: launching the step, reading the tokens back), the rest released "
                    "(the GPU's time)")
    ap.add_argument("--timeline", action="store_true", help="also the gaps between engine steps in the server, "
                    "and what fills them")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="the server's event loop (python -m decode_server runs uvloop)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    filler = 200  # one byte-level token: one character per token
    if not 0 <= args.gil_us <= args.step_ms * 1000:
        ap.error("--gil-us must be within the step")
    cfg = FakeEngineConfig(script=[], filler_token=filler, step_delay=args.step_ms / 1000, step_gil=args.gil_us / 1e6,
                           slots=max(args.concurrency))
    if args.serve:
        serve(args, cfg)
        return
    base = baseline(cfg, args.tokens)
    child = subprocess.Popen([sys.executable, __file__, "--serve", *sys.argv[1:]], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        url = child.stdout.readline().strip()
        print(f"engine alone: {base:8.1f} tok/s (step {args.step_ms} ms, 1 sequence)")
        measured: dict[str, float] = {}

        def ask() -> dict[str, float]:
            child.stdin.write("timeline\n")
            child.stdin.flush()
            return json.loads(child.stdout.readline())

        for c in args.concurrency:
            hooks = (lambda: ask(), lambda: measured.update(ask())) if args.timeline else (None, None)
            rate, chunks, ttft = asyncio.run(through_server(url, args.tokens, c, *hooks))
            print(f"server C={c:<3} {rate:8.1f} tok/s total, {rate / c:8.1f} tok/s/user, "
                  f"ratio per user vs engine alone {rate / c / base:.3f} ({chunks:.0f} chunks/response); "
                  f"time to first chunk p50 {ttft * 1000:.2f} ms")
            if measured:
                print(f"  gap between steps (us, {measured['n']:.0f} gaps): p50 {measured['p50']:.0f}, "
                      f"p90 {measured['p90']:.0f}, mean {measured['mean']:.0f} = "
                      + ", ".join(f"{p} {measured[p]:.0f}" for p in (*Timeline.PARTS, "other")))
                measured.clear()
    finally:
        child.stdin.close()
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)


if __name__ == "__main__":
    main()
