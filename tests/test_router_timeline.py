"""bench/router_timeline.py: its wrappers find every hot-path function they wrap (a renamed
one fails here, not in the middle of a bench run), and its medians keep to the requests
whose steps came in the most common order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.router_timeline import medians

REPO = Path(__file__).resolve().parents[1]


def test_the_wrappers_install_on_the_router_as_it_is():
    # in a process of its own: the wrappers replace functions of pd_router for good
    code = "from bench.router_timeline import Recorder, _instrument; _instrument(Recorder()); print('ok')"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_medians_are_per_step_over_the_requests_in_the_usual_order():
    timelines = {
        "a": [("request", 0.0), ("sent", 0.001), ("headers", 0.004)],
        "b": [("request", 1.0), ("sent", 1.003), ("headers", 1.005)],
        "c": [("request", 2.0), ("sent", 2.002), ("headers", 2.003)],
        "renewed": [("request", 3.0), ("sent", 3.001), ("sent", 3.5), ("headers", 3.6)],  # another order: left out
    }
    rows = medians(timelines)
    assert [step for step, _, _ in rows] == ["request", "sent", "headers"]
    since_prev = [round(p, 6) for _, p, _ in rows]
    since_start = [round(s, 6) for _, _, s in rows]
    assert since_prev == [0.0, 2.0, 2.0]  # ms: medians of (1, 3, 2) and (3, 2, 1)
    assert since_start == [0.0, 2.0, 4.0]  # medians of (1, 3, 2) and (4, 5, 3)
