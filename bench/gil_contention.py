"""The decode server's engine thread against a busy event loop in the same process.

The decode server runs each generation's steps on a worker thread while its asyncio loop
serves HTTP (token streams, slot requests, probes) on the main thread; both need the GIL. This
runs the reference engine's greedy decode (tiny model, MTP on, its defaults) on a worker
thread, as the server does, while the main thread's loop is idle, then while ``--spinners``
coroutines keep it busy with short Python bursts, for each ``--switch-interval``
(``sys.setswitchinterval``). Prints ms per token and the ratio to the idle loop, measured in
the same run.

    .venv/bin/python bench/gil_contention.py [--tokens 8] [--spinners 2] [--switch-interval 0.005 0.0005]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from bench.decode import decode_once  # noqa: E402
from decode_server.engine.reference import ReferenceEngine  # noqa: E402
from decode_server.reference import load_model, prefill  # noqa: E402
from decode_server.tiny_model import ensure_tiny_model  # noqa: E402

BURST = 200  # additions per wake-up of a spinner: ~10-20 us of Python, like handling a small request


def _decode_ms_per_token(engine: ReferenceEngine, inputs: tuple, tokens: int, repeats: int) -> list[float]:
    ids, kv, first = inputs
    out: list[float] = []
    with torch.inference_mode():
        for _ in range(repeats):
            elapsed, _, produced, _, _ = decode_once(engine, ids, kv, first, tokens)
            out.append(elapsed / produced * 1e3)
    return out


def _trial(engine: ReferenceEngine, inputs: tuple, tokens: int, repeats: int, spinners: int) -> float:
    """Median ms per token of the worker thread's decodes while ``spinners`` coroutines run."""
    results: list[float] = []
    worker = threading.Thread(target=lambda: results.extend(_decode_ms_per_token(engine, inputs, tokens, repeats)))

    async def spin(stop: threading.Event) -> None:
        while not stop.is_set():
            x = 0
            for i in range(BURST):
                x += i
            await asyncio.sleep(0)

    async def main() -> None:
        stop = threading.Event()
        tasks = [asyncio.ensure_future(spin(stop)) for _ in range(spinners)]
        worker.start()
        await asyncio.to_thread(worker.join)  # the waiting thread blocks without the GIL
        stop.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    return statistics.median(results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8, help="tokens per decode")
    ap.add_argument("--repeats", type=int, default=3, help="decodes per trial (median)")
    ap.add_argument("--spinners", type=int, default=2, help="coroutines keeping the loop busy")
    ap.add_argument("--switch-interval", type=float, nargs="+", default=[0.005, 0.0005])
    args = ap.parse_args()
    base = ensure_tiny_model(Path(os.environ.get("PD_TINY_MODEL_ROOT") or REPO / ".cache" / "tiny-model"))
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 20).ids
    model = load_model(base)
    engine = ReferenceEngine(base, model=model, num_mtp=1)
    with torch.inference_mode():
        out = prefill(model, ids)
    inputs = (ids, out.kv, int(out.logits.argmax()))
    default = sys.getswitchinterval()
    _trial(engine, inputs, args.tokens, 1, 0)  # warm-up
    print(f"{len(ids)}-token prompt, {args.tokens} tokens per decode, median of {args.repeats}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    for interval in args.switch_interval:
        sys.setswitchinterval(interval)
        idle = _trial(engine, inputs, args.tokens, args.repeats, 0)
        busy = _trial(engine, inputs, args.tokens, args.repeats, args.spinners)
        print(f"switch interval {interval * 1e3:.1f} ms: idle loop {idle:.2f} ms/token, "
              f"{args.spinners} spinners {busy:.2f} ms/token ({busy / idle:.1f}x)", flush=True)
    sys.setswitchinterval(default)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
