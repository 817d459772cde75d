"""Scale simulation of decode slots shared by routers: the GLM-5.1 B200 deployment's shape (72
single-slot decode servers, 4 prefill servers) behind one router, then behind two, in one
run with the same mocks and the same load; with ``--decodes 8,24,72``, the same for each
number of decode servers (the clients scaled with it: 4 for every 3 slots, so that
requests queue), to show what a request costs the router as the servers grow. The token
rate is scaled down (``--token-delay``, 50 ms: the 72 mocks together stream what one
Python process on this 2-CPU machine can serve; at TileRT's 3.19 ms they would stream 22k
tokens/s); what is measured is the slot traffic and the router's work per token, which do
not depend on it.

The mocks are tests/fakes' FakeDecode (holding slots for decode requests through the real SlotTable, one
slot each, ``--tokens`` tokens ``--token-delay`` apart) and FakePrefill, all on one
event loop in one process (a process each would not fit this machine). Each phase runs
``--clients`` streaming clients (more than the 72 slots, so requests queue), spread over
the routers, each sending ``--requests`` requests one after the other. Reported per phase:
router CPU per output token (all routers' CPU time from /proc), TTFT p50/p99 at the
clients, slot utilisation while a decode request waited (sampled in the mocks every 5 ms),
slot RTT (``pd_router_slot_rtt_seconds``: decode requests given a free slot at once),
decode requests standing in the servers' queues per request served, requests sent back as
busy (must be 0); and each phase against the first.

    .venv/bin/python bench/scale_slots.py [--decodes 72] [--routers 1,2] [--clients 96] [--requests 4]
        [--tokens 16] [--token-delay 0.05] [--tenants N] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.router_overhead import _cpu_seconds, _pct  # noqa: E402
from pd_build.versions import git_revision  # noqa: E402
from pd_deploy.commands import RouterSpec, router_argv  # noqa: E402
from tests.procs import free_port, python_argv, server  # noqa: E402

DECODES, PREFILLS = 72, 4
SECTION = "## Scale simulation: decode slots, 2 routers x 72 decode servers"


# ---- the mocks' process ----------------------------------------------------------------------
async def _serve_mocks(decode_ports: list[int], prefill_ports: list[int], stats_port: int, tokens: int,
                       token_delay: float) -> None:
    import uvicorn

    from pd_router.asgi import respond
    from tests.fakes.fake_backends import FakeDecode, FakePrefill

    decodes = [FakeDecode(slots=1, tokens=tokens, token_delay=token_delay) for _ in decode_ports]
    apps = [*zip(decodes, decode_ports), *((FakePrefill(), p) for p in prefill_ports)]
    waiting_samples: list[float] = []  # held slots / all slots, when a decode request waited
    calls = [0]  # standing decode requests before the last reset

    async def stats(scope, receive, send) -> None:  # GET /stats, POST /reset
        if scope["type"] != "http":
            return
        # slot requests: decode requests standing in a queue for their request
        total = sum(len(d.records.queued_claims) for d in decodes)
        if scope["path"] == "/reset":
            waiting_samples.clear()
            calls[0] = total
        body = {"samples": len(waiting_samples), "slot_requests": total - calls[0],
                "utilisation": sum(waiting_samples) / len(waiting_samples) if waiting_samples else None}
        await respond(send, 200, json.dumps(body).encode())

    async def sample() -> None:
        while True:
            tables = [d.slots for d in decodes]
            if any(t is not None and t.queued for t in tables):
                waiting_samples.append(sum(t.busy for t in tables if t is not None) / len(tables))
            await asyncio.sleep(0.005)

    servers = [uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools", lifespan="off",
                                             log_level="warning", access_log=False))
               for app, port in [*apps, (stats, stats_port)]]
    asyncio.ensure_future(sample())
    await asyncio.gather(*(s.serve() for s in servers))


# ---- the load ----------------------------------------------------------------------------------
@dataclass
class Phase:
    routers: int
    decodes: int = 0
    clients: int = 0
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    errors: int = 0


def _key(tenant: int) -> str:
    return f"scale-bench-tenant-{tenant}-key"


def _keys_file(path: Path, tenants: int) -> Path:
    """``--tenants``: the routers' keys file, one named key per tenant."""
    path.write_text("".join(f'[[key]]\nname = "tenant-{t}"\nsha256 = "{hashlib.sha256(_key(t).encode()).hexdigest()}"\n'
                            for t in range(tenants)))
    return path


async def _one(session: aiohttp.ClientSession, url: str, phase: Phase, max_tokens: int,
               tenant: int | None = None) -> None:
    body = {"model": "tiny", "prompt": "hello " * 200, "max_tokens": max_tokens, "stream": True}
    headers = {"Authorization": f"Bearer {_key(tenant)}"} if tenant is not None else None
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            phase.errors += 1
            await resp.read()
            return
        first = True
        async for chunk in resp.content.iter_any():
            n = chunk.count(b'"choices": [{')
            if n and first:
                phase.ttft.append(time.perf_counter() - t0)
                first = False
            phase.tokens += n


async def _run_phase(urls: list[str], pids: list[int], clients: int, requests: int, tokens: int,
                     token_delay: float, stats_url: str, tenants: int = 0) -> Phase:
    phase = Phase(len(urls))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        for url in urls:  # warm: connections to every mock
            await asyncio.gather(*(_one(session, url, Phase(0), 2, 0 if tenants else None) for _ in range(8)))
        await _stats(stats_url, "/reset")  # the mocks' numbers from here: the measured requests only

        async def client(c: int) -> None:
            await asyncio.sleep(c * tokens * token_delay / clients)  # spread the starts over one request
            for _ in range(requests):
                await _one(session, urls[c % len(urls)], phase, tokens, c % tenants if tenants else None)

        cpu0 = sum(_cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        phase.wall = time.perf_counter() - t0
        phase.cpu = sum(_cpu_seconds(p) for p in pids) - cpu0
    return phase


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split(" ", 1)[0].split("{", 1)[0] == name)


async def _router_numbers(urls: list[str]) -> dict[str, float]:
    out = {"rtt_sum": 0.0, "rtt_count": 0.0, "busy": 0.0}
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            out["rtt_sum"] += _metric(text, "pd_router_slot_rtt_seconds_sum")
            out["rtt_count"] += _metric(text, "pd_router_slot_rtt_seconds_count")
            out["busy"] += _metric(text, "pd_router_busy_requeues_total")
    return out


async def _stats(stats_url: str, path: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(stats_url + path) as resp:
        return await resp.json()


def _start_router(port: int, prefills: list[str], decodes: list[str], log: Path, keys: Path | None = None):
    spec = RouterSpec(prefill_urls=tuple(prefills), decode_urls=tuple(decodes), port=port,
                      extra_args=("--log-level", "warning", "--max-queue", "4096", "--queue-timeout", "300",
                                  "--probe-interval", "10",
                                  *(("--api-keys-file", str(keys)) if keys is not None else ())))
    return server(router_argv(spec), log, f"http://127.0.0.1:{port}/ready", 60)


def _row(phase: Phase, numbers: dict[str, float], stats: dict) -> dict:
    util = stats["utilisation"]
    return {"decodes": phase.decodes, "routers": phase.routers, "clients": phase.clients, "requests": len(phase.ttft),
            "errors": phase.errors,
            "slot_requests_per_request": stats["slot_requests"] / max(1, len(phase.ttft)),
            "cpu_us_per_token": phase.cpu / max(1, phase.tokens) * 1e6,
            "cpu_ms_per_request": phase.cpu / max(1, len(phase.ttft)) * 1e3,
            "ttft_p50_ms": _pct(phase.ttft, 0.5) * 1e3, "ttft_p99_ms": _pct(phase.ttft, 0.99) * 1e3,
            "tok_s": phase.tokens / phase.wall, "utilisation": util,
            "slot_rtt_ms": numbers["rtt_sum"] / numbers["rtt_count"] * 1e3 if numbers["rtt_count"] else None,
            "busy_requeues": numbers["busy"]}


def _table(rows: list[dict]) -> str:
    lines = ["| decode servers | routers | clients | requests | errors | router CPU us/token | router CPU ms/request | "
             "slot requests per request | TTFT p50 ms | TTFT p99 ms | tokens/s | slot utilisation while queued | "
             "slot RTT mean ms | busy requeues |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        util = f"{r['utilisation'] * 100:.1f}%" if r["utilisation"] is not None else "n/a (never queued)"
        rtt = f"{r['slot_rtt_ms']:.2f}" if r["slot_rtt_ms"] is not None else "n/a"
        lines.append(f"| {r['decodes']} | {r['routers']} | {r['clients']} | {r['requests']} | {r['errors']} | "
                     f"{r['cpu_us_per_token']:.1f} | {r['cpu_ms_per_request']:.2f} | "
                     f"{r['slot_requests_per_request']:.2f} | "
                     f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['tok_s']:.0f} | {util} | {rtt} | "
                     f"{r['busy_requeues']:.0f} |")
    first = rows[0]
    for r in rows[1:]:
        lines.append(f"| {r['decodes']} vs {first['decodes']} | {r['routers']} vs {first['routers']} | | | | "
                     f"x{r['cpu_us_per_token'] / first['cpu_us_per_token']:.2f} | "
                     f"x{r['cpu_ms_per_request'] / first['cpu_ms_per_request']:.2f} | "
                     f"x{r['slot_requests_per_request'] / max(1e-9, first['slot_requests_per_request']):.2f} | "
                     f"{r['ttft_p50_ms'] - first['ttft_p50_ms']:+.1f} | "
                     f"{r['ttft_p99_ms'] - first['ttft_p99_ms']:+.1f} | "
                     f"x{r['tok_s'] / first['tok_s']:.2f} | | | |")
    return "\n".join(lines)


async def _phase(stats_url: str, urls: list[str], pids: list[int], args: argparse.Namespace, decodes: int,
                 clients: int) -> dict:
    result = await _run_phase(urls, pids, clients, args.requests, args.tokens, args.token_delay, stats_url,
                              args.tenants)
    result.decodes, result.clients = decodes, clients
    return _row(result, await _router_numbers(urls), await _stats(stats_url, "/stats"))


def _bench(args: argparse.Namespace) -> list[dict]:
    rows = []
    for n_decodes in args.decodes:
        clients = args.clients if args.decodes == [DECODES] else n_decodes * 4 // 3
        decode_ports, prefill_ports, (stats_port,) = _ports(n_decodes, PREFILLS, 1)
        stats_url = f"http://127.0.0.1:{stats_port}"
        logs = Path(tempfile.mkdtemp(prefix="scale-slots-"))
        keys = _keys_file(logs / "keys.toml", args.tenants) if args.tenants else None
        spec = json.dumps([decode_ports, prefill_ports, stats_port, args.tokens, args.token_delay])
        prefills = [f"http://127.0.0.1:{p}" for p in prefill_ports]
        decodes = [f"http://127.0.0.1:{p}" for p in decode_ports]
        with server(python_argv("bench/scale_slots.py", "--mocks", spec), logs / "mocks.log", stats_url + "/stats",
                    120):
            for n in args.routers:
                (ports,) = _ports(n)
                urls = [f"http://127.0.0.1:{p}" for p in ports]
                with contextlib.ExitStack() as routers:
                    procs = [routers.enter_context(_start_router(p, prefills, decodes, logs / f"r{n}-{i}.log", keys))
                             for i, p in enumerate(ports)]
                    rows.append(asyncio.run(_phase(stats_url, urls, [p.pid for p in procs], args, n_decodes,
                                                   clients)))
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def _ports(*counts: int) -> list[list[int]]:
    """Distinct free ports in groups of ``counts`` (free_port alone may give one twice: with
    80 picks a collision is likely)."""
    seen: set[int] = set()
    while len(seen) < sum(counts):
        seen.add(free_port())
    flat = sorted(seen)
    groups, start = [], 0
    for n in counts:
        groups.append(flat[start:start + n])
        start += n
    return groups


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decodes", type=_ints, default=[DECODES], help="numbers of decode servers, e.g. 8,24,72")
    parser.add_argument("--routers", type=_ints, default=[1, 2], help="numbers of routers, e.g. 1,2")
    parser.add_argument("--clients", type=int, default=96, help="with the one default --decodes (else 4 per 3 slots)")
    parser.add_argument("--requests", type=int, default=4, help="requests per client, one after the other")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--token-delay", type=float, default=0.05, help="seconds between a mock's tokens")
    parser.add_argument("--tenants", type=int, default=0, help="clients of this many tenants (named keys: the "
                        "queues' fair shares on), client c of tenant c mod N; 0: no keys")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--mocks", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mocks:
        asyncio.run(_serve_mocks(*json.loads(args.mocks)))
        return
    load0 = os.getloadavg()[0]
    revision = git_revision() or "unknown"  # before the run writes its section into the tree
    t0 = time.time()
    rows = _bench(args)
    table = _table(rows)
    print(table)
    if args.no_write:
        return
    cmd = (f"`.venv/bin/python bench/scale_slots.py --decodes {','.join(map(str, args.decodes))} "
           f"--routers {','.join(map(str, args.routers))} --clients {args.clients} --requests {args.requests} "
           f"--tokens {args.tokens} --token-delay {args.token_delay:g}`")
    text = (f"{SECTION}\n\n{cmd} (single-slot fake decode servers holding slots for decode requests through "
            f"the real SlotTable, {PREFILLS} fake prefill servers, all on one event loop in one process; {args.tokens} "
            f"tokens {args.token_delay * 1e3:g} ms apart; the clients stream {args.requests} requests each, "
            f"one after the other, spread over the routers; the same mocks and load for each number of routers). "
            f"Commit {revision}, {time.strftime('%Y-%m-%d %H:%M', time.gmtime(t0))} UTC, "
            f"{time.time() - t0:.0f} s; machine: "
            f"{os.cpu_count()} CPUs, load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.\n\n"
            f"{table}\n")
    path = REPO / "docs" / "benchmarks.md"
    doc = path.read_text()
    if SECTION in doc:
        start = doc.index(SECTION)
        end = doc.find("\n## ", start + len(SECTION))
        doc = doc[:start] + text + (doc[end + 1:] if end != -1 else "")
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    path.write_text(doc)


if __name__ == "__main__":
    main()
