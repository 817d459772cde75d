"""Reference decode engine speed: tokens/s with and without MTP, the MTP acceptance rate,
and (``--profile``) where a decode step's time goes.

Both configurations decode the same prompts (greedy, from the reference prefill's KV) in
the same run, interleaved; the figure that matters is the ratio MTP / no-MTP. Tokens per
CPU-second of the decoding thread are reported too: on a shared machine they are far
less noisy than wall-clock tokens/s (the attention helper thread's CPU is not in them).

``--context N ...`` decodes after prompts of N tokens (English text from the standard
library's docstrings, as bench/e2e.py) instead of the four short prompts.
``--torch-attention`` adds both configurations with attention over the cache as PyTorch's
products instead of the compiled loop (``no_mtp_torch``, ``mtp1_torch``), interleaved with
the others, and prints the ratios kernel / products.
``--profile`` adds a torch.profiler breakdown of MTP decode steps per context: attention
products over the cache, the other matrix products, and the rest (elementwise ops,
norms, rope, copies: mostly dispatch), per step.

    .venv/bin/python bench/decode.py [--model DIR] [--tokens 128] [--repeats 3] [--threads 1]
        [--context 1024 8192] [--torch-attention] [--profile [--top N]]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from connector.receiver import ReceivedKV  # noqa: E402
from decode_server.engine.base import SamplingParams  # noqa: E402
from decode_server.engine.reference import ReferenceEngine  # noqa: E402
from decode_server.reference import load_model, prefill  # noqa: E402
from decode_server.tiny_model import ensure_tiny_model  # noqa: E402
from pd_wire.handoff import HandoffResult

PROMPTS = [
    "[gMASK]<sop><|user|>\nWhat does json.dumps do?<|assistant|>\n",
    "Return a new list containing",
    "[gMASK]<sop><|user|>\nExplain subprocess.run.<|assistant|>\n",
    "This module provides",
]
PROFILE_STEPS = 20


def decode_once(engine: ReferenceEngine, ids: list[int], kv: list[torch.Tensor], first: int, n: int
                ) -> tuple[float, float, int, int, int]:
    """(wall s, CPU s of this thread, tokens, drafted, accepted) of one greedy decode."""
    session = engine.start(ReceivedKV("b", len(ids), [{"kv": t} for t in kv]), _handoff(ids, first),
                           SamplingParams(max_tokens=n, temperature=0.0))
    produced = 0
    t0, c0 = time.perf_counter(), time.thread_time()
    while produced < n:
        produced += len(session.step())
    elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
    session.close()
    return elapsed, cpu, produced, session.stats.drafted, session.stats.accepted


def _handoff(ids: list[int], first: int) -> HandoffResult:
    return HandoffResult(handoff_id="b", kv_endpoint="127.0.0.1:1", num_prompt_tokens=len(ids),
                         first_token_id=first, last_prompt_token_id=ids[-1], status="sent")


def context_prompts(tok: Tokenizer, lengths: list[int]) -> list[list[int]]:
    from tests.e2e.prompts import long_prompt

    ids = tok.encode(long_prompt(max(lengths) * 8)).ids
    return [ids[:n] for n in lengths]


def model_dir_for(base: Path, length: int, tmp: Path) -> Path:
    """``base``, or a view of it allowing ``length`` positions (same weights)."""
    from bench.prefill_tail import long_context_view

    limit = json.loads((base / "config.json").read_text())["max_position_embeddings"]
    return base if length <= limit else long_context_view(base, length, tmp / base.name)


def profile_steps(engine: ReferenceEngine, ids: list[int], kv: list[torch.Tensor], first: int, top: int = 0
                  ) -> tuple[dict[str, float], list[tuple[str, float, float]]]:
    """ms per MTP decode step in: attention products over the cache, other products, the
    rest; and the ``top`` ops by self CPU time (name and input shapes, calls and ms per step)."""
    from torch.profiler import ProfilerActivity, profile

    session = engine.start(ReceivedKV("b", len(ids), [{"kv": t} for t in kv]), _handoff(ids, first),
                           SamplingParams(max_tokens=3 * PROFILE_STEPS, temperature=0.0))
    for _ in range(3):
        session.step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for _ in range(PROFILE_STEPS):
            session.step()
        wall = time.perf_counter() - t0
    session.close()
    groups: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        groups[_group(event.key, event.input_shapes)] += event.self_cpu_time_total / 1e3
    out = {k: v / PROFILE_STEPS for k, v in groups.items()}
    out["wall per step (profiled)"] = wall / PROFILE_STEPS * 1e3
    out["profiler events per step"] = sum(e.count for e in prof.key_averages()) / PROFILE_STEPS
    ops = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)[:top]
    return out, [(f"{e.key} {e.input_shapes}", e.count / PROFILE_STEPS, e.self_cpu_time_total / 1e3 / PROFILE_STEPS)
                 for e in ops]


def _group(name: str, shapes: list) -> str:
    if name == "mkldnn::_linear_pointwise":  # the LM head of a multi-row pass
        return "weight products"
    if name in ("aten::mm", "aten::bmm", "aten::addmm"):
        a, b = (shapes + [[], []])[:2]
        over_cache = len(a) == 2 and len(b) == 2 and (a[1] == 576 or (a[1] >= 1024 and b[1] == 512))
        return "attention products (over the cache)" if over_cache else "weight products"
    if name in ("aten::softmax", "aten::_softmax", "aten::exp_", "aten::amax"):
        return "softmax"
    return "other ops (norms, rope, copies, elementwise)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: the cached tiny model)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded per prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--context", type=int, nargs="+", default=None, help="prompt lengths (tokens)")
    ap.add_argument("--torch-attention", action="store_true",
                    help="also decode with attention as PyTorch's products (the engine before the kernel)")
    ap.add_argument("--profile", action="store_true", help="where an MTP step's time goes, per context")
    ap.add_argument("--top", type=int, default=0, help="with --profile: the N ops taking the most time")
    args = ap.parse_args()
    base = args.model or ensure_tiny_model(Path(os.environ.get("PD_TINY_MODEL_ROOT") or REPO / ".cache" / "tiny-model"))
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        longest = max(args.context or [0]) + args.tokens + 8
        model_dir = model_dir_for(base, longest, Path(tmp))
        model = load_model(model_dir)
        max_len = max(4096, longest)
        torch.set_num_threads(args.threads)
        # threads=None: the process-wide setting above (an engine without the option, e.g. an
        # older one profiled for comparison, is built without it)
        knobs = {"threads": None} if "threads" in inspect.signature(ReferenceEngine).parameters else {}
        configs = [("no_mtp", 0, None), ("mtp1", 1, None)]
        if args.torch_attention:
            configs += [("no_mtp_torch", 0, False), ("mtp1_torch", 1, False)]
        engines = {name: ReferenceEngine(model_dir, model=model, num_mtp=mtp, max_seq_len=max_len,
                                         **knobs, **({} if kernel is None else {"attention_kernel": kernel}))
                   for name, mtp, kernel in configs}
        prompts = context_prompts(tok, args.context) if args.context else [tok.encode(p).ids for p in PROMPTS]
        inputs = []
        with torch.inference_mode():
            for ids in prompts:
                out = prefill(model, ids)
                inputs.append((ids, out.kv, int(out.logits.argmax())))
        groups = [[x] for x in inputs] if args.context else [inputs]
        for group in groups:
            run_group(engines, group, args)
        if args.profile:
            for ids, kv, first in inputs:
                prof, top = profile_steps(engines["mtp1"], ids, kv, first, args.top)
                events = prof.pop("profiler events per step")
                print(f"profile, MTP decode step after {len(ids)} prompt tokens "
                      f"({events:.0f} profiler events per step; ms per step, self CPU): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in sorted(prof.items(), key=lambda kv: -kv[1])))
                for name, calls, ms in top:
                    print(f"  {ms:7.3f} ms/step {calls:6.1f} calls/step  {name}")
    return 0


def run_group(engines: dict[str, ReferenceEngine], inputs: list, args: argparse.Namespace) -> None:
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
    results = {}
    for name in engines:
        drafted, accepted = totals[name]
        results[name] = {"tokens_per_s": round(statistics.median(wall[name]), 1),
                         "tokens_per_cpu_s": round(statistics.median(cpu[name]), 1),
                         "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0}
    ratio = results["mtp1"]["tokens_per_s"] / results["no_mtp"]["tokens_per_s"]
    cpu_ratio = results["mtp1"]["tokens_per_cpu_s"] / results["no_mtp"]["tokens_per_cpu_s"]
    lengths = sorted({len(ids) for ids, _, _ in inputs})
    print(f"{len(inputs)} prompt(s) of {'/'.join(map(str, lengths))} tokens x {args.tokens} tokens, greedy, "
          f"{args.threads} thread(s), median of {args.repeats}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'config':8} {'tok/s':>8} {'tok/CPU-s':>10} {'acceptance':>10}")
    for name, r in results.items():
        print(f"{name:8} {r['tokens_per_s']:8.1f} {r['tokens_per_cpu_s']:10.1f} {r['acceptance_rate']:10.2f}")
    print(f"ratio mtp1/no_mtp: {ratio:.2f} (wall), {cpu_ratio:.2f} (CPU time)")
    summary = {"prompt_tokens": lengths, "results": results, "ratio_mtp_over_no_mtp": round(ratio, 3),
               "cpu_ratio_mtp_over_no_mtp": round(cpu_ratio, 3)}
    for name in ("no_mtp", "mtp1"):
        if f"{name}_torch" in results:  # tokens/s with the kernel over tokens/s with PyTorch's products
            speedup = results[name]["tokens_per_s"] / results[f"{name}_torch"]["tokens_per_s"]
            print(f"ratio {name} kernel/products: {speedup:.2f} (wall tokens/s)")
            summary[f"ratio_{name}_kernel_over_products"] = round(speedup, 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
