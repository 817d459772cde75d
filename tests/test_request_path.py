"""bench/request_path.py: its counts on a made-up sequence of events, and one real traced
request through an in-process router (about 2 s)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pd_router
from bench.request_path import PACKAGE_DIR, Event, analyze, trace_requests


def _events() -> list[Event]:
    return [
        Event("call", "app.py", "App.__call__"),
        Event("call", "handler.py", "handle"),
        Event("call", "util/helpers.py", "parse"),
        Event("call", "util/helpers.py", "inner"),  # the same file: the same stay
        Event("return", "util/helpers.py", "parse"),
        Event("return", "handler.py", "handle"),  # back: a return to a stage file
        Event("call", "relay.py", "relay"),
        Event("return", "handler.py", "handle", await_hop=True),  # relay awaits: the chain unwinds
        Event("return", "app.py", "App.__call__", await_hop=True),
        Event("return", None, "", await_hop=True),  # out to the event loop
        Event("call", "util/helpers.py", "callback"),  # a callback in the request's context
        Event("return", None, ""),
        Event("call", "app.py", "App.__call__", await_hop=True),  # the task resumes
        Event("call", "handler.py", "handle", await_hop=True),
        Event("call", "relay.py", "relay", await_hop=True),
        Event("return", "handler.py", "handle"),
    ]


def test_counts_with_await_hops() -> None:
    report = analyze(_events(), ["app.py", "handler.py", "relay.py"])
    files = [s.file for s in report.stays]
    assert files == ["app.py", "handler.py", "util/helpers.py", "handler.py", "relay.py", "handler.py", "app.py",
                     "util/helpers.py", "app.py", "handler.py", "relay.py", "handler.py"]
    assert (report.counts.stays, report.counts.distinct_files, report.counts.returns) == (12, 4, 8)
    assert report.exits == 2
    assert report.entries == {"handler.py": 5, "app.py": 3, "util/helpers.py": 2, "relay.py": 2}
    assert report.stays[2].events == 3 and report.stays[2].function == "parse" and report.stays[2].via == "call"
    assert report.stays[3].via == "return" and report.stays[3].is_return
    st = report.stages
    assert st is not None
    assert (st.stage_returns, st.helper_returns) == (7, 1)
    assert st.first_entered == ["app.py", "handler.py", "relay.py"] and st.in_order and not st.never_entered
    # restricted to the stage files: app handler relay handler app handler relay handler
    assert (st.restricted.stays, st.restricted.distinct_files, st.restricted.returns) == (8, 3, 5)


def test_counts_without_await_hops_and_stage_order() -> None:
    report = analyze(_events(), ["relay.py", "handler.py", "missing.py"], await_hops=False)
    files = [s.file for s in report.stays]
    assert files == ["app.py", "handler.py", "util/helpers.py", "handler.py", "relay.py", "util/helpers.py",
                     "handler.py"]
    assert (report.counts.stays, report.counts.distinct_files, report.counts.returns) == (7, 4, 3)
    assert report.exits == 1
    st = report.stages
    assert st is not None
    assert not st.in_order and st.first_entered == ["handler.py", "relay.py"]
    assert st.never_entered == ["missing.py"] and "missing.py" in st.missing
    assert (st.stage_returns, st.helper_returns) == (2, 1)


def test_one_real_request() -> None:
    [traced] = trace_requests("chat", stream=True, tokens=2, warmup=1, repeat=1)
    assert traced.unfinished_tasks == 0 and traced.request_tasks >= 1 and traced.tally.get("tasks", 0) > 0
    with_hops, without = analyze(traced.events), analyze(traced.events, await_hops=False)
    assert all((PACKAGE_DIR / s.file).is_file() for s in with_hops.stays)
    # the request enters the router where its ASGI app is defined, wherever that module lives
    app_file = Path(inspect.getfile(pd_router.create_app)).resolve().relative_to(PACKAGE_DIR).as_posix()
    assert with_hops.stays[0].file == app_file and with_hops.stays[0].via == "call"
    assert with_hops.counts.distinct_files > 3
    assert 0 < without.counts.stays < with_hops.counts.stays
