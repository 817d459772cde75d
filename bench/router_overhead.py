"""Router overhead: a fake decode server called directly vs through pd_router.

One run, same fakes, three endpoints: for concurrency 1, 16 and 64, streaming
requests with ``stream_options.include_usage``, 64 output tokens, 3.19 ms between tokens
(TileRT on B200); ``/v1/completions`` with a ~1k-token prompt, ``/v1/chat/completions``
with a system and a user message of ~1k tokens together (English text), ``/v1/responses``
with the same two as ``instructions`` and ``input`` and Anthropic's ``/v1/messages`` with them
as ``system`` and ``messages`` (each measured against the chat request it becomes, sent
directly: what the translation adds). Prints the
router's added TTFT p50/p99, added inter-token latency p50/p99, throughput ratio
(router/direct) and router CPU microseconds per output token (from the router process's
CPU time) per endpoint, each goal as met or not, and the floors beside the goals: at C=1
the added TTFT and at C=64 the CPU per token of a minimal PD relay (``bench/pd_floor.py``:
the router's upstream exchanges, the decode request first and the prefill on its 200, and a
byte relay of the answer, nothing else), the floor of a Python router with this protocol on
the machine, and at C=64 the CPU per token of a byte relay (``bench/bare_relay.py``) of the
direct streams, the floor of any relay;
writes them to docs/benchmarks.md under
"## Router overhead", its rows to bench/results/router_overhead.json and draws
docs/img/router_overhead.png from them (``python -m bench.plots`` redraws it).

    .venv/bin/python bench/router_overhead.py [--requests-per-client C1 C16 C64] [--rounds N]
        [--endpoints completions chat responses messages] [--no-write] [--results DIR] [--img DIR | --no-plot]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pd_build.versions import git_revision  # noqa: E402
from pd_deploy.commands import RouterSpec, router_argv  # noqa: E402
from pd_wire.handoff import HandoffResult
from tests.e2e.prompts import long_prompt  # noqa: E402
from tests.procs import free_port, python_argv, server  # noqa: E402

TOKENS, TOKEN_DELAY, PROMPT = 64, 0.00319, " ".join(f"w{i % 97}" for i in range(1000))
CONCURRENCY = (1, 16, 64)
FLOOR_CONCURRENCY = 64  # where the byte relay's CPU per token is measured beside the router's
PD_FLOOR_CONCURRENCY = (1, 64)  # where the minimal PD relay is measured: the TTFT and the CPU goals
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses",
             "messages": "/v1/messages"}
TRANSLATED = ("responses", "messages")  # served as the chat request they become (what the direct side sends)
# what a token's event starts with, per endpoint (not the usage chunk, not the closing events)
TOKEN_MARK = {"completions": b'"choices": [{', "chat": b'"choices": [{',
              "responses": b"event: response.output_text.delta", "messages": b"event: content_block_delta"}


def sent_as(endpoint: str, direct: bool) -> str:
    """The endpoint a request goes to: a translated one's chat request when sent directly."""
    return "chat" if direct and endpoint in TRANSLATED else endpoint


def chat_messages() -> list[dict[str, str]]:
    """A system prompt and a question about a document: ~1k tokens of English together."""
    text = long_prompt(3800)
    return [{"role": "system", "content": "You are a careful assistant. Answer from the document the user "
                                          "gives, cite the passage you rely on, and say so when it does not "
                                          "contain the answer. " + text[:600]},
            {"role": "user", "content": f"Document:\n{text[600:]}\n\nWhat does the document say about "
                                        "decoding errors, and which function should I use for streams?"}]


def request_body(endpoint: str, tokens: int = TOKENS) -> dict:
    """The request a client sends; ``responses`` and ``messages``: the chat request's messages as
    their system prompt and input (the router turns each into that chat request, which the
    direct side sends itself)."""
    if endpoint == "responses":
        system, user = chat_messages()
        return {"model": "tiny", "instructions": system["content"], "input": user["content"],
                "max_output_tokens": tokens, "stream": True}
    if endpoint == "messages":
        system, user = chat_messages()
        return {"model": "tiny", "system": system["content"], "messages": [user], "max_tokens": tokens,
                "stream": True}
    body: dict = {"model": "tiny", "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = chat_messages()
    else:
        body["prompt"] = PROMPT
    return body


@dataclass
class Phase:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    cpu: float = 0.0


def _cpu_seconds(pid: int) -> float:
    """CPU time of all threads of ``pid``, in ns precision (schedstat), not clock ticks."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    return total / 1e9


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _one(session: aiohttp.ClientSession, url: str, endpoint: str, direct: bool, rid: str,
               phase: Phase, tokens: int = TOKENS) -> None:
    body = request_body(sent_as(endpoint, direct), tokens)
    if direct:  # what the router would add: the handoff prefill returned
        body["kv_transfer_params"] = HandoffResult(
            handoff_id=rid,
            kv_endpoint="127.0.0.1:1",
            num_prompt_tokens=1000,
            first_token_id=7,
            last_prompt_token_id=3,
            status="sent",
        ).model_dump()
    t0 = time.perf_counter()
    prev = 0.0
    async with session.post(url, json=body, headers={"X-Request-Id": rid}) as resp:
        assert resp.status == 200, await resp.text()
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            n = chunk.count(TOKEN_MARK[sent_as(endpoint, direct)])
            if not n:
                continue
            if prev:
                phase.itl.extend([(now - prev) / n] * n)
            else:
                phase.ttft.append(now - t0)
                phase.itl.extend([0.0] * 0)
            prev = now
            phase.tokens += n


async def _phase(
    url: str, endpoint: str, direct: bool, concurrency: int, per_client: int, pid: int | None, tag: str,
    tokens: int = TOKENS,
) -> Phase:
    phase = Phase()
    connector = aiohttp.TCPConnector(limit=0)
    url += ENDPOINTS[sent_as(endpoint, direct)]  # direct: the chat it becomes
    async with aiohttp.ClientSession(connector=connector) as session:
        await _one(session, url, endpoint, direct, f"warm-{tag}", Phase(), tokens)

        async def client(c: int) -> None:
            # spread the clients' starts over one request's duration; identical requests
            # started together would stay in lock-step and measure bursts, not a steady load
            await asyncio.sleep(c * tokens * TOKEN_DELAY / concurrency)
            for i in range(per_client):
                await _one(session, url, endpoint, direct, f"{tag}-{c}-{i}", phase, tokens)

        cpu0 = _cpu_seconds(pid) if pid else 0.0
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(concurrency)))
        phase.wall = time.perf_counter() - t0
        phase.cpu = (_cpu_seconds(pid) - cpu0) if pid else 0.0
    return phase


def _merge(phases: list[Phase]) -> Phase:
    out = Phase()
    for p in phases:
        out.ttft += p.ttft
        out.itl += p.itl
        out.tokens += p.tokens
        out.wall += p.wall
        out.cpu += p.cpu
    return out


async def _measure(
    urls: dict[str, str], pids: dict[str, int], per_client: dict[int, int], rounds: int, endpoints: list[str],
) -> list[dict]:
    rows = []
    for c in CONCURRENCY:
        for endpoint in endpoints:
            directs, routeds, relayed, minimal = [], [], [], []
            for r in range(rounds):  # alternate, so that drifting machine load hits all alike
                n, tag = per_client[c], f"{endpoint[:4]}{c}.{r}"
                directs.append(await _phase(urls["decode"], endpoint, True, c, n, None, f"d-{tag}"))
                routeds.append(await _phase(urls["router"], endpoint, False, c, n, pids["router"], f"r-{tag}"))
                if c in PD_FLOOR_CONCURRENCY and endpoint not in TRANSLATED:  # the protocol's floor: minimal relay
                    minimal.append(await _phase(urls["floor"], endpoint, False, c, n, pids["floor"], f"f-{tag}"))
                if c == FLOOR_CONCURRENCY and endpoint not in TRANSLATED:  # the relay's floor: a byte relay
                    relayed.append(await _phase(urls["relay"], endpoint, True, c, n, pids["relay"], f"b-{tag}"))
            direct = _merge(directs)
            row = _row(endpoint, c, per_client[c] * rounds, direct, _merge(routeds))
            if minimal:
                floor = _merge(minimal)
                row["pd_floor_ttft_p50_ms"] = _added_ms(floor.ttft, direct.ttft, 0.5)
                row["pd_floor_cpu_us_per_token"] = floor.cpu / floor.tokens * 1e6
            if relayed:
                floor = _merge(relayed)
                row["byte_relay_cpu_us_per_token"] = floor.cpu / floor.tokens * 1e6
            rows.append(row)
    return rows


def _added_ms(through: list[float], direct: list[float], q: float) -> float:
    """What going through a relay added to the ``q`` quantile of a latency, in ms."""
    return (_pct(through, q) - _pct(direct, q)) * 1e3


def _row(endpoint: str, c: int, per_client: int, direct: Phase, routed: Phase) -> dict:
    return {
        "endpoint": endpoint,
        "concurrency": c,
        "requests": c * per_client,
        "ttft_p50_ms": _added_ms(routed.ttft, direct.ttft, 0.5),
        "ttft_p99_ms": _added_ms(routed.ttft, direct.ttft, 0.99),
        "itl_p50_ms": _added_ms(routed.itl, direct.itl, 0.5),
        "itl_p99_ms": _added_ms(routed.itl, direct.itl, 0.99),
        "throughput_ratio": (routed.tokens / routed.wall) / (direct.tokens / direct.wall),
        "router_cpu_us_per_token": routed.cpu / routed.tokens * 1e6,
        "direct_tok_s": direct.tokens / direct.wall,
        "routed_tok_s": routed.tokens / routed.wall,
        "direct_ttft_p50_ms": _pct(direct.ttft, 0.5) * 1e3,
    }


GOALS = {  # key: (concurrency it is judged at, limit, direction, wording)
    "ttft_p50_ms": (1, 1.0, "<=", "added TTFT p50 <= 1 ms at C=1"),
    "itl_p99_ms": (16, 0.25, "<=", "added ITL p99 <= 0.25 ms at C=16"),
    "throughput_ratio": (64, 0.95, ">=", "throughput ratio >= 0.95 at C=64"),
    "router_cpu_us_per_token": (64, 20.0, "<=", "router CPU <= 20 us per token at C=64"),
}


def verdicts(rows: list[dict]) -> list[str]:
    """One line per endpoint and goal: met or not, with the value."""
    out = []
    for endpoint in dict.fromkeys(r["endpoint"] for r in rows):
        for key, (c, limit, op, wording) in GOALS.items():
            value = next(r[key] for r in rows if r["endpoint"] == endpoint and r["concurrency"] == c)
            met = value <= limit if op == "<=" else value >= limit
            out.append(f"goal {wording}, {endpoint}: {'met' if met else 'NOT met'} ({value:.3f})")
    return out


def floors(rows: list[dict]) -> list[str]:
    """The router's added TTFT (C=1) and CPU per token (C=64) against the floors measured in
    the same run: the minimal PD relay's (the protocol) and the byte relay's (any relay)."""
    out = []
    for r in rows:
        where = f"floor at C={r['concurrency']}, {r['endpoint']}"
        routed_cpu = r["router_cpu_us_per_token"]
        floor_ttft = r.get("pd_floor_ttft_p50_ms")
        if r["concurrency"] == GOALS["ttft_p50_ms"][0] and floor_ttft is not None:
            ratio = r["ttft_p50_ms"] / floor_ttft if floor_ttft > 0 else float("inf")
            out.append(f"{where}: a minimal PD relay of the router's protocol (bench/pd_floor.py: the decode "
                       f"request first, the prefill on its 200) added {floor_ttft:.2f} ms TTFT p50; the router "
                       f"{r['ttft_p50_ms']:.2f} (x{ratio:.2f}; issue 34's goal x1.2: "
                       f"{'met' if ratio <= 1.2 else 'NOT met'})")
        if r["concurrency"] == GOALS["router_cpu_us_per_token"][0] and "pd_floor_cpu_us_per_token" in r:
            floor = r["pd_floor_cpu_us_per_token"]
            out.append(f"{where}: a minimal PD relay (bench/pd_floor.py) used {floor:.1f} us of CPU per token; "
                       f"the router {routed_cpu:.1f} (x{routed_cpu / floor:.2f})")
        floor = r.get("byte_relay_cpu_us_per_token")
        if floor:
            out.append(f"{where}: a byte relay (bench/bare_relay.py) of the direct requests used {floor:.1f} us "
                       f"of CPU per token; the router {routed_cpu:.1f} (x{routed_cpu / floor:.2f}; issue 34's goal "
                       f"x1.25: {'met' if routed_cpu / floor <= 1.25 else 'NOT met'})")
    return out


def _table(rows: list[dict]) -> str:
    lines = [
        "| endpoint | concurrency | requests | added TTFT p50 / p99 (ms) | added ITL p50 / p99 (ms) "
        "| throughput ratio | router CPU us/token | direct tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['endpoint']} | {r['concurrency']} | {r['requests']} "
            f"| {r['ttft_p50_ms']:.2f} / {r['ttft_p99_ms']:.2f} "
            f"| {r['itl_p50_ms']:.3f} / {r['itl_p99_ms']:.3f} | {r['throughput_ratio']:.3f} "
            f"| {r['router_cpu_us_per_token']:.1f} | {r['direct_tok_s']:.0f} |"
        )
    return "\n".join(lines)


def _write_section(text: str) -> None:
    path = REPO / "docs" / "benchmarks.md"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    head, sep, rest = old.partition("## Router overhead")
    if sep:  # keep the other sections as they are
        nxt = rest.find("\n## ")
        rest = rest[nxt + 1 :] if nxt >= 0 else ""
    else:
        head, rest = old.rstrip() + "\n\n", ""
    path.parent.mkdir(exist_ok=True)
    path.write_text(head + text.rstrip() + "\n" + ("\n" + rest if rest else ""))


@contextmanager
def fake_stack(logs: Path) -> Iterator[tuple[dict[str, str], dict[str, int]]]:
    """A fake prefill and a fake decode server (1024 slots, a token every TOKEN_DELAY s); in
    front of them a router and a minimal PD relay (``bench/pd_floor.py``), and in front of the fake
    decode a byte relay (``bench/bare_relay.py``); each its own process. Yields their URLs and the pids of the
    router, the byte relay and the minimal PD relay."""
    ports = {name: free_port() for name in ("prefill", "decode", "router", "relay", "floor")}
    fake = ["-m", "tests.fakes.fake_backends"]
    decode_knobs = json.dumps({"model": "tiny", "slots": 1024, "token_delay": TOKEN_DELAY})
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}

    floor_argv = python_argv("-m", "bench.pd_floor", "--port", str(ports["floor"]), "--prefill",
                             f"127.0.0.1:{ports['prefill']}", "--decode", f"127.0.0.1:{ports['decode']}")
    with (
        server(python_argv(*fake, "prefill", "--port", str(ports["prefill"])), logs / "prefill.log",
               urls["prefill"] + "/health", 30),
        server(python_argv(*fake, "decode", "--port", str(ports["decode"]), "--knobs", decode_knobs),
               logs / "decode.log", urls["decode"] + "/ready", 30),
        server(router_argv(RouterSpec((urls["prefill"],), (urls["decode"],), port=ports["router"],
                                      extra_args=("--log-level", "warning", "--max-queue", "4096"))),
               logs / "router.log", urls["router"] + "/ready", 30) as router,
        server(python_argv("-m", "bench.bare_relay", "--port", str(ports["relay"]), "--upstream",
                           urls["decode"].removeprefix("http://")),
               logs / "relay.log", urls["relay"] + "/ready", 30) as relay,
        server(floor_argv, logs / "floor.log", urls["floor"] + "/ready", 30) as floor,
    ):
        yield urls, {"router": router.proc.pid, "relay": relay.proc.pid, "floor": floor.proc.pid}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests-per-client", type=int, nargs=3, default=[20, 4, 2], metavar=("C1", "C16", "C64")
    )
    parser.add_argument("--rounds", type=int, default=3, help="direct/routed alternations per concurrency")
    parser.add_argument("--endpoints", nargs="+", choices=sorted(ENDPOINTS), default=list(ENDPOINTS))
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results",
                        help="where router_overhead.json goes (python -m bench.plots draws from it)")
    parser.add_argument("--img", type=Path, default=REPO / "docs" / "img", help="where router_overhead.png goes")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    started, load_start = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg()[0]
    per_client = dict(zip(CONCURRENCY, args.requests_per_client, strict=True))
    logs = Path(tempfile.mkdtemp(prefix="router-bench-"))
    with fake_stack(logs) as (urls, pids):
        revision = git_revision() or "unknown"  # before the run writes its results into the tree
        t0 = time.perf_counter()
        rows = uvloop.run(_measure(urls, pids, per_client, args.rounds, args.endpoints))
        took = time.perf_counter() - t0
    table = _table(rows)
    load = os.getloadavg()[0]
    goals = "\n".join(verdicts(rows) + floors(rows))
    print(table)
    print(goals)
    print(f"({started}, {took:.0f} s; load average {load_start:.1f} at the start, {load:.1f} at the end, "
          f"{os.cpu_count()} CPUs; logs in {logs})")
    from bench.plots import render, write_result

    data = write_result("router_overhead", f"{started}, {os.cpu_count()} CPUs, load {load_start:.1f} -> {load:.1f}",
                        rows, args.results, goals={k: [c, limit] for k, (c, limit, _, _) in GOALS.items()})
    print(f"data: {data}")
    figure = ""
    if not args.no_plot:
        print(f"figure: {render('router_overhead', args.results, args.img)}")
        figure = "\n![router overhead by concurrency](img/router_overhead.png)\n"
    if not args.no_write:
        _write_section(
            "## Router overhead\n\n"
            f"`.venv/bin/python bench/router_overhead.py` (fake prefill + fake decode as processes, "
            f"{TOKENS} tokens, {TOKEN_DELAY * 1e3:.2f} ms between tokens, streaming with "
            "`stream_options.include_usage`; `/v1/completions` with a ~1k-token prompt, "
            "`/v1/chat/completions` with a system + user message of ~1k tokens together, `/v1/responses` with "
            "the same two as `instructions` and `input` and `/v1/messages` (Anthropic's) with them as `system` and "
            "`messages`, each against the chat request it becomes sent directly; the router "
            f"process's CPU time from /proc; clients' starts spread over one request). Added = through the "
            f"router minus direct to the fake decode, same run, {args.rounds} alternations pooled; at "
            f"C={FLOOR_CONCURRENCY} the direct requests also go through a byte relay (`bench/bare_relay.py`: "
            "no HTTP parsing, one read and one write per chunk) in the same alternations, whose CPU per token "
            "is the floor of any relay on the machine; at C=1 and C=64 the routed requests also go through a "
            "minimal PD relay (`bench/pd_floor.py`: the router's exchanges, the decode request first and the "
            "prefill on its 200, and a byte relay of the answer, nothing checked, no metrics), the floor of a "
            "Python router with this protocol on the machine. "
            f"Commit {revision}, {started}, {took:.0f} s; machine: {os.cpu_count()} CPUs, load "
            f"average {load_start:.1f} at the start, {load:.1f} at the end.\n\n"
            f"{table}\n\n```\n{goals}\n```\n{figure}{_caveat(load)}"
        )


def _caveat(load: float) -> str:
    cpus = os.cpu_count() or 1
    note = (
        "\nRouter CPU per token depends on how many chunks one event-loop wake-up handles: at C=1 every "
        "token is its own wake-up and the router's idle work (probes, the least-loaded policy's /metrics "
        "scrapes every 0.5 s, uvicorn's tick: 9 ms/s measured on 2026-12-01) is spread over only ~316 "
        "tokens/s; on a contended machine the router runs less often and handles more "
        "chunks per wake-up, so its CPU per token drops while latency rises.\n"
    )
    if load <= cpus:
        return note
    return note + (
        f"\nThe load average ({load:.1f}) exceeded the {cpus} CPUs: other processes competed with the fakes, "
        "the router and the client, so the latency columns (added TTFT, ITL p99) and the C=64 throughput "
        "vary several-fold between runs.\n"
    )


if __name__ == "__main__":
    main()
