"""The startup heap, out of the garbage collector's sight.

A server process holds a few hundred thousand objects once it has started (the router:
~260k with xgrammar and torch imported by structured output's warm-up; the decode server
more, with its engine and model), all of them live for the process's lifetime. CPython's
full (generation 2) collection scans every tracked object: 140-176 ms on this project's
2-core development VM for the router's heap, during which the event loop (every relayed
token, every slot request) stands still. Full collections come when enough objects have survived
into the oldest generation, so a busy server has them regularly (two in 30 s at ~1150
requests/s through the router). :func:`freeze_startup_heap` moves what is alive at the end
of start-up to the permanent generation (``gc.freeze``): later full collections scan only
what was allocated since (2-12 ms; ``bench/gc_pauses.py``). vLLM's engine core does the
same after its start-up.

Called by the process entry points only (``python -m pd_router``, ``python -m
decode_server``), never by an app built in a test process: a frozen object that later
becomes garbage in a reference cycle is never collected.
"""

from __future__ import annotations

import gc
import logging
from time import perf_counter

log = logging.getLogger("pd_http.heap")


def freeze_startup_heap(component: str) -> int:
    """Collect, then freeze what is alive; returns the number of objects frozen."""
    t0 = perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects of the start-up heap frozen (%.0f ms): full garbage collections no longer scan "
             "them", component, frozen, (perf_counter() - t0) * 1e3)
    return frozen
