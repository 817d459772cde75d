"""The decode-server overhead bench and its scripted engine: an engine call runs its GPU
steps (fewer near ``max_tokens``), each emitting 1 + the MTP drafts a seeded draw accepted,
the same in every session; the spinning wait leaves the GIL to other threads; and the bench
runs end to end, both engine placements, printing its ratios."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from connector.receiver_state import ReceivedKV
from decode_server.engine.base import SamplingParams
from pd_wire.handoff import HandoffResult
from tests.fakes.fake_engine import FakeEngine, FakeEngineConfig, spin_for

REPO = Path(__file__).resolve().parents[1]
HANDOFF = HandoffResult(handoff_id="b", kv_endpoint="x:1", num_prompt_tokens=4, first_token_id=5,
                        last_prompt_token_id=1, status="sent")


def _calls(engine: FakeEngine, max_tokens: int) -> list[int]:
    session = engine.start(ReceivedKV("b", 4, []), HANDOFF, SamplingParams(max_tokens=max_tokens))
    produced, sizes = 1, []
    while produced < max_tokens:
        sizes.append(len(session.step()))
        produced += sizes[-1]
    session.close()
    return sizes


def test_a_call_runs_its_gpu_steps_with_mtp_drafts_drawn_the_same_in_every_session():
    engine = FakeEngine(FakeEngineConfig(per_step=4, accept=0.6, steps_per_call=3))
    first = _calls(engine, 200)
    assert first == _calls(engine, 200)  # the same draw: the bench's baseline and server see the same calls
    assert all(1 <= n <= 12 for n in first) and len(set(first)) > 1  # up to 3 steps of 1..4 tokens, varying
    assert all(n >= 3 for n in first[:len(first) // 2])  # 3 steps a call while max_tokens is far
    assert engine.started and engine.closed == 2
    # near max_tokens a call runs fewer steps: 4 tokens left at most 4 a step -> one step
    assert all(n <= 4 for n in _calls(FakeEngine(FakeEngineConfig(per_step=4, accept=1.0, steps_per_call=8)), 5))


def test_the_spinning_wait_leaves_the_gil_to_other_threads():
    spin_for(0.001)  # compiled
    seen: list[float] = []
    done = threading.Event()

    def other() -> None:
        while not done.is_set():
            seen.append(time.monotonic())

    thread = threading.Thread(target=other)
    thread.start()
    t0 = time.monotonic()
    spin_for(0.2)
    t1 = time.monotonic()
    done.set()
    thread.join()
    assert t1 - t0 >= 0.2
    inside = [t for t in seen if t0 + 0.05 < t < t1 - 0.05]
    assert len(inside) > 1000, len(inside)  # it ran all along the spin, not at a switch interval's end


def test_the_bench_runs_both_placements_end_to_end():
    done = subprocess.run(
        [sys.executable, "bench/decode_server_overhead.py", "--tokens", "24", "--concurrency", "1",
         "--step-ms", "2", "--steps-per-call", "2", "--mtp", "1", "--accept", "0.5", "--gil-us", "100",
         "--engine-in", "thread", "process"], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"engine in (\w+) .*ratio per user vs engine alone ([\d.]+), pace ratio ([\d.]+)", done.stdout)
    assert [r[0] for r in rows] == ["thread", "process"], done.stdout
    assert all(0.3 < float(r[1]) < 1.5 and 0.3 < float(r[2]) < 1.5 for r in rows), done.stdout
