"""Where a running Python process spends its busy time: py-spy samples, grouped by frame.

Used by bench/e2e.py to split vLLM's prefill step into the main model, the MTP drafter,
the KV connector and the rest, from samples of the worker process that runs the model
(``VLLM::Worker``). Non-blocking sampling (the process is never paused), idle samples
left out, so a group's samples / rate is the CPU time spent in it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

RATE_HZ = 200

# First matching group wins: connector work done inside the drafter's layers counts as connector.
# py-spy names frames "function (path/relative/to/sys.path.py:line)".
VLLM_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("KV connector", ("(connector/",)),
    ("MTP drafter", ("vllm/v1/spec_decode/",)),
    ("main model", ("vllm/model_executor/models/",)),
)
OTHER = "other (runner, sampler, scheduling)"


def py_spy() -> Path:
    exe = Path(sys.executable).with_name("py-spy")
    if not exe.is_file():
        raise FileNotFoundError(f"{exe}: install the bench extra (pip install -e '.[bench]')")
    return exe


def vllm_workers(server_pid: int) -> list[int]:
    """The processes of a vLLM server that run the model (``VLLM::Worker``)."""
    procs = psutil.Process(server_pid).children(recursive=True)
    return [p.pid for p in procs if "VLLM::Worker" in " ".join(_names(p))]


def _names(proc: psutil.Process) -> list[str]:
    try:
        return [proc.name(), *proc.cmdline()]
    except psutil.Error:
        return []


@dataclass(frozen=True)
class Profile:
    busy_s: float  # CPU time of the sampled threads (samples / rate)
    groups: dict[str, float]  # seconds per group, OTHER included

    def per(self, n: int) -> Profile:
        return Profile(self.busy_s / n, {k: v / n for k, v in self.groups.items()})


@contextmanager
def sampled(pid: int, out: Path, rate: int = RATE_HZ) -> Iterator[list[Profile]]:
    """Sample ``pid`` for the duration of the block; the yielded list receives the profile."""
    cmd = [str(py_spy()), "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
           "--nonblocking", "--threads", "--output", str(out)]
    # py-spy attaches within milliseconds; the sampled requests last seconds
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    result: list[Profile] = []
    try:
        yield result
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if not out.is_file():
            raise RuntimeError(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")
        result.append(classify(out.read_text().splitlines(), VLLM_GROUPS, rate))


def classify(lines: Sequence[str], groups: Sequence[tuple[str, tuple[str, ...]]], rate: int) -> Profile:
    """``lines``: py-spy raw (collapsed) stacks with the thread first, ``thread (id);frame;... count``.
    Only the thread with the most samples in a named group counts (the one running the
    model; a vLLM worker's other threads are the connector's lanes and pollers)."""
    per_thread: dict[str, Counter[str]] = {}
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        thread = stack.split(";", 1)[0]
        name = next((g for g, needles in groups if any(s in stack for s in needles)), OTHER)
        per_thread.setdefault(thread, Counter())[name] += int(n)
    if not per_thread:
        return Profile(0.0, {name: 0.0 for name, _ in groups} | {OTHER: 0.0})
    counts = max(per_thread.values(), key=lambda c: sum(v for k, v in c.items() if k != OTHER))
    seconds = {name: counts[name] / rate for name, _ in groups}
    seconds[OTHER] = counts[OTHER] / rate
    return Profile(sum(counts.values()) / rate, seconds)
