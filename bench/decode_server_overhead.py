"""Decode server overhead per output token: a scripted engine with a fixed step time,
driven (a) directly in a loop (baseline) and (b) through the real server on loopback
(SSE streaming, C concurrent clients; the server runs in its own process). Prints
tokens/s of both and their ratio, measured in the same run.

    python bench/decode_server_overhead.py [--step-ms 3.19] [--tokens 256] [--concurrency 1 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
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


async def through_server(url: str, tokens: int, concurrency: int) -> tuple[float, float, float]:
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
        t0 = time.perf_counter()
        chunks = await asyncio.gather(*(one(client, i) for i in range(concurrency)))
        dt = time.perf_counter() - t0
        ttfts.clear()
        for i in range(20):  # time to first chunk, sequential requests
            await one(client, 1000 + i)
    return concurrency * tokens / dt, statistics.mean(chunks), statistics.median(ttfts)


def serve(args: argparse.Namespace, cfg: FakeEngineConfig) -> None:
    """Child process: the real server app with the scripted engine; prints its URL."""
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model_dir(Path(tmp) / "m")
        srv, server, thread = start_server(model, cfg, slots=max(args.concurrency), max_seq_len=args.tokens + 16)
        print(srv.url, flush=True)
        sys.stdin.read()  # until the parent closes our stdin
        server.should_exit = True
        thread.join(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-ms", type=float, default=3.19, help="engine step time (TileRT GLM-5.1 TPOT: 3.19 ms)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    filler = 200  # one byte-level token: one character per token
    cfg = FakeEngineConfig(script=[], filler_token=filler, step_delay=args.step_ms / 1000, slots=max(args.concurrency))
    if args.serve:
        serve(args, cfg)
        return
    base = baseline(cfg, args.tokens)
    child = subprocess.Popen([sys.executable, __file__, "--serve", *sys.argv[1:]], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        url = child.stdout.readline().strip()
        print(f"engine alone: {base:8.1f} tok/s (step {args.step_ms} ms, 1 sequence)")
        for c in args.concurrency:
            rate, chunks, ttft = asyncio.run(through_server(url, args.tokens, c))
            print(f"server C={c:<3} {rate:8.1f} tok/s total, {rate / c:8.1f} tok/s/user, "
                  f"ratio per user vs engine alone {rate / c / base:.3f} ({chunks:.0f} chunks/response); "
                  f"time to first chunk p50 {ttft * 1000:.2f} ms")
    finally:
        child.stdin.close()
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)


if __name__ == "__main__":
    main()
