"""Where the router's CPU and added latency come from: per request, per token, per round trip.

The same processes as ``bench/router_overhead.py`` (fake prefill, fake decode with 1024
slots and a token every 3.19 ms, the router), chat completions, streaming. Measures

* router CPU per request: 1-token streams at C=16 (the decode request taking its slot, the
  prefill, the relay of one chunk and the end, the access line): everything a request costs
  besides its tokens;
* router CPU per token: 512-token streams at C=64, less their requests' share;
* the floors under both: the same streams through a byte relay (``bench/bare_relay.py``: no
  HTTP parsing, one read and one write per chunk), its CPU per request (one exchange
  relayed, where the router makes three: the client's, the decode request, the prefill) and
  per token; and the routed requests through a minimal PD relay (``bench/pd_floor.py``: the
  router's exchanges, nothing checked), per request and per token;
* the loopback round trip of one small POST to a Python server (the fake decode's cancel of
  an unknown id) paced like the C=1 run (one every 3.19 ms, so both ends sleep in between),
  which bounds how low the router's added TTFT can go: a routed request waits on more
  sequential exchanges than a direct one (the decode request's 200, the prefill, and the
  router's own hop between client and decode server).

Prints the split and what it predicts for the 64-token requests of router_overhead.py, for
the router and for each floor (issue 34's CPU goal: the router at 1.25x the byte relay).

    .venv/bin/python bench/router_cpu_split.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.router_overhead import TOKEN_DELAY, TOKENS, _phase, fake_stack  # noqa: E402
from pd_router.upstream.calls import Target  # noqa: E402
from pd_router.upstream.connections import ConnectionPool  # noqa: E402
from pd_wire.decode import CANCEL_PATH, CancelRequest  # noqa: E402

LONG = 512


async def _round_trips(decode_url: str, n: int = 300) -> list[float]:
    origin, pool = Target.parse(decode_url).origin, ConnectionPool()
    body = CancelRequest(request_id="no-such-request").model_dump_json().encode()
    out = []
    try:
        for _ in range(n):
            await asyncio.sleep(TOKEN_DELAY)
            t0 = time.perf_counter()
            resp = await pool.post(origin, CANCEL_PATH, body, {})
            await resp.read()
            resp.release()
            out.append(time.perf_counter() - t0)
    finally:
        pool.close()
    return out


async def _split(url: str, pid: int, direct: bool, tag: str) -> tuple[float, float]:
    """(CPU seconds per request, per token) of the process ``pid`` serving ``url``: 1-token
    streams at C=16, then LONG-token streams at C=64 less their requests' share."""
    short = await _phase(url, "chat", direct, 16, 20, pid, f"{tag}s", tokens=1)
    per_request = short.cpu / (16 * 20)
    long = await _phase(url, "chat", direct, 64, 1, pid, f"{tag}l", tokens=LONG)
    return per_request, (long.cpu - 64 * per_request) / long.tokens


async def _measure(urls: dict[str, str], pids: dict[str, int], rounds: int) -> dict[str, float]:
    """``relay``: the byte relay, fed the direct requests; ``floor``: the minimal PD relay."""
    names = ("router", "relay", "floor")
    cpu: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
    rtts, direct_ttft = [], []
    for r in range(rounds):
        for name in names:
            direct = name == "relay"
            request_cpu, token_cpu = await _split(urls[name], pids[name], direct, f"{name}{r}")
            cpu[name][0].append(request_cpu)
            cpu[name][1].append(token_cpu)
        rtts += await _round_trips(urls["decode"])
        direct_ttft += (await _phase(urls["decode"], "chat", True, 1, 20, None, f"d{r}")).ttft

    def ms(name: str) -> float:
        return statistics.median(cpu[name][0]) * 1e3

    def us(name: str) -> float:
        return statistics.median(cpu[name][1]) * 1e6

    return {"per_request_ms": ms("router"), "per_token_us": us("router"),
            "floor_request_ms": ms("relay"), "floor_us": us("relay"),
            "pd_floor_request_ms": ms("floor"), "pd_floor_us": us("floor"),
            "rtt_p50_ms": statistics.median(rtts) * 1e3,
            "direct_ttft_p50_ms": statistics.median(direct_ttft) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the measurements (medians)")
    args = parser.parse_args()
    started, load_start = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg()[0]
    with fake_stack(Path(tempfile.mkdtemp(prefix="router-split-"))) as (urls, pids):
        m = uvloop.run(_measure(urls, pids, args.rounds))
    share = m["per_request_ms"] * 1e3 / TOKENS
    print(f"router CPU per request (1-token chat streams, C=16): {m['per_request_ms']:.3f} ms")
    print(f"router CPU per relayed token ({LONG}-token chat streams, C=64, less the requests' share): "
          f"{m['per_token_us']:.1f} us")
    print(f"the floors, a byte relay (bench/bare_relay.py) of the same streams: {m['floor_request_ms']:.3f} ms per "
          f"request (one exchange; the router makes 3: x{m['per_request_ms'] / m['floor_request_ms']:.2f}), "
          f"{m['floor_us']:.1f} us per token (the router's relay: x{m['per_token_us'] / m['floor_us']:.2f})")
    print(f"a minimal PD relay (bench/pd_floor.py) of the routed requests: {m['pd_floor_request_ms']:.3f} ms per "
          f"request (the same 3 exchanges: the router x{m['per_request_ms'] / m['pd_floor_request_ms']:.2f}), "
          f"{m['pd_floor_us']:.1f} us per token (the router's relay: x{m['per_token_us'] / m['pd_floor_us']:.2f})")
    print(f"at {TOKENS} tokens per request: {share:.1f} us/token from the request + {m['per_token_us']:.1f} "
          f"per token = {share + m['per_token_us']:.1f} us/token")

    def at(request_ms: float, token_us: float) -> float:
        return request_ms * 1e3 / TOKENS + token_us

    relay = at(m["floor_request_ms"], m["floor_us"])
    print(f"at {TOKENS} tokens, against the byte relay's {relay:.1f} us/token (issue 34's goal: x1.25 for the "
          f"router): the router x{at(m['per_request_ms'], m['per_token_us']) / relay:.2f}, the minimal PD relay "
          f"x{at(m['pd_floor_request_ms'], m['pd_floor_us']) / relay:.2f}")
    print(f"loopback round trip of one small POST to a Python server, one every {TOKEN_DELAY * 1e3:.2f} ms: "
          f"p50 {m['rtt_p50_ms']:.3f} ms; direct TTFT p50 {m['direct_ttft_p50_ms']:.3f} ms")
    print(f"a routed request waits on 3 more sequential exchanges than a direct one (the decode request, the "
          f"prefill, the router's hop): ~{3 * m['rtt_p50_ms']:.2f} ms of added TTFT before the router's own work")
    print(f"({started}; load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, "
          f"{os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
