"""Where a routed request's TTFT goes: a timestamp at each step of the router's hot path.

Starts the processes of ``bench/router_overhead.py`` (fake prefill, fake decode, ...) and
one more router, whose hot-path functions are wrapped to note ``time.perf_counter()`` as
each request passes them (``python -m bench.router_timeline serve ROUTER-ARGS``: the
router's own entry point with the wrappers installed; nothing in ``pd_router`` changes).
Sends paced streaming requests at C=1 (one every 3.19 ms, as router_overhead.py's C=1
phase), then prints, per step, the median time since the step before it: the router's own
work between the upstream exchanges, and the exchanges' round trips. The wrappers cost a
few microseconds each, which the steps include.

    .venv/bin/python bench/router_timeline.py [--requests N] [--endpoint chat|completions]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.router_overhead import TOKEN_DELAY, Phase, _one, fake_stack  # noqa: E402
from pd_deploy.commands import RouterSpec, router_argv  # noqa: E402
from tests.procs import free_port, python_argv, server  # noqa: E402

TAG = "timeline-"  # the request ids of the measured requests


class Recorder:
    """The steps each request passed, in order (``rid`` -> [(step, perf_counter)])."""

    def __init__(self) -> None:
        self.steps: dict[str, list[tuple[str, float]]] = {}
        self.current: str | None = None  # C=1: the one request in flight

    def mark(self, step: str) -> None:
        if self.current is not None:
            self.steps.setdefault(self.current, []).append((step, time.perf_counter()))

    def wrap(self, owner: Any, name: str, step: str) -> None:
        inner = getattr(owner, name)

        async def outer_async(*args: Any, **kwargs: Any) -> Any:
            self.mark(f"{step} called")
            result = await inner(*args, **kwargs)
            self.mark(f"{step} returned")
            return result

        def outer(*args: Any, **kwargs: Any) -> Any:
            self.mark(f"{step} called")
            result = inner(*args, **kwargs)
            self.mark(f"{step} returned")
            return result

        setattr(owner, name, outer_async if asyncio.iscoroutinefunction(inner) else outer)

    def dump(self, path: Path) -> None:
        """Written whole, then renamed: whoever waits for ``path`` never reads half of it."""
        part = path.with_suffix(".part")
        part.write_text(json.dumps({rid: steps for rid, steps in self.steps.items() if rid.startswith(TAG)}))
        part.replace(path)


def _instrument(rec: Recorder) -> None:
    from pd_router.apis import completions
    from pd_router.request import accept, checks, legs, prefill, relay
    from pd_router.slots.pool import SlotPool
    from pd_router.upstream import rawhttp

    send = rawhttp._Connection.send

    def sent(conn: Any, head: bytes, body: bytes, read_timeout: float | None) -> Any:
        rec.mark("sent " + head.split(b" ", 2)[1].decode())
        return send(conn, head, body, read_timeout)

    setattr(rawhttp._Connection, "send", sent)  # noqa: B010 (replaced on the class, as the other wrappers)
    for callback, step in (("on_headers_complete", "upstream headers"), ("on_message_complete", "upstream end")):
        _after(rec, rawhttp._Connection, callback, step)

    call = accept.CompletionHandler.__call__

    async def called(self: Any, scope: Any, receive: Any, send_: Any, *args: Any, **kwargs: Any) -> Any:
        rid = dict(scope["headers"]).get(b"x-request-id", b"").decode()
        rec.current = rid
        rec.mark("request")

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                rec.mark("response start sent")
            elif message.get("body"):
                rec.mark("response chunk sent")
            await send_(message)

        return await call(self, scope, receive, sending, *args, **kwargs)

    setattr(accept.CompletionHandler, "__call__", called)  # noqa: B010
    parse = completions.parse_request

    def parsed(*args: Any, **kwargs: Any) -> Any:
        result = parse(*args, **kwargs)
        rec.mark("body read and validated")
        return result

    setattr(accept, "parse_request", parsed)  # noqa: B010
    for owner, name, step in (
        (checks, "check_decode_view", "decode view"),
        (SlotPool, "take", "slot"),
        (legs, "open_slot", "decode request"),
        (prefill, "handoff", "prefill leg"),
        (prefill, "prefill_body", "prefill body"),
        (prefill, "read_handoff", "handoff check"),
        (relay, "decode_body", "decode body"),
    ):
        rec.wrap(owner, name, step)


def _after(rec: Recorder, owner: Any, name: str, step: str) -> None:
    inner: Callable[..., Any] = getattr(owner, name)

    def outer(*args: Any) -> Any:
        rec.mark(step)
        return inner(*args)

    setattr(owner, name, outer)


def serve(argv: list[str]) -> None:
    """The router with the wrappers; writes the timelines to $TIMELINE_OUT on SIGUSR2."""
    rec = Recorder()
    _instrument(rec)
    out = Path(os.environ["TIMELINE_OUT"])
    signal.signal(signal.SIGUSR2, lambda *_: rec.dump(out))
    from pd_router.__main__ import main

    sys.exit(main(argv))


def medians(timelines: dict[str, list[tuple[str, float]]]) -> list[tuple[str, float, float]]:
    """(step, median ms since the step before, median ms since the request) over the requests
    whose steps came in the most common order (a renewal or a probe in between changes it)."""
    orders = collections.Counter(tuple(step for step, _ in steps) for steps in timelines.values())
    order, _ = orders.most_common(1)[0]
    same = [steps for steps in timelines.values() if tuple(step for step, _ in steps) == order]
    rows = []
    for i, step in enumerate(order):
        since_prev = statistics.median((s[i][1] - s[i - 1][1]) * 1e3 if i else 0.0 for s in same)
        since_start = statistics.median((s[i][1] - s[0][1]) * 1e3 for s in same)
        rows.append((step, since_prev, since_start))
    return rows


async def _requests(url: str, endpoint: str, n: int) -> None:
    import aiohttp

    phase = Phase()
    async with aiohttp.ClientSession() as session:
        await _one(session, url, endpoint, False, "warm-timeline", phase, 3)
        for i in range(n):
            await asyncio.sleep(TOKEN_DELAY)
            await _one(session, url, endpoint, False, f"{TAG}{i}", phase, 3)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        return serve(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    args = parser.parse_args()
    import uvloop

    from bench.router_overhead import ENDPOINTS

    logs = Path(tempfile.mkdtemp(prefix="router-timeline-"))
    out = logs / "timelines.json"
    with fake_stack(logs) as (urls, _):
        port = free_port()
        argv = router_argv(RouterSpec((urls["prefill"],), (urls["decode"],), port=port,
                                      extra_args=("--log-level", "warning")))
        argv = python_argv(str(Path(__file__).resolve()), "serve", *argv[argv.index("-m") + 2:])
        env = {"TIMELINE_OUT": str(out)}
        with server(argv, logs / "timeline-router.log", f"http://127.0.0.1:{port}/ready", 30, env) as router:
            uvloop.run(_requests(f"http://127.0.0.1:{port}{ENDPOINTS[args.endpoint]}", args.endpoint, args.requests))
            router.proc.send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + 10
            while not out.exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # the router writes the file from its signal handler
    timelines = json.loads(out.read_text())
    rows = medians(timelines)
    print(f"{len(timelines)} {args.endpoint} requests at C=1, one every {TOKEN_DELAY * 1e3:.2f} ms; medians (ms):")
    print(f"{'step':40s} {'since previous':>15s} {'since request':>14s}")
    for step, since_prev, since_start in rows:
        print(f"{step:40s} {since_prev:15.3f} {since_start:14.3f}")


if __name__ == "__main__":
    main()
