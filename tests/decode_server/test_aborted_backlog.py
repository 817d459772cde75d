"""A generation aborted with steps still queued (its worker ran ahead of a client that stopped
reading: a SIGSTOPped router) ends at once: the queued steps are dropped, not rendered on the
loop first (which held the loop and the slot for seconds with a fast engine)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from decode_server.server.api_errors import Cancelled
from decode_server.server.generation import Job, _Stepped
from decode_server.server.metrics import DecodeMetrics
from pd_build.info import collect

QUEUED = 1000


class _CountingProcessor:
    """The loop's half of a SequenceProcessor, counting the steps it is asked to render."""

    finished = False

    def __init__(self) -> None:
        self.rendered = 0

    def text(self, cut: Any, first_logprob: Any = None) -> Any:
        self.rendered += 1
        raise AssertionError("a step queued before the abort was rendered")


async def test_an_aborted_job_drops_its_queued_steps() -> None:
    metrics = DecodeMetrics(lambda: 0, 1, collect("decode"), "m")
    job = Job.__new__(Job)  # what the abort and the loop's half read: the queue, the processor, the metrics
    job.ctx = SimpleNamespace(metrics=metrics)  # type: ignore[assignment]
    job.request_id, job.abort_reason, job._closed, job._session = "stalled", None, False, None
    job._queue, job._aborted = asyncio.Queue(), asyncio.Event()
    job._stop, job._lock = threading.Event(), threading.Lock()
    job._proc = proc = _CountingProcessor()  # type: ignore[assignment]
    for _ in range(QUEUED):  # the worker's steps, posted before the client stalled
        job._queue.put_nowait(_Stepped(cut=None))  # type: ignore[arg-type]
    assert job.abort("client_stalled")
    with pytest.raises(Cancelled):
        await job._next_delta(renderer=None)
    assert proc.rendered == 0
    assert metrics.registry.get_sample_value("decode_server_cancelled_total", {"reason": "client_stalled"}) == 1
