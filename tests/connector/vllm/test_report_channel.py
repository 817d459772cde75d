"""The worker -> scheduler report channel never blocks the worker. The scheduler drains its
inbox only between steps, while it waits for the workers; a Unix datagram queue holds ~10
datagrams, so a worker reporting more handoffs than that in one step blocked forever in
``sendto`` and the engine stopped (found by the disconnect storm of tests/reliability)."""

from __future__ import annotations

import threading
import uuid

from connector.metadata import ReportInbox, ReportOutbox, SendReport, report_address


def test_more_reports_than_the_inbox_holds_in_one_step_never_block_and_all_arrive_in_order():
    address = report_address(uuid.uuid4().hex)
    inbox, outbox = ReportInbox(address), ReportOutbox(address)
    try:
        reports = [SendReport(req_id=f"r{i}", rank=0, status="sent") for i in range(200)]
        sent = threading.Event()

        def one_step() -> None:  # what a worker does in one step: report every handoff
            for r in reports:
                outbox.send(r)
            sent.set()

        worker = threading.Thread(target=one_step, daemon=True)
        worker.start()
        assert sent.wait(5), "the worker blocked reporting (the scheduler drains only between steps)"
        assert outbox.backlog > 0  # the inbox could not take them all at once
        received: list[str] = []
        for _ in range(100):  # later steps: the scheduler drains, the worker flushes
            received += [r.req_id for r in inbox.drain()]
            outbox.flush()
            if not outbox.backlog:
                break
        received += [r.req_id for r in inbox.drain()]
        assert received == [r.req_id for r in reports]
    finally:
        inbox.close()
        outbox.close()
