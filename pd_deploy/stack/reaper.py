"""The stack's reaper: stops every process group of the stack once the launcher is gone.

The launcher starts it first (``python reaper.py``, run by path: standard library only,
nothing of the project imported) with a pipe on its stdin, and writes the process group
id of each child it starts, one per line. Only the launcher holds the pipe's write end, so
the reaper reads end-of-file when the launcher exits, however it exits (SIGKILL included)
or when it closes the pipe after a normal stop. It then sends SIGTERM to every group
(each child runs in its own group, with whatever it started itself, such as vLLM's
engine-core process) and SIGKILL to whatever is left after ``GRACE_S``.

The children also get SIGTERM from the kernel when the launcher dies (parent-death
signal, :mod:`pd_deploy.stack.process`); the reaper covers their own children, which do
not inherit that signal, and children that ignore or survive SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

GRACE_S = 2.0  # between SIGTERM and SIGKILL
POLL_S = 0.05


def _signal_groups(groups: set[int], sig: int) -> set[int]:
    """Send ``sig`` to each group; the groups that still exist."""
    alive = set()
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
            alive.add(pgid)
        except (ProcessLookupError, PermissionError):
            pass
    return alive


def _live_groups(groups: set[int]) -> set[int]:
    """The groups with a process that is not a zombie (an exited child the new parent has
    not reaped yet still makes its group exist for ``killpg``)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return _signal_groups(groups, 0)
    live = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            live.add(int(fields[2]))
    return live


def stop_groups(groups: set[int], grace_s: float = GRACE_S) -> None:
    alive = _signal_groups(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(POLL_S)
        alive = _live_groups(alive)
    _signal_groups(alive, signal.SIGKILL)


def main() -> int:
    # a terminal's Ctrl-C or hang-up reaches the launcher, which stops the stack itself and
    # then closes the pipe; the reaper must outlive that to check
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    groups: set[int] = set()
    stdin = sys.stdin.buffer
    while line := stdin.readline():
        try:
            pgid = int(line)
        except ValueError:
            continue
        if pgid > 1 and pgid != os.getpgrp():
            groups.add(pgid)
    stop_groups(groups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
