"""GPU check: the parts of the PD path that only a GPU can exercise, in one run (< 6 min on
one H200), for the day a GPU machine is available. Needs PyTorch with CUDA and a few small
wheels: ``pip install --no-deps -e . && pip install pydantic safetensors tokenizers`` and,
for the NIXL step, ``pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1``.

    python bench/gpu_check.py [--model TINY_MODEL_DIR] [--device cuda:0] [--json OUT] [--strict]

Checks, each against the same computation on the CPU:

1. ``gather/cpu-mla`` and ``gather/fp8-ds-mla``: the connector's gathers from CUDA paged
   caches (vLLM's ``[blocks, 1, block_size, row]`` views: CPU-MLA rows; fp8_ds_mla rows +
   indexer pages) into host staging (pageable and pinned) and VRAM staging, by
   ``gather_layer`` (one copy per layer) and by the per-plane gathers;
2. ``nixl/vram``: a KV handoff over NIXL from VRAM staging in this process to a VRAM
   receive buffer in a second process, byte-compared; skipped when NIXL or its CUDA
   support does not load;
3. ``tilert-kv``: the fp8_ds_mla -> bf16 conversion (dequantization + Hadamard) on CUDA,
   from host and from VRAM planes, against the CPU result;
4. ``reference-engine``: the reference engine decoding greedily on CUDA against the CPU
   from the same prompt KV (the tiny model: ``--model``, else generated under
   ``$PD_TINY_MODEL_ROOT`` or ``.cache/tiny-model``, which takes a few minutes).

Without CUDA (CI) it runs in dry mode: each check runs its CPU side for real (inputs, CPU
results) and reports the GPU side as skipped, saying why; nothing is faked. Exit status 1
if anything that ran failed (with ``--strict`` also if anything was skipped), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from connector.layout import (  # noqa: E402
    KVLayout,
    cpu_mla_layout,
    gather_fp8_ds_mla,
    gather_layer,
    gather_pages,
    gather_tokens,
    glm5_fp8_ds_mla_layout,
    layer_views,
)
from decode_server.engine.tilert_kv import INDEX_HEAD_DIM, convert_layers, hadamard_matrix  # noqa: E402
from tests.fakes.vllm_fp8 import quantize_fp8_ds_mla  # noqa: E402


class Skip(Exception):
    """The GPU side of a check cannot run here; the message says why."""


@dataclass
class Result:
    name: str
    status: str  # ok | failed | skipped
    detail: str
    seconds: float


@dataclass
class Context:
    device: torch.device | None  # None: dry mode
    why_dry: str
    model: Path | None
    notes: dict[str, str] = field(default_factory=dict)

    def need_gpu(self, cpu_side: str) -> torch.device:
        if self.device is None:
            raise Skip(f"{self.why_dry} (CPU side ran: {cpu_side})")
        return self.device


# ----------------------------------------------------------------------------- gathers

BLOCKS_FREE = 300  # cache blocks; a request's blocks are a shuffled subset


def _block_ids(num_tokens: int, block_size: int, gen: torch.Generator) -> list[int]:
    need = -(-num_tokens // block_size)
    return torch.randperm(BLOCKS_FREE, generator=gen)[:need].tolist()


def _staging(layout: KVLayout, num_tokens: int, where: str, device: torch.device | None) -> dict[str, torch.Tensor]:
    """Packed staging views of one layer: host pageable, host pinned or VRAM."""
    nbytes = layout.bytes_per_layer(num_tokens)
    if where == "vram":
        block = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    else:
        block = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=where == "pinned")
    return layer_views(block, layout, num_tokens)


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(got[k].cpu(), want[k]) for k in want)


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def check_gather_cpu_mla(ctx: Context) -> str:
    gen = torch.Generator().manual_seed(1)
    layout, n, block = cpu_mla_layout(1, 0, "bfloat16"), 1000, 16
    cache = torch.randn(BLOCKS_FREE, 1, block, 576, generator=gen).to(torch.bfloat16)  # vLLM's [B, H, N, C]
    ids = _block_ids(n, block, gen)
    want = _staging(layout, n, "pageable", None)
    gather_tokens(cache.squeeze(1), ids, n, want["kv"])
    device = ctx.need_gpu(f"CPU gather of {n} tokens")
    gpu_cache = cache.to(device).squeeze(1)
    lines = []
    for where in ("pageable", "pinned", "vram"):
        views = _staging(layout, n, where, device)
        ms = _timed(lambda v=views: gather_layer(gpu_cache, ids, n, v), device)
        if not _same(views, want):
            raise AssertionError(f"{where} staging differs from the CPU gather")
        lines.append(f"{where} {ms:.2f} ms")
    return f"{n} tokens, byte-identical to the CPU gather: " + ", ".join(lines)


def _fp8_ds_mla_cache(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    latent = torch.randn(BLOCKS_FREE * 64, 512, generator=gen)
    rope = torch.randn(BLOCKS_FREE * 64, 64, generator=gen).to(torch.bfloat16)
    rows = torch.cat([quantize_fp8_ds_mla(latent), rope.view(torch.uint8)], dim=1)
    indexer = torch.randint(0, 256, (BLOCKS_FREE, 1, 64, 132), dtype=torch.uint8, generator=gen)
    return rows.view(BLOCKS_FREE, 1, 64, 656), indexer


def check_gather_fp8_ds_mla(ctx: Context) -> str:
    gen = torch.Generator().manual_seed(2)
    layout, n = glm5_fp8_ds_mla_layout(1, 0), 8192 + 37
    cache, indexer = _fp8_ds_mla_cache(gen)
    ids = _block_ids(n, 64, gen)
    want = _staging(layout, n, "pageable", None)
    gather_layer(cache.squeeze(1), ids, n, want, indexer)
    device = ctx.need_gpu(f"CPU gather of {n} tokens")
    gpu_cache, gpu_indexer = cache.to(device).squeeze(1), indexer.to(device)
    lines = []
    for where in ("pageable", "pinned", "vram"):
        views = _staging(layout, n, where, device)
        ms = _timed(lambda v=views: gather_layer(gpu_cache, ids, n, v, gpu_indexer), device)
        per_plane = _staging(layout, n, where, device)

        def planes(v: dict[str, torch.Tensor] = per_plane) -> None:  # what the connector worker calls today
            gather_fp8_ds_mla(gpu_cache, ids, n, v["kv"], v["rope"])
            gather_pages(gpu_indexer, ids, v["indexer"].shape[0], v["indexer"])

        ms_planes = _timed(planes, device)
        if not (_same(views, want) and _same(per_plane, want)):
            raise AssertionError(f"{where} staging differs from the CPU gather")
        lines.append(f"{where} {ms:.2f} ms (per plane {ms_planes:.2f} ms)")
    return f"one layer of {n} tokens, byte-identical to the CPU gather: " + ", ".join(lines)


# ------------------------------------------------------------------------------ NIXL

NIXL_LAYOUT = dict(layers=4, mtp=1)
NIXL_TOKENS = 333


def _expected_layer(layout: KVLayout, layer: int, num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + layer)
    return torch.randint(0, 256, (layout.bytes_per_layer(num_tokens),), dtype=torch.uint8, generator=gen)


def nixl_receiver(device: str, seed: int, timeout: float) -> int:
    """Child process: a VRAM KV receiver; prints ENDPOINT, then RESULT (or UNAVAILABLE)."""
    import asyncio

    from connector.receiver import KVReceiver, ReceiverSettings

    layout = glm5_fp8_ds_mla_layout(NIXL_LAYOUT["layers"], NIXL_LAYOUT["mtp"])

    async def run() -> dict:
        receiver = KVReceiver(ReceiverSettings(layout=layout, max_tokens=NIXL_TOKENS, device=device))
        try:
            await receiver.start()
        except Exception as exc:  # noqa: BLE001 - reported as "NIXL's CUDA support did not load"
            print(f"UNAVAILABLE {type(exc).__name__}: {exc}", flush=True)
            return {}
        print(f"ENDPOINT {receiver.endpoint}", flush=True)
        try:
            kv = await receiver.wait_for("gpu-check", timeout)
            bad = []
            for i, planes in enumerate(kv.layers):
                want = layer_views(_expected_layer(layout, i, NIXL_TOKENS, seed), layout, NIXL_TOKENS)
                if any(p.device.type != "cuda" for p in planes.values()) or not _same(planes, want):
                    bad.append(i)
            receiver.release("gpu-check")
            return {"layers": len(kv.layers), "bad_layers": bad}
        finally:
            await receiver.stop()

    result = asyncio.run(run())
    if result:
        print("RESULT " + json.dumps(result), flush=True)
    return 0


def _read_line(proc: subprocess.Popen, deadline: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if sel.select(timeout=max(0.0, deadline - time.monotonic())):
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"the receiver process exited ({proc.wait()})")
            if line.startswith(("ENDPOINT ", "RESULT ", "UNAVAILABLE ")):
                return line.strip()
    raise AssertionError("the receiver process did not answer in time")


def check_nixl_vram(ctx: Context) -> str:
    try:
        import nixl  # noqa: F401
    except ImportError as exc:
        raise Skip(f"NIXL is not installed ({exc})") from exc
    device = ctx.need_gpu("nixl imports")
    from connector.sender import KVSender

    layout, seed = glm5_fp8_ds_mla_layout(NIXL_LAYOUT["layers"], NIXL_LAYOUT["mtp"]), 5
    cmd = [sys.executable, __file__, "--nixl-receiver", "--device", str(device), "--seed", str(seed)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        first = _read_line(proc, time.monotonic() + 120)
        if first.startswith("UNAVAILABLE "):
            raise Skip(f"NIXL's CUDA support did not load (receiver: {first[12:]})")
        endpoint = first.removeprefix("ENDPOINT ")
        try:
            sender = KVSender("gpu-check-sender", layout, NIXL_TOKENS, device=str(device))
        except Exception as exc:  # noqa: BLE001
            raise Skip(f"NIXL's CUDA support did not load (sender: {type(exc).__name__}: {exc})") from exc
        try:
            sender.connect(endpoint, timeout=30)
            handoff = sender.begin(endpoint, "gpu-check", NIXL_TOKENS, timeout=30)
            start = time.perf_counter()
            for layer in range(layout.num_layers):
                want = layer_views(_expected_layer(layout, layer, NIXL_TOKENS, seed).to(device), layout, NIXL_TOKENS)
                for name, view in handoff.staging(layer).items():
                    view.copy_(want[name])
                torch.cuda.synchronize(device)
                handoff.post_layer(layer)
            status = handoff.wait(timeout=60)
            ms = (time.perf_counter() - start) * 1e3
            if status != "sent":
                raise AssertionError(f"handoff {status}: {handoff.error}")
        finally:
            sender.close()
        result = json.loads(_read_line(proc, time.monotonic() + 60).removeprefix("RESULT "))
        if result["bad_layers"] or result["layers"] != layout.num_layers:
            raise AssertionError(f"received KV differs: {result}")
        return (f"{layout.num_layers} layers x {NIXL_TOKENS} tokens VRAM -> VRAM between two processes, "
                f"byte-identical, {ms:.1f} ms")
    finally:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------- conversion

def check_tilert_kv(ctx: Context) -> str:
    gen = torch.Generator().manual_seed(3)
    n = 333  # 5 full indexer pages + a 13-token tail
    cache, indexer = _fp8_ds_mla_cache(gen)
    layout = glm5_fp8_ds_mla_layout(3, 1)
    received = []
    for _ in range(layout.num_layers):
        views = _staging(layout, n, "pageable", None)
        gather_layer(cache.squeeze(1), _block_ids(n, 64, gen), n, views, indexer)
        received.append(views)
    want = convert_layers(received, n, hadamard_matrix(INDEX_HEAD_DIM))
    device = ctx.need_gpu(f"CPU conversion of {layout.num_layers} layers x {n} tokens")
    hadamard = hadamard_matrix(INDEX_HEAD_DIM, device=device)
    lines = []
    for source, layers in (("host", received), ("vram", [{k: v.to(device) for k, v in p.items()} for p in received])):
        got = convert_layers(layers, n, hadamard, device=device)
        for (ki, kv, pe), (wki, wkv, wpe) in zip(got, want):
            if ki.device.type != "cuda" or not (torch.equal(kv.cpu(), wkv) and torch.equal(pe.cpu(), wpe)):
                raise AssertionError(f"{source}: latent or rope differ from the CPU conversion")
            diff = (ki.cpu().float() - wki.float()).abs()
            ulp = (wki.float().abs() * 2.0 ** -7).clamp(min=2.0 ** -133)
            if bool((diff > ulp).any()):
                raise AssertionError(f"{source}: indexer keys differ by more than 1 bf16 ulp (max {diff.max():.3g})")
        exact = all(torch.equal(g[0].cpu(), w[0]) for g, w in zip(got, want))
        lines.append(f"{source}: {'bit-identical' if exact else 'indexer keys within 1 bf16 ulp'}")
    return ("latent and rope bit-identical, indexer keys (fp32 matmul: CPU BLAS vs cuBLAS, TF32 "
            f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}): " + "; ".join(lines))


# ------------------------------------------------------------------- reference engine

PROMPTS = ["[gMASK]<sop><|user|>\nWhat does shutil.copy do?<|assistant|>\n",
           "def fibonacci(n):\n    ", "The quick brown fox"]
DECODE_TOKENS = 32


def _decode(model_dir: Path, device: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    from connector.receiver import ReceivedKV
    from decode_server.engine.base import SamplingParams
    from decode_server.engine.reference import ReferenceEngine
    from decode_server.reference import prefill
    from decode_server.reference.model import load_model
    from pd_wire.handoff import HandoffResult

    cpu_model = load_model(model_dir)
    engine = ReferenceEngine(model_dir, max_seq_len=1024, num_mtp=1, kv_dtype="float32", device=device)
    tokens, logprobs = [], []
    for ids in prompts:
        out = prefill(cpu_model, ids)  # the same prompt KV for both engines
        first = int(out.logits.argmax())
        kv = ReceivedKV(handoff_id="g", num_tokens=len(ids), layers=[{"kv": t.float()} for t in out.kv])
        handoff = HandoffResult(handoff_id="g", kv_endpoint="x:1", num_prompt_tokens=len(ids), first_token_id=first,
                                last_prompt_token_id=ids[-1], status="sent")
        session = engine.start(kv, handoff, SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, logprobs=0))
        seq, lps = [first], []
        while len(seq) < DECODE_TOKENS:
            step = session.step()
            seq += [t.token_id for t in step]
            lps += [float(t.logprob) for t in step if t.logprob is not None]
        session.close()
        tokens.append(seq[:DECODE_TOKENS])
        logprobs.append(lps[:DECODE_TOKENS - 1])
    return tokens, logprobs


def check_reference_engine(ctx: Context) -> str:
    model = ctx.model
    if model is None:
        if ctx.device is None:
            raise Skip(f"{ctx.why_dry}; no --model given (generating the tiny model is only worth it with a GPU)")
        from decode_server.tiny_model import ensure_tiny_model

        model = ensure_tiny_model(Path(os.environ.get("PD_TINY_MODEL_ROOT") or REPO / ".cache" / "tiny-model"))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompts = [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    cpu_tokens, cpu_lps = _decode(model, "cpu", prompts)
    device = ctx.need_gpu(f"CPU decode of {len(prompts)} prompts x {DECODE_TOKENS} tokens with {model.name}")
    gpu_tokens, gpu_lps = _decode(model, str(device), prompts)
    if gpu_tokens != cpu_tokens:
        raise AssertionError(f"greedy tokens differ: CPU {cpu_tokens} CUDA {gpu_tokens}")
    dlp = max(abs(a - b) for x, y in zip(cpu_lps, gpu_lps) for a, b in zip(x, y))
    return (f"{model.name}: {len(prompts)} prompts x {DECODE_TOKENS} greedy tokens (MTP 1) identical on CUDA and "
            f"CPU; largest |dlogprob| {dlp:.2e}")


CHECKS: list[tuple[str, Callable[[Context], str]]] = [
    ("gather/cpu-mla", check_gather_cpu_mla),
    ("gather/fp8-ds-mla", check_gather_fp8_ds_mla),
    ("nixl/vram", check_nixl_vram),
    ("tilert-kv", check_tilert_kv),
    ("reference-engine", check_reference_engine),
]


def run(ctx: Context) -> list[Result]:
    results = []
    for name, check in CHECKS:
        start = time.perf_counter()
        try:
            status, detail = "ok", check(ctx)
        except Skip as exc:
            status, detail = "skipped", str(exc)
        except Exception as exc:  # noqa: BLE001 - a failed check is reported, the others still run
            status, detail = "failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        results.append(Result(name, status, detail, round(time.perf_counter() - start, 2)))
        tag = {"ok": " OK ", "failed": "FAIL", "skipped": "SKIP"}[status]
        print(f"[{tag}] {name} ({results[-1].seconds:.1f} s): {detail}", flush=True)
    return results


def _context(args: argparse.Namespace) -> Context:
    if args.dry_run:
        return Context(None, "dry run (--dry-run)", args.model)
    if not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return Context(None, f"no CUDA device (torch {torch.__version__}, {built})", args.model)
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    return Context(device, "", args.model, {"gpu": torch.cuda.get_device_name(device)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--model", type=Path, default=None, help="tiny model directory (default: generate it)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--strict", action="store_true", help="a skipped check also fails the run")
    parser.add_argument("--dry-run", action="store_true", help="skip every GPU side even with a GPU")
    parser.add_argument("--nixl-receiver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.nixl_receiver:
        return nixl_receiver(args.device, args.seed, timeout=120)
    ctx = _context(args)
    print(f"gpu_check: torch {torch.__version__}, " + (f"{ctx.device} ({ctx.notes['gpu']})" if ctx.device else
                                                       f"dry mode: {ctx.why_dry}; GPU steps are skipped"), flush=True)
    started = time.perf_counter()
    results = run(ctx)
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "skipped", "failed")}
    print(f"gpu_check: {counts['ok']} ok, {counts['skipped']} skipped, {counts['failed']} failed "
          f"in {time.perf_counter() - started:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"context": {"device": str(ctx.device), "dry": ctx.device is None,
                                                     "why_dry": ctx.why_dry, **ctx.notes},
                                         "results": [asdict(r) for r in results]}, indent=2))
    return 1 if counts["failed"] or (args.strict and counts["skipped"]) else 0


if __name__ == "__main__":
    sys.exit(main())
