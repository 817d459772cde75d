"""Request path: how one request's context moves between pd_router's source files.

Runs a router in-process (``pd_router.create_app`` served by the server ``python -m pd_router``
runs, in a thread of its own with its own uvloop loop) in front of the project's fake prefill
and decode servers (``tests/fakes/fake_backends.py``, each in a thread of its own), sends it
one request over loopback HTTP (a streamed chat completion by default) and records, with
``sys.setprofile`` in the router's thread only (Python 3.11: no ``sys.monitoring``), every
Python call and return of a code object whose file lies under the pd_router package
directory, while that request is served.

Only the request's own work is recorded. The tool's ASGI wrapper around the router's app sets
a context variable to the request's id in the task uvicorn runs the request in; every task
the request spawns (prefill/decode legs, watchers, cancels) and every callback it schedules
(``call_soon``/``call_later``, done callbacks, the protocol callbacks of the upstream
connections it opens) inherit that context, so an event counts when it runs in the request's
context. The router's background tasks (probes, load scrapes, discovery) were started before
any request, in contexts without the id, and are left out. One exception: a protocol
callback of a pooled upstream connection runs in the context of the request that opened
the connection (a warm-up's); such callbacks (no current task, an earlier request's id) count
too, since the warm-ups are over and nothing else is in flight (counted apart as
``pooled_callbacks``). Recording starts as the wrapper hands the request to the router and
ends once the response is read whole and every task seen in the request's context is done
(then a short grace for trailing callbacks).

From the events it derives the file the request's context is in (the innermost pd_router
frame's file after each call or return; a return to no pd_router frame, to the event loop
or a library, leaves pd_router and is no file: the next event's file follows the last
one), collapses repeats into *stays* and reports the stays (file relative to pd_router/,
the function entered, by a call or a return into it), the number of distinct files, the
*returns* (stays in a file the context had been in and left) and per file how many times it
was entered. The request's tasks interleave: their events are taken in the order they ran.
With ``--stages a.py,b.py,...`` (paths relative to pd_router/, in the order a request should
pass them) it also says which returns go back to a stage file and which to a helper file,
whether the stage files are first entered in the list's order, and the same counts on the
stays restricted to the stage files. Paths are relative to the package directory, so any
layout (subfolders too) works.

Two counts are given. *With await hops* (the listed one unless ``--no-await-hops``) every
call and return counts: a coroutine suspending at an ``await`` returns, frame by frame, up its
await chain to the event loop, and resuming calls back down it, so each suspension walks
the context through every file of the chain twice. *Without await hops* those suspensions
and resumptions (a YIELD_VALUE followed by an after-await RESUME) are left out: a suspended
request stays in the file it awaits in.

The path depends a little on timing (whether the prefill's answer or the decode's first
event comes first, how many tokens one read brings), so ``--repeat`` requests (default 5)
are traced one after the other on the same router; each one's counts are listed and the one
with the median number of stays is shown in full.

    .venv/bin/python -m bench.request_path [--stream/--no-stream] [--endpoint chat|completions]
        [--tokens N] [--warmup N] [--repeat N] [--stages a.py,b.py,...] [--no-await-hops] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import dis
import importlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

import pd_router  # noqa: E402

PACKAGE_DIR = Path(pd_router.__file__).resolve().parent
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
TRACED_ID = "request-path-traced"

# the id of the request whose context this is (set by the tool's ASGI wrapper in the request's task)
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_path_request", default=None)


class Event(NamedTuple):
    """One call or return: ``file`` is where the context is after it (relative to pd_router/,
    None: in no pd_router frame), ``function`` the qualified name of the frame it is in;
    ``await_hop``: a coroutine's suspension at an ``await`` (its return to the awaiting frame,
    up to the event loop) or its resumption there (the call back in)."""

    kind: str  # "call" | "return"
    file: str | None
    function: str
    await_hop: bool = False


@dataclass
class Stay:
    file: str
    function: str  # the function entered
    via: str  # "call": entered by calling it; "return": by a return into it
    events: int = 1
    is_return: bool = False  # the context had been in this file before and left it
    stage: bool | None = None  # with --stages: whether the file is a stage file


@dataclass
class Counts:
    stays: int
    distinct_files: int
    returns: int


@dataclass
class StageReport:
    stages: list[str]
    missing: list[str]  # stage files not under pd_router/
    never_entered: list[str]
    first_entered: list[str]  # the stage files in the order they were first entered
    in_order: bool  # first entered in the list's order (those entered)
    stage_returns: int
    helper_returns: int
    restricted: Counts  # stays, distinct files and returns of the stays in stage files only


@dataclass
class PathReport:
    counts: Counts
    exits: int  # times the context left pd_router (to the event loop or a library)
    stays: list[Stay]
    entries: dict[str, int]  # per file: how many stays
    stages: StageReport | None = None


def _counts(files: Sequence[str]) -> tuple[Counts, list[bool]]:
    """Counts of a sequence of files already collapsed; per item whether it is a return."""
    seen: set[str] = set()
    returns = []
    for f in files:
        returns.append(f in seen)
        seen.add(f)
    return Counts(len(files), len(seen), sum(returns)), returns


def _collapse(files: Sequence[str]) -> list[str]:
    return [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]


def analyze(events: Sequence[Event], stages: Sequence[str] | None = None, await_hops: bool = True) -> PathReport:
    """Stays, returns and entries of a sequence of events (see the module's docstring);
    ``await_hops=False``: a coroutine's suspensions and resumptions at an ``await`` do not
    move the context (a suspended request stays where it awaits; the next event it causes
    moves it)."""
    stays: list[Stay] = []
    exits, inside = 0, False
    for ev in events:
        if ev.await_hop and not await_hops:
            continue
        if ev.file is None:
            exits += inside
            inside = False
            continue
        inside = True
        if stays and stays[-1].file == ev.file:
            stays[-1].events += 1
        else:
            stays.append(Stay(ev.file, ev.function, ev.kind))
    counts, returns = _counts([s.file for s in stays])
    for stay, is_return in zip(stays, returns, strict=True):
        stay.is_return = is_return
    entries = dict(Counter(s.file for s in stays).most_common())
    report = PathReport(counts, exits, stays, entries)
    if stages is not None:
        report.stages = _stage_report(stays, [_norm(s) for s in stages])
    return report


def _norm(path: str) -> str:
    return Path(path.strip()).as_posix().removeprefix("./").removeprefix("pd_router/")


def _stage_report(stays: list[Stay], stages: list[str]) -> StageReport:
    wanted = set(stages)
    for stay in stays:
        stay.stage = stay.file in wanted
    first = [f for f in dict.fromkeys(s.file for s in stays) if f in wanted]
    restricted, _ = _counts(_collapse([s.file for s in stays if s.file in wanted]))
    return StageReport(
        stages=stages,
        missing=[s for s in stages if not (PACKAGE_DIR / s).is_file()],
        never_entered=[s for s in stages if s not in first],
        first_entered=first,
        in_order=first == [s for s in stages if s in first],
        stage_returns=sum(s.is_return and bool(s.stage) for s in stays),
        helper_returns=sum(s.is_return and not s.stage for s in stays),
        restricted=restricted,
    )


class _Code(NamedTuple):
    file: str | None  # relative to the package directory; None: not pd_router's
    await_yields: frozenset[int]  # offsets of the YIELD_VALUE of an ``await`` (a suspension)
    await_resumes: frozenset[int]  # offsets of the RESUME after one (the resumption)


def _await_offsets(code: CodeType) -> tuple[frozenset[int], frozenset[int]]:
    """The offsets where a coroutine suspends at an ``await`` (``async for``, ``async with``) and
    where it resumes: a YIELD_VALUE followed by RESUME with "after await" (3) in its low bits;
    not the ``yield`` of a generator or an async generator (a value handed to its consumer)."""
    ops = list(dis.get_instructions(code))
    yields, resumes = set(), set()
    for op, nxt in zip(ops, ops[1:], strict=False):
        if op.opname == "YIELD_VALUE" and nxt.opname == "RESUME" and (nxt.arg or 0) & 3 == 3:
            yields.add(op.offset)
            resumes.add(nxt.offset)
    return frozenset(yields), frozenset(resumes)


class Recorder:
    """The profile function of the router's thread: keeps the calls and returns of pd_router
    code run in the traced request's context (see the module's docstring)."""

    def __init__(self, package_dir: Path, traced_id: str) -> None:
        self.root = str(package_dir) + os.sep
        self.traced_id = traced_id
        self.events: list[Event] = []
        self.tasks: set[asyncio.Task[Any]] = set()  # the tasks seen running in the request's context
        self.tally: Counter[str] = Counter()  # events by where they ran (or "excluded")
        self._codes: dict[CodeType, _Code] = {}

    def code(self, code: CodeType) -> _Code:
        known = self._codes.get(code)
        if known is None:
            real = os.path.realpath(code.co_filename)
            if real.startswith(self.root):
                known = _Code(real[len(self.root):].replace(os.sep, "/"), *_await_offsets(code))
            else:
                known = _Code(None, frozenset(), frozenset())
            self._codes[code] = known
        return known

    def hook(self, frame: FrameType, event: str, _arg: object) -> None:
        if event != "call" and event != "return":
            return  # c_call, c_return, c_exception: the innermost Python frame stays
        code = self.code(frame.f_code)
        if code.file is None:
            return
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running loop (the router's thread ending): a profile function must not raise
            task = None
        owner = REQUEST_ID.get()
        if owner == self.traced_id:
            where = "callbacks" if task is None else "tasks"
            if task is not None:
                self.tasks.add(task)
        elif owner is not None and task is None:
            where = "pooled_callbacks"  # an upstream connection an earlier request opened, now the traced one's
        else:
            self.tally["excluded"] += 1
            return
        self.tally[where] += 1
        if event == "call":
            self.events.append(Event("call", code.file, frame.f_code.co_qualname,
                                     frame.f_lasti in code.await_resumes))
            return
        hop = frame.f_lasti in code.await_yields
        back = frame.f_back
        while back is not None:
            into = self.code(back.f_code).file
            if into is not None:
                self.events.append(Event("return", into, back.f_code.co_qualname, hop))
                return
            back = back.f_back
        self.events.append(Event("return", None, "", hop))

    async def settle(self, timeout: float = 5.0, grace: float = 0.05) -> int:
        """In the router's loop, after the response was read: wait for the request's tasks, then
        stop recording. Returns how many were still running at ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pending: list[asyncio.Task[Any]] = []
        while loop.time() < deadline:
            pending = [t for t in self.tasks if not t.done()]
            if pending:
                await asyncio.wait(pending, timeout=deadline - loop.time())
                continue
            await asyncio.sleep(grace)  # trailing callbacks; a task they start shows up here
            pending = [t for t in self.tasks if not t.done()]
            if not pending:
                break
        sys.setprofile(None)
        return len(pending)


class TracedApp:
    """ASGI wrapper: tags each HTTP request's task with its ``X-Request-Id`` (a context
    variable its spawned tasks and callbacks inherit) and, as a traced request comes in,
    starts its recorder in the router's thread."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        self.recorders: dict[str, Recorder] = {}  # traced request id -> its recorder
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "http":
            rid = next((v.decode() for k, v in scope["headers"] if k == b"x-request-id"), "")
            REQUEST_ID.set(rid or f"untagged-{id(scope)}")
            recorder = self.recorders.get(rid)
            if recorder is not None:
                self.loop = asyncio.get_running_loop()
                sys.setprofile(recorder.hook)
        await self.app(scope, receive, send)


def request_body(endpoint: str, stream: bool, tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "system", "content": "Answer briefly."},
                            {"role": "user", "content": "What does a router do?"}]
    else:
        body["prompt"] = "A router"
    return body


def send(client: httpx.Client, url: str, body: dict[str, Any], rid: str) -> int:
    """POST ``body``, read the answer whole; its size in bytes."""
    size = 0
    with client.stream("POST", url, json=body, headers={"X-Request-Id": rid}) as resp:
        for chunk in resp.iter_raw():
            size += len(chunk)
        if resp.status_code != 200:
            raise RuntimeError(f"{rid}: {resp.status_code} {resp.read()[:500]!r}")
    return size


def _router_server(app: Any, settings: Any) -> Any:
    """The server ``python -m pd_router`` runs (found through that entry point, whatever module
    defines it); a plain uvicorn one (uvloop, httptools) if the entry point has none."""
    import uvicorn

    make = getattr(importlib.import_module("pd_router.__main__"), "router_server", None)
    if make is not None:
        return make(app, settings)
    return uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, loop="uvloop",
                                         http="httptools", log_level="warning", access_log=False, lifespan="on"))


@contextmanager
def router_rig(token_delay: float) -> Iterator[tuple[str, TracedApp]]:
    """A fake prefill and a fake decode server and a router in front of them, each served in
    a thread of its own on loopback (as tests/router/conftest.py does); yields the router's URL
    and its traced app."""
    from tests.fakes.fake_backends import FakeDecode, FakePrefill, ServerThread
    from tests.procs import free_port

    prefill = ServerThread(FakePrefill(model="tiny"), free_port()).start()
    decode = ServerThread(FakeDecode(model="tiny", token_delay=token_delay), free_port()).start()
    router = None
    try:
        port = free_port()
        settings = pd_router.load_settings(
            ["--prefill", prefill.url, "--decode", decode.url, "--port", str(port), "--log-level", "warning"],
            env={},
        )
        app = pd_router.create_app(settings)
        traced = TracedApp(app)
        server = _router_server(app, settings)
        server.config.app = traced  # what uvicorn serves: the router's app behind the wrapper
        router = ServerThread(traced, port, server=server).start()
        deadline = time.monotonic() + 20
        while httpx.get(router.url + "/ready", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not get ready in 20 s")
            time.sleep(0.05)
        yield router.url, traced
    finally:
        servers = [s for s in (router, prefill, decode) if s is not None]
        for s in servers:
            s.server.should_exit = True
        for s in servers:
            s.stop()


@dataclass
class Traced:
    """One traced request: its events and how they were recorded."""

    events: list[Event]
    tally: dict[str, int]  # events by where they ran: tasks, callbacks, pooled_callbacks; excluded
    request_tasks: int
    unfinished_tasks: int
    response_bytes: int
    seconds: float


def trace_requests(endpoint: str = "chat", stream: bool = True, tokens: int = 4, warmup: int = 1,
                   repeat: int = 1, token_delay: float = 0.002) -> list[Traced]:
    """Serve ``warmup`` requests, then trace ``repeat`` more, one after the other."""
    url_path, body = ENDPOINTS[endpoint], request_body(endpoint, stream, tokens)
    out = []
    with router_rig(token_delay) as (url, app), httpx.Client(timeout=30) as client:
        for i in range(warmup):
            send(client, url + url_path, body, f"request-path-warmup-{i}")
        for i in range(repeat):
            time.sleep(0.2)  # the earlier requests' trailing work is over
            recorder = app.recorders[f"{TRACED_ID}-{i}"] = Recorder(PACKAGE_DIR, f"{TRACED_ID}-{i}")
            t0 = time.perf_counter()
            try:
                size = send(client, url + url_path, body, recorder.traced_id)
            finally:  # the recorder stops in the router's thread, also when the request failed
                if app.loop is not None:
                    unfinished = asyncio.run_coroutine_threadsafe(recorder.settle(), app.loop).result(timeout=30)
            if not recorder.events:
                raise RuntimeError("nothing recorded: the traced request did not reach the router's app")
            out.append(Traced(recorder.events, dict(recorder.tally), len(recorder.tasks), unfinished, size,
                              round(time.perf_counter() - t0, 3)))
    return out


MODES = {"with_await_hops": True, "without_await_hops": False}


def _summary(report: PathReport) -> list[str]:
    c = report.counts
    lines = [f"stays {c.stays}, distinct files {c.distinct_files}, returns {c.returns}, "
             f"exits from pd_router {report.exits}"]
    st = report.stages
    if st is not None:
        r = st.restricted
        lines.append(f"  stage files ({', '.join(st.stages)}): stage returns {st.stage_returns}, helper returns "
                     f"{st.helper_returns}; first entered in the list's order: {'yes' if st.in_order else 'no'} "
                     f"({' > '.join(st.first_entered) or 'none'}); restricted to them: stays {r.stays}, "
                     f"distinct files {r.distinct_files}, returns {r.returns}")
        if st.never_entered:
            lines.append(f"  never entered: {', '.join(st.never_entered)}")
        if st.missing:
            lines.append(f"  not under pd_router/: {', '.join(st.missing)}")
    return lines


def render(run: dict[str, Any], traced: list[Traced], reports: list[dict[str, PathReport]], chosen: int,
           listed: str) -> str:
    """The run, each traced request's counts, and the summaries and stays of the ``chosen`` one."""
    lines = [f"{'streamed' if run['stream'] else 'unstreamed'} POST {run['path']} (max_tokens {run['max_tokens']}, "
             f"{run['warmup']} warm-up(s), {len(traced)} traced) through pd_router at {run['package_dir']}"]
    for i, (t, r) in enumerate(zip(traced, reports, strict=True)):
        counts = "; ".join(f"{mode.replace('_', ' ')}: stays {rep.counts.stays}, distinct files "
                           f"{rep.counts.distinct_files}, returns {rep.counts.returns}" for mode, rep in r.items())
        lines.append(f"  request {i}{' (the median, shown below)' if i == chosen and len(traced) > 1 else ''}: "
                     f"{counts}; events " + ", ".join(f"{k} {v}" for k, v in sorted(t.tally.items()))
                     + f"; {t.request_tasks} task(s)"
                     + (f", {t.unfinished_tasks} still running when recording stopped" if t.unfinished_tasks else ""))
    for mode, report in reports[chosen].items():
        lines.append(f"{mode.replace('_', ' ')}: " + "\n".join(_summary(report)))
    report = reports[chosen][listed]
    st = report.stages
    width = max((len(s.file) for s in report.stays), default=4)
    lines += ["", f"stays ({listed.replace('_', ' ')}):",
              f"{'#':>4}  {'file':<{width}}  {'events':>6}  {'':<8}  entered"]
    for i, s in enumerate(report.stays, 1):
        mark = ("return" if s.is_return else "") + ("" if s.stage is None else (" S" if s.stage else " h"))
        arrow = "-> " if s.via == "call" else "<- "
        lines.append(f"{i:>4}  {s.file:<{width}}  {s.events:>6}  {mark:<8}  {arrow}{s.function}")
    lines += ["", "entries per file:"]
    lines += [f"  {n:>4}  {f}" for f, n in report.entries.items()]
    lines.append("(-> entered by a call, <- by a return into the function"
                 + ("; S: a stage file, h: a helper file)" if st is not None else ")"))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat")
    parser.add_argument("--tokens", type=int, default=4, help="the request's max_tokens (the fake decodes that many)")
    parser.add_argument("--warmup", type=int, default=1, help="requests served before the traced ones")
    parser.add_argument("--repeat", type=int, default=5,
                        help="requests traced one after the other (timing changes the path a little: the one "
                             "with the median number of stays is shown)")
    parser.add_argument("--token-delay", type=float, default=0.002, help="seconds between the fake's tokens")
    parser.add_argument("--stages", help="comma-separated files relative to pd_router/, in the order expected")
    parser.add_argument("--await-hops", action=argparse.BooleanOptionalAction, default=True,
                        help="list the stays counting a coroutine's suspension and resumption at an await as "
                             "moves (every call and return: the default), or not (both are summed up)")
    parser.add_argument("--json", action="store_true", help="print the run and the reports as JSON")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.warmup < 0 or args.tokens < 1:
        parser.error("--repeat and --tokens must be at least 1, --warmup at least 0")
    stages = [s for s in args.stages.split(",") if s.strip()] if args.stages else None
    traced = trace_requests(args.endpoint, args.stream, args.tokens, args.warmup, args.repeat, args.token_delay)
    reports = [{mode: analyze(t.events, stages, hops) for mode, hops in MODES.items()} for t in traced]
    listed = "with_await_hops" if args.await_hops else "without_await_hops"
    by_stays = sorted(range(len(traced)), key=lambda i: reports[i][listed].counts.stays)
    chosen = by_stays[(len(by_stays) - 1) // 2]
    run = {"endpoint": args.endpoint, "path": ENDPOINTS[args.endpoint], "stream": args.stream,
           "max_tokens": args.tokens, "warmup": args.warmup, "repeat": args.repeat,
           "token_delay_s": args.token_delay, "package_dir": str(PACKAGE_DIR), "python": sys.version.split()[0]}
    if args.json:
        print(json.dumps({
            "run": run,
            "requests": [{"events": t.tally, "request_tasks": t.request_tasks, "unfinished_tasks": t.unfinished_tasks,
                          "response_bytes": t.response_bytes, "seconds": t.seconds,
                          **{mode: asdict(rep.counts) for mode, rep in r.items()}}
                         for t, r in zip(traced, reports, strict=True)],
            "median_request": chosen,
            **{mode: asdict(rep) for mode, rep in reports[chosen].items()},
        }, indent=1))
    else:
        print(render(run, traced, reports, chosen, listed))


if __name__ == "__main__":
    main()
