"""One decode server stops (SIGSTOP): what the requests bound to the other one see.

The CPU stack of ``make run`` with 2 decode servers (``--decode-slots`` each), 4 closed-loop
clients streaming completions through the router (short prompts, 16 greedy tokens). Three
phases of ``--phase-s`` seconds each, in one run:

1. **baseline**: both decode servers up;
2. **stopped**: decode-1's process group is SIGSTOPped (its KV control port still accepts
   connections, nothing answers); requests bound to it must fail with an OpenAI error
   within the connector's admission timeout, the others must keep their TTFT;
3. **recovered**: SIGCONT; everything is served again.

Reported per phase: TTFT p50/p99 of the successful requests, failures (status, type,
seconds to fail); requests in flight when decode-1 stops or resumes are reported apart
("transition": those bound to decode-1 wait for it or fail); at the end, the leak checks (router in-flight and
held slots, decode servers' busy slots, vLLM's KV usage). Goal (issue 18): stopped-phase TTFT p99 of
the healthy server's requests within +100 ms of the baseline p99 of the same run.

Usage: ``.venv/bin/python bench/decode_stall.py [--phase-s 20] [--decode-slots 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from decode_server.tiny_model import ensure_tiny_model  # noqa: E402
from pd_deploy.stack.launcher import Stack, StackConfig  # noqa: E402
from tests.e2e.prompts import COMPLETION_PROMPTS  # noqa: E402
from tests.procs import free_port  # noqa: E402

MODEL = "tiny-glm"
CLIENTS = 4
OUTPUT_TOKENS = 16


@dataclass
class Result:
    phase: str
    ok: bool
    ttft: float  # s; for a failure: seconds until the error
    error: str = ""


def stream_once(url: str, prompt: str) -> tuple[bool, float, str]:
    body = {"model": MODEL, "prompt": f"[{uuid.uuid4().hex[:8]}] {prompt}", "max_tokens": OUTPUT_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            err = json.loads(r.read()).get("error", {})
            return False, time.perf_counter() - t0, f"{r.status_code} {err.get('type')}: {err.get('message', '')[:300]}"
        first = 0.0
        for line in r.iter_lines():
            if line.startswith("data: {") and not first:
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return False, time.perf_counter() - t0, f"stream error: {chunk['error'].get('type')}"
                first = time.perf_counter() - t0
        return bool(first), first, "" if first else "no token"


def client(url: str, phase: list[str], stop: threading.Event, out: list[Result], k: int) -> None:
    i = k
    while not stop.is_set():
        started = phase[0]
        ok, ttft, error = stream_once(url, COMPLETION_PROMPTS[i % len(COMPLETION_PROMPTS)][:200])
        # a request that saw the stop or the resume begin belongs to no phase
        out.append(Result(started if phase[0] == started else "transition", ok, ttft, error))
        i += CLIENTS


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def leaks(stack: Stack) -> dict[str, object]:
    cfg = stack.config
    metrics = httpx.get(cfg.router_url + "/metrics", timeout=5).text
    in_flight = next(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("pd_router_in_flight_requests"))
    busy = [httpx.get(u + "/v1/pd/capabilities", timeout=5).json()["busy_slots"] for u in cfg.decode_urls]
    metrics = httpx.get(cfg.prefill_url + "/metrics", timeout=5).text.splitlines()
    usage = next(float(line.split()[-1]) for line in metrics if line.startswith("vllm:kv_cache_usage_perc"))
    return {"router_in_flight": in_flight, "decode_busy_slots": busy, "vllm_kv_usage": usage}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--decode-slots", type=int, default=2)
    args = ap.parse_args()
    model = ensure_tiny_model(Path(os.environ.get("PD_TINY_MODEL_ROOT") or REPO / ".cache" / "tiny-model"))
    with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
        cfg = StackConfig(model_dir=model, log_dir=Path(tmp), router_port=free_port(), prefill_port=free_port(),
                          decode_port=free_port(), kv_port=free_port(), num_decode=2,
                          decode_slots=args.decode_slots, served_model_name=MODEL,
                          router_args=("--probe-interval", "0.5"))
        stack = Stack(cfg)
        stack.start()
        try:
            victim = next(p for p in stack.processes if p.name == "decode-1")
            phase, stop, results = ["baseline"], threading.Event(), []
            threads = [threading.Thread(target=client, args=(cfg.router_url, phase, stop, results, k))
                       for k in range(CLIENTS)]
            for t in threads:
                t.start()
            time.sleep(args.phase_s)  # a phase of load, not synchronisation
            os.killpg(victim.pid, signal.SIGSTOP)
            phase[0] = "stopped"
            time.sleep(args.phase_s)
            os.killpg(victim.pid, signal.SIGCONT)
            phase[0] = "recovered"
            time.sleep(args.phase_s)
            stop.set()
            for t in threads:
                t.join(150)
            deadline = time.monotonic() + 30
            while (state := leaks(stack)) and time.monotonic() < deadline and (
                    state["router_in_flight"] or any(state["decode_busy_slots"]) or state["vllm_kv_usage"]):
                time.sleep(0.5)
        finally:
            stack.stop()
    print(f"decode stall, {CLIENTS} clients, 2 decode servers x {args.decode_slots} slots, {args.phase_s:g} s "
          f"phases, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print("| phase | ok | TTFT p50 (ms) | TTFT p99 (ms) | failed | seconds to fail (max) | errors |")
    print("|---|---|---|---|---|---|---|")
    base_p99 = 0.0
    for name in ("baseline", "stopped", "recovered", "transition"):
        ok = [r.ttft for r in results if r.phase == name and r.ok]
        bad = [r for r in results if r.phase == name and not r.ok]
        if name == "baseline":
            base_p99 = pct(ok, 0.99)
        errors = sorted({r.error.split(":")[0] for r in bad})
        print(f"| {name} | {len(ok)} | {pct(ok, 0.5) * 1e3:.1f} | {pct(ok, 0.99) * 1e3:.1f} | {len(bad)} | "
              f"{max((r.ttft for r in bad), default=0):.1f} | {', '.join(errors)} |")
    stopped_p99 = pct([r.ttft for r in results if r.phase == "stopped" and r.ok], 0.99)
    print(f"healthy-server TTFT p99 while the other is stopped: {stopped_p99 * 1e3:.1f} ms vs baseline "
          f"{base_p99 * 1e3:.1f} ms (+{(stopped_p99 - base_p99) * 1e3:.1f} ms; goal <= +100 ms)")
    print(f"after the run: {state}")
    for message in sorted({f"{r.phase}: {r.error}" for r in results if not r.ok}):
        print(f"  error seen: {message}")
    print(f"median TTFT over all ok: {statistics.median(r.ttft for r in results if r.ok) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
