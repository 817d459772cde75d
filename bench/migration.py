"""The time a migration adds: a decode server lost mid-answer, the answer going on on another.

The CPU stack of ``make run`` with 2 reference decode servers of one slot each. Each run
streams one greedy completion (``--tokens`` tokens, ``ignore_eos``) through the router; once
``--cut-after`` tokens reached the client, the serving decode server's process group gets
SIGKILL (its connection closes: found lost at once) or SIGSTOP (silent: found lost after
``--stall-timeout``); a killed server is restarted and a stopped one continued between runs.

Reported per signal, over ``--runs`` runs (p50 / p90):

* **longest wait after the cut**: the client's longest wait between two tokens after the
  signal (the tokens already on their way come first, then the lost server's silence, the
  move and the new server's first token: what the client sees); ITL before the cut beside it;
* **migration**: the router's ``pd_router_migration_seconds`` (from the server found lost to
  the first output of the one that resumed the answer: tokenize, slot, prefill, KV, first token);
* **prefill of the tokens so far**: the prompt and the output up to the cut prefilled alone on
  the same vLLM (a fresh prefix, no cache), the cost a migration cannot avoid without a cache.

Every answer must equal the uninterrupted one (checked).

Usage: ``.venv/bin/python bench/migration.py [--runs 5] [--cut-after 100] [--tokens 400]``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from decode_server.tiny_model import ensure_tiny_model  # noqa: E402
from pd_deploy.stack.launcher import Stack, StackConfig  # noqa: E402
from tests.procs import free_port  # noqa: E402

MODEL = "tiny-glm"
PROMPT = "Count: one, two, three, four, five,"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def metric(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def busy(stack: Stack) -> str:
    for url in stack.config.decode_urls:
        if httpx.get(url + "/v1/pd/capabilities", timeout=5).json()["busy_slots"]:
            return url
    raise RuntimeError("no decode server busy")


def healthy(stack: Stack) -> None:
    deadline = time.monotonic() + 120
    while not all(d["healthy"] and d["compatible"]
                  for d in httpx.get(stack.config.router_url + "/ready", timeout=5).json()["decode"]):
        if time.monotonic() > deadline:
            raise RuntimeError("decode servers not healthy again within 120 s")
        time.sleep(0.2)  # polling the router's view, not synchronising with it


def stream(url: str, body: dict, cut_after: int, on_cut) -> tuple[list[int], list[float], float | None]:
    """The answer's token ids, the arrival time of each, and the time of the cut (``on_cut``
    run once ``cut_after`` tokens arrived)."""
    ids: list[int] = []
    times: list[float] = []
    cut_at = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the answer ended with an error: {event['error']}")
            choice = event["choices"][0]
            now = time.perf_counter()
            for token in (choice.get("logprobs") or {}).get("tokens") or ():
                ids.append(int(token.removeprefix("token_id:")))
                times.append(now)
            if cut_at is None and on_cut is not None and len(ids) >= cut_after:
                cut_at = time.perf_counter()
                on_cut()
    return ids, times, cut_at


def prefill_ms(prefill_url: str, ids: list[int]) -> float:
    """One cold prefill of ``ids`` on vLLM (a fresh first token: nothing of it cached)."""
    fresh = [7 + uuid.uuid4().int % 50] + ids
    t0 = time.perf_counter()
    resp = httpx.post(prefill_url + "/v1/completions", json={"model": MODEL, "prompt": fresh, "max_tokens": 1,
                                                            "temperature": 0}, timeout=120)
    resp.raise_for_status()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cut-after", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--stall-timeout", type=float, default=5.0)
    ap.add_argument("--signals", default="kill,stop")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    model = ensure_tiny_model(Path(os.environ.get("PD_TINY_MODEL_ROOT") or REPO / ".cache" / "tiny-model"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-migration-") as tmp:
        cfg = StackConfig(model_dir=model, log_dir=Path(tmp), router_port=free_port(), prefill_port=free_port(),
                          decode_port=free_port(), kv_port=free_port(), num_decode=2, served_model_name=MODEL,
                          router_args=("--probe-interval", "0.5", "--stall-timeout", str(args.stall_timeout)))
        stack = Stack(cfg)
        stack.start()
        try:
            url = cfg.router_url
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": args.tokens, "ignore_eos": True,
                    "temperature": 0, "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
            whole, _, _ = stream(url, body, 0, None)
            prompt_ids = httpx.post(cfg.prefill_url + "/tokenize", json={"model": MODEL, "prompt": PROMPT},
                                    timeout=30).json()["tokens"]
            for sig_name in args.signals.split(","):
                sig = signal.SIGKILL if sig_name == "kill" else signal.SIGSTOP
                cut_next, moves, itl, prefills = [], [], [], []
                for _ in range(args.runs):
                    n0, s0 = (metric(url, "pd_router_migration_seconds_count"),
                              metric(url, "pd_router_migration_seconds_sum"))
                    lost: list = []

                    def cut(sig: signal.Signals = sig, lost: list = lost) -> None:
                        server = busy(stack)
                        proc = next(p for p in stack.processes
                                    if p.name == f"decode-{cfg.decode_urls.index(server)}")
                        os.killpg(proc.pid, sig)
                        lost.append((proc, server))

                    ids, times, cut_at = stream(url, body, args.cut_after, cut)
                    proc, server = lost[0]
                    if sig == signal.SIGSTOP:
                        os.killpg(proc.pid, signal.SIGCONT)
                    else:
                        proc.proc.wait(10)
                        stack.restart(proc.name).wait_http(server + "/ready", 120)
                    healthy(stack)
                    if ids != whole:
                        raise RuntimeError(f"the migrated answer differs from the uninterrupted one ({sig_name})")
                    assert cut_at is not None
                    # the client's longest wait after the cut: the tokens already on their way came
                    # first, then the lost server's silence, the move, and the new server's first token
                    after = [t for t in times if t > cut_at]
                    cut_next.append(max(b - a for a, b in zip([cut_at, *after], after, strict=False)) * 1e3)
                    before = [b - a for a, b in zip(times, times[1:], strict=False) if b <= cut_at]
                    itl.append(pct(before, 0.5) * 1e3)
                    n1, s1 = (metric(url, "pd_router_migration_seconds_count"),
                              metric(url, "pd_router_migration_seconds_sum"))
                    moves.append((s1 - s0) / max(1.0, n1 - n0) * 1e3)
                    prefills.append(prefill_ms(cfg.prefill_url, prompt_ids + whole[:args.cut_after]))
                rows.append((sig_name, cut_next, moves, itl, prefills))
        finally:
            stack.stop()
    print(f"migration, commit {commit}, {args.runs} runs per signal, cut after {args.cut_after} of {args.tokens} "
          f"greedy tokens, --stall-timeout {args.stall_timeout:g}s, 2 reference decode servers x 1 slot, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print("| signal | longest wait after the cut p50 / p90 (ms) | migration p50 / p90 (ms) "
          "| ITL before the cut p50 (ms) | prefill of prompt + tokens so far p50 (ms) |")
    print("|---|---|---|---|---|")
    for sig_name, cut_next, moves, itl, prefills in rows:
        print(f"| {sig_name} | {pct(cut_next, 0.5):.0f} / {pct(cut_next, 0.9):.0f} | {pct(moves, 0.5):.0f} / "
              f"{pct(moves, 0.9):.0f} | {pct(itl, 0.5):.1f} | {pct(prefills, 0.5):.0f} |")
    print("every migrated answer equal to the uninterrupted one: yes")


if __name__ == "__main__":
    main()
