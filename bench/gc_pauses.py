"""Garbage collection pauses in the router: with its start-up heap frozen (the product,
``pd_http/heap.py``) and without (the same router with the freeze turned off), in one run.

Both routers run in front of the same fake prefill and fake decode (``bench/router_overhead.py``'s
``fake_stack``), each under this file's ``--child`` mode, which records the duration of
every garbage collection by generation (``gc.callbacks``) once the router is ready. Each
gets the same load: 1-token chat streams from 16 clients for ``--seconds``. Prints per
configuration the requests served, the full (generation 2) collections and their
durations, and the time spent in each generation per request.

    .venv/bin/python bench/gc_pauses.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _child(out: Path, freeze: bool, argv: list[str]) -> int:
    """Run the router, recording collections once it froze (or would have) its heap."""
    import pd_router.server.serve
    from pd_http import heap
    from pd_router.__main__ import main

    durations: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started = [0.0]

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            durations[info["generation"]].append(time.perf_counter() - started[0])

    def at_start(component: str) -> int:
        frozen = heap.freeze_startup_heap(component) if freeze else 0
        if not freeze:
            gc.collect()  # what the freeze's own collection would have cleared, so both start alike
        gc.callbacks.append(record)
        return frozen

    pd_router.server.serve.freeze_startup_heap = at_start  # type: ignore[assignment]
    try:
        return main(argv)
    finally:  # after the SIGTERM's drain
        gc.callbacks.clear()
        out.write_text(json.dumps(durations))


def _measure(seconds: float) -> list[dict[str, Any]]:
    import uvloop

    from bench.router_overhead import _phase, fake_stack
    from pd_deploy.commands import RouterSpec, router_argv
    from tests.procs import free_port, server

    logs = Path(tempfile.mkdtemp(prefix="gc-pauses-"))
    rows = []
    with fake_stack(logs) as (urls, _):
        for freeze in (False, True):
            port = free_port()
            argv = router_argv(RouterSpec((urls["prefill"],), (urls["decode"],), port=port,
                                          extra_args=("--log-level", "warning", "--max-queue", "4096")))
            record = logs / f"gc-{freeze}.json"
            child = [sys.executable, str(Path(__file__).resolve()), "--child", str(record),
                     "--freeze" if freeze else "--no-freeze", "--", *argv[argv.index("pd_router") + 1:]]
            url = f"http://127.0.0.1:{port}"
            with server(child, logs / f"router-{freeze}.log", url + "/ready", 60) as proc:
                async def load(url: str = url, pid: int = proc.proc.pid) -> int:
                    await _phase(url, "chat", False, 16, 5, pid, "warm", tokens=1)
                    t0, n = time.perf_counter(), 0
                    while time.perf_counter() - t0 < seconds:
                        await _phase(url, "chat", False, 16, 20, pid, f"g{n}", tokens=1)
                        n += 1
                    return n * 16 * 20
                requests = uvloop.run(load())
                proc.stop()
            durations = {int(k): v for k, v in json.loads(record.read_text()).items()}
            rows.append({"frozen": freeze, "requests": requests, "full": durations[2],
                         "ms_per_request": {g: sum(d) / requests * 1e3 for g, d in durations.items()}})
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        out, mode = Path(sys.argv[2]), sys.argv[3]
        sys.exit(_child(out, mode == "--freeze", sys.argv[5:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="load per configuration")
    args = parser.parse_args()
    started, load_start = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg()[0]
    for row in _measure(args.seconds):
        full = ", ".join(f"{d * 1e3:.1f}" for d in row["full"]) or "none"
        per = ", ".join(f"gen{g} {ms * 1e3:.1f} us" for g, ms in row["ms_per_request"].items())
        print(f"start-up heap {'frozen' if row['frozen'] else 'not frozen'}: {row['requests']} requests; "
              f"full collections: {len(row['full'])} ({full} ms); collector time per request: {per}")
    print(f"({started}; load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, "
          f"{os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
