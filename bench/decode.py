"""Reference decode engine speed: tokens/s with and without MTP, and the MTP acceptance rate.

Both configurations decode the same prompts (greedy, from the reference prefill's KV) in
the same run, interleaved; the figure that matters is the ratio MTP / no-MTP. Tokens per
CPU-second of the decoding thread are reported too: on a shared machine they are far
less noisy than wall-clock tokens/s.

    .venv/bin/python bench/decode.py [--model DIR] [--tokens 128] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from connector.protocol import HandoffResult  # noqa: E402
from connector.receiver import ReceivedKV  # noqa: E402
from decode_server.engine.base import SamplingParams  # noqa: E402
from decode_server.engine.reference import ReferenceEngine  # noqa: E402
from decode_server.reference import load_model, prefill  # noqa: E402
from decode_server.tiny_model import ensure_tiny_model  # noqa: E402

PROMPTS = [
    "[gMASK]<sop><|user|>\nWhat does json.dumps do?<|assistant|>\n",
    "Return a new list containing",
    "[gMASK]<sop><|user|>\nExplain subprocess.run.<|assistant|>\n",
    "This module provides",
]


def decode_once(engine: ReferenceEngine, ids: list[int], kv: list[torch.Tensor], first: int, n: int
                ) -> tuple[float, float, int, int, int]:
    """(wall s, CPU s of this thread, tokens, drafted, accepted) of one greedy decode."""
    handoff = HandoffResult(handoff_id="b", kv_endpoint="127.0.0.1:1", num_prompt_tokens=len(ids),
                            first_token_id=first, last_prompt_token_id=ids[-1], status="sent")
    session = engine.start(ReceivedKV("b", len(ids), [{"kv": t} for t in kv]), handoff,
                           SamplingParams(max_tokens=n, temperature=0.0))
    produced = 0
    t0, c0 = time.perf_counter(), time.thread_time()
    while produced < n:
        produced += len(session.step())
    elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
    session.close()
    return elapsed, cpu, produced, session.stats.drafted, session.stats.accepted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: the cached tiny model)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded per prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model or ensure_tiny_model(REPO / ".cache" / "tiny-model")
    model = load_model(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    engines = {"no_mtp": ReferenceEngine(model_dir, model=model, num_mtp=0, threads=args.threads),
               "mtp1": ReferenceEngine(model_dir, model=model, num_mtp=1, threads=args.threads)}
    inputs = []
    for p in PROMPTS:
        ids = tok.encode(p).ids
        out = prefill(model, ids)
        inputs.append((ids, out.kv, int(out.logits.argmax())))
    results: dict[str, dict[str, float]] = {}
    wall: dict[str, list[float]] = {k: [] for k in engines}
    cpu: dict[str, list[float]] = {k: [] for k in engines}
    totals = {k: [0, 0] for k in engines}
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        for name, engine in engines.items():
            elapsed, used, produced = 0.0, 0.0, 0
            for ids, kv, first in inputs:
                e, c, n, drafted, accepted = decode_once(engine, ids, kv, first, args.tokens)
                elapsed, used, produced = elapsed + e, used + c, produced + n
                totals[name][0] += drafted
                totals[name][1] += accepted
            wall[name].append(produced / elapsed)
            cpu[name].append(produced / used)
    for name in engines:
        drafted, accepted = totals[name]
        results[name] = {"tokens_per_s": round(statistics.median(wall[name]), 1),
                         "tokens_per_cpu_s": round(statistics.median(cpu[name]), 1),
                         "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0}
    ratio = results["mtp1"]["tokens_per_s"] / results["no_mtp"]["tokens_per_s"]
    cpu_ratio = results["mtp1"]["tokens_per_cpu_s"] / results["no_mtp"]["tokens_per_cpu_s"]
    print(f"model {model_dir.name}, {len(PROMPTS)} prompts x {args.tokens} tokens, greedy, "
          f"{args.threads} thread(s), median of {args.repeats}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'config':8} {'tok/s':>8} {'tok/CPU-s':>10} {'acceptance':>10}")
    for name, r in results.items():
        print(f"{name:8} {r['tokens_per_s']:8.1f} {r['tokens_per_cpu_s']:10.1f} {r['acceptance_rate']:10.2f}")
    print(f"ratio mtp1/no_mtp: {ratio:.2f} (wall), {cpu_ratio:.2f} (CPU time)")
    print(json.dumps({"results": results, "ratio_mtp_over_no_mtp": round(ratio, 3),
                      "cpu_ratio_mtp_over_no_mtp": round(cpu_ratio, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
