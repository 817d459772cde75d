"""A decode server's slot queue replayed from its log (decode_server/server/slots.py writes
``slot queued: ID arrived=T priority=P share=S tenant=N``, the same on ``slot granted``, and
``slot request left the queue: ID``): the order of its grants checked where it is decided."""

from __future__ import annotations

import re
from collections.abc import Iterable

QUEUE_EVENT = re.compile(r"slot (queued|granted|request left the queue): (\S+)(?: arrived=([\d.]+) "
                         r"priority=(-?\d+) share=(\S+) tenant=(\S+))?$")
Place = tuple[int, float, float]  # (priority, share, arrival): lower first


def replay(lines: Iterable[str]) -> tuple[int, list[tuple[str, list[str]]]]:
    """How many waiters the queue granted, and each grant made while a waiter with an earlier
    place was still queued (with those waiters)."""
    queued: dict[str, Place] = {}
    grants, overtaken = 0, []
    for line in lines:
        if (m := QUEUE_EVENT.search(line)) is None:
            continue
        kind, handoff_id = m[1], m[2]
        if kind == "queued":  # (again when a faster transit moved it)
            queued[handoff_id] = (int(m[4]), float(m[5]), float(m[3]))
            continue
        place = queued.pop(handoff_id, None)
        if kind == "granted":
            grants += 1
            mine = place or (int(m[4]), float(m[5]), float(m[3]))
            earlier = [other for other, p in queued.items() if p < mine]
            if earlier:
                overtaken.append((handoff_id, earlier))
    return grants, overtaken
