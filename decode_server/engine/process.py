"""The decode engine in a process of its own: :class:`ProcessEngine` is an
:class:`~decode_server.engine.base.Engine` whose sessions run in a child process
(:data:`CHILD`), so that the server's event loop and the engine
never wait for one interpreter lock (vLLM V1 splits its EngineCore off for the same reason).

The child steps each sequence back to back: it sends a step's tokens and starts the next step
at once, up to :data:`RUN_AHEAD` steps ahead of the server's reading, and stops stepping on
its own at the sequence's ``max_tokens``. The server's worker thread reads the tokens as
``session.step()`` returns them and applies the stop conditions as before; when it stops (an
end-of-sequence token, a stop string), ``session.close()`` ends the child's stepping, whose
last step is lost (its tokens would have been cut anyway). So the engine keeps its own pace
whatever the server's threads are doing; the server's work is late at most, never between
two steps.

Messages between the two processes are pickled Python objects on a socket pair
(:class:`multiprocessing.connection.Connection`): not a wire format (both ends are one program
at one version, and a pickle carries tensors and CUDA IPC handles as they are, at a few
microseconds a step). The prompt's KV goes with a session's start:
host tensors copied out of the receive buffer, GPU tensors as CUDA IPC handles to the receive
buffer (``torch.multiprocessing``), which the server gives back once the child's
``engine.start`` copied them, as with an engine in-process. Structured output is compiled in
the child (:class:`GrammarRequests` stands for the compiler on the server's side). The child
exits when the server closes its end (the server stopped or died).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

from connector.layout import KVLayout
from connector.receiver_state import ReceivedKV
from decode_server.engine.base import (
    Cancelled,
    DecodeSession,
    Engine,
    EngineCapabilities,
    EngineError,
    SamplingParams,
    SpecStats,
    TokenOut,
)
from decode_server.engine.grammar import ThinkingBudgetSpec
from pd_grammar.spec import GrammarSpec, JsonWhitespace
from pd_wire.handoff import HandoffResult

log = logging.getLogger(__name__)

# the child's program (not ``-m`` this module: its messages would be ``__main__``'s classes there)
CHILD = "import sys; from decode_server.engine.process import child_main; child_main(int(sys.argv[1]))"
RUN_AHEAD = 16  # steps the child may run ahead of the server's reading (the server says every RUN_AHEAD/2)
LOAD_TIMEOUT_S = 600.0  # the child's engine load (TileRT loads GLM-5.1's weights)
EXIT_WAIT_S = 10.0  # at shutdown: the child's exit, then it is killed


# ---- the messages ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Boot:
    """The child's first message: how to build its engine and log."""

    build: Callable[[], Engine]  # picklable: a module-level callable or a dataclass instance
    log_level: str
    log_format: str
    grammar: tuple[Path, JsonWhitespace] | None  # (model dir, JSON whitespace): structured output's compiler


@dataclass(frozen=True)
class Ready:
    capabilities: EngineCapabilities
    kv_layout: KVLayout


@dataclass(frozen=True)
class LoadFailed:
    error: str


@dataclass(frozen=True)
class Start:
    sid: int
    handoff: HandoffResult
    params: SamplingParams
    kv: bytes  # the pickled ReceivedKV (see _dump_kv)


@dataclass(frozen=True)
class Cancel:
    sid: int


@dataclass(frozen=True)
class Close:
    sid: int


@dataclass(frozen=True)
class Took:
    """The server has read this many steps of the session."""

    sid: int
    steps: int


@dataclass(frozen=True)
class Shutdown:
    """The server stops: end every session, shut the engine down, exit."""


@dataclass(frozen=True)
class Started:
    sid: int
    first_token: TokenOut | None


@dataclass(frozen=True)
class Stepped:
    sid: int
    tokens: list[TokenOut]
    stats: SpecStats


@dataclass(frozen=True)
class Failed:
    """The session's start or a step failed (``cancelled``: it was cancelled)."""

    sid: int
    error: str
    cancelled: bool = False


@dataclass(frozen=True)
class Ended:
    """The child stepped the session to its ``max_tokens`` and steps no more."""

    sid: int


@dataclass(frozen=True)
class GrammarRequest:
    """A request's grammar on its way to the child, which compiles it (the matcher the engine
    masks with lives where the engine runs)."""

    spec: GrammarSpec | None
    stop_token_ids: tuple[int, ...]
    budget: ThinkingBudgetSpec | None = None


class GrammarRequests:
    """The server's grammar compiler when the engine runs in the child: its "matchers" are the
    requests the child compiles."""

    def matcher(self, spec: GrammarSpec | None, stop_token_ids: Iterable[int],
                budget: ThinkingBudgetSpec | None = None) -> GrammarRequest:
        return GrammarRequest(spec, tuple(sorted(set(stop_token_ids))), budget)


_LOST = object()  # the child is gone
_CANCELLED = object()  # the server cancelled the session


def _dump_kv(kv: ReceivedKV) -> bytes:
    """The KV for the child: GPU tensors as CUDA IPC handles (the receive buffer stays where it
    is); host tensors copied out of the receive buffer (pickling a view would carry its whole
    buffer, and sharing it would move it out of the memory the transport registered)."""
    layers = kv.layers
    if not any(t.is_cuda for layer in layers for t in layer.values()):
        layers = [{name: t.clone() for name, t in layer.items()} for layer in layers]
        return pickle.dumps(replace(kv, layers=layers), protocol=pickle.HIGHEST_PROTOCOL)
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the CUDA IPC reductions

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(kv)
    return buf.getvalue()


class _Sender:
    """One end's sending half: ``send`` queues a message for the writer thread (the caller
    never blocks on the socket: a session's next step runs while its tokens are pickled and
    sent), ``send_now`` sends from the calling thread (one thread hop less), in order with
    what the writer sent before it."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._writer = threading.Thread(target=self._write, name="engine-process-writer", daemon=True)
        self._writer.start()

    def send(self, message: Any) -> None:
        self._outbox.put(message)

    def send_now(self, message: Any) -> None:
        """Raises OSError when the other end is gone."""
        with self._lock:
            self._conn.send(message)

    def close(self, timeout: float | None = None) -> None:
        """Stop the writer once it sent what was queued before."""
        self._outbox.put(None)
        self._writer.join(timeout)

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.send_now(message)
            except OSError:  # the other end is gone: its reader says so
                return


# ---- the server's side ------------------------------------------------------------------------------
class ProcessSession(DecodeSession):
    def __init__(self, engine: ProcessEngine, sid: int, inbox: queue.SimpleQueue) -> None:
        super().__init__()
        self._engine = engine
        self._sid = sid
        self._inbox = inbox
        self._read = 0
        self._closed = False

    def step(self) -> list[TokenOut]:
        if self._cancel.is_set():
            raise Cancelled("the sequence was cancelled")
        item = self._inbox.get()
        if isinstance(item, Stepped):
            self._stats = item.stats
            self._read += 1
            if self._read % (RUN_AHEAD // 2) == 0:
                self._engine.send(Took(self._sid, self._read))
            return item.tokens
        if isinstance(item, Failed):
            raise Cancelled(item.error) if item.cancelled else EngineError(item.error)
        if item is _CANCELLED or self._cancel.is_set():
            raise Cancelled("the sequence was cancelled")
        if isinstance(item, Ended):
            raise EngineError("the engine process ended the sequence at its max_tokens")
        raise EngineError(self._engine.failure() or "the engine process is gone")

    def cancel(self) -> None:
        super().cancel()
        self._inbox.put(_CANCELLED)
        if not self._closed:
            self._engine.send(Cancel(self._sid))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.send(Close(self._sid))
            self._engine.forget(self._sid)



class ProcessEngine(Engine):
    """The engine ``build()`` makes, run in a child process; ``grammar`` (model dir, JSON
    whitespace) lets the child compile structured output. Loads the child's engine before it
    returns (raises :class:`EngineError` if that fails)."""

    def __init__(self, build: Callable[[], Engine], grammar: tuple[Path, JsonWhitespace] | None = None,
                 log_level: str = "info", log_format: str = "text") -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])  # this checkout's packages, wherever the child starts
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen([sys.executable, "-c", CHILD, str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()
        self._sessions: dict[int, queue.SimpleQueue] = {}
        self._next_sid = 0
        self._lost: str | None = None
        try:
            self._conn.send(Boot(build, log_level, log_format, grammar))
            if not self._conn.poll(LOAD_TIMEOUT_S):
                raise EngineError(f"the engine process did not load its engine within {LOAD_TIMEOUT_S:g} s")
            ready = self._conn.recv()
        except (OSError, EOFError) as exc:
            self._stop_child()
            raise EngineError(f"the engine process exited while loading (code {self._proc.poll()}): {exc}") from exc
        except BaseException:
            self._stop_child()
            raise
        if isinstance(ready, LoadFailed):
            self._stop_child()
            raise EngineError(f"the engine process could not load its engine: {ready.error}")
        self._ready: Ready = ready
        self._sender = _Sender(self._conn)
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()
        log.info("engine %s runs in its own process (pid %d)", ready.capabilities.engine, self._proc.pid)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def capabilities(self) -> EngineCapabilities:
        """The child's engine's, but keeping no KV across sessions: the child steps ahead of
        what the server takes, so the server cannot tell which rows a session left valid."""
        return replace(self._ready.capabilities, keeps_kv=False)

    @property
    def kv_layout(self) -> KVLayout:
        return self._ready.kv_layout

    def failure(self) -> str | None:
        return self._lost

    def send(self, message: Any) -> None:
        """Queue ``message`` for the child (any thread; never blocks)."""
        self._sender.send(message)

    def forget(self, sid: int) -> None:
        with self._lock:
            self._sessions.pop(sid, None)

    def start(self, kv: ReceivedKV, handoff: HandoffResult, params: SamplingParams) -> ProcessSession:
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            if self._lost is not None:
                raise EngineError(self._lost)
            sid = self._next_sid
            self._next_sid += 1
            self._sessions[sid] = inbox
        session = ProcessSession(self, sid, inbox)
        try:
            self._sender.send_now(Start(sid, handoff, params, _dump_kv(kv)))
            first = inbox.get()  # the child's engine.start copied the KV (or failed)
        except OSError as exc:  # the child is gone
            session.close()
            raise EngineError(self._lost or f"the engine process is gone: {exc}") from exc
        except BaseException:
            session.close()
            raise
        if isinstance(first, Started):
            session.first_token = first.first_token
            return session
        session.close()
        if isinstance(first, Failed):
            raise Cancelled(first.error) if first.cancelled else EngineError(first.error)
        raise EngineError(self._lost or "the engine process is gone")

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (OSError, EOFError):
                break
            with self._lock:
                inbox = self._sessions.get(message.sid)
            if inbox is not None:  # none: a session the server closed (its last steps are dropped)
                inbox.put(message)
        code = self._proc.wait()
        with self._lock:
            if self._lost is None:
                self._lost = f"the engine process exited (code {code})"
                log.error("%s", self._lost)
            inboxes = list(self._sessions.values())
        for inbox in inboxes:
            inbox.put(_LOST)

    def shutdown(self) -> None:
        with self._lock:
            if self._lost is None:
                self._lost = "the engine process was shut down"
        self._sender.send(Shutdown())
        self._sender.close(EXIT_WAIT_S)
        self._stop_child(close_first=False)
        self._reader.join(EXIT_WAIT_S)  # it saw the child's end
        self._conn.close()

    def _stop_child(self, close_first: bool = True) -> None:
        """Wait for the child's exit (``close_first``: after closing our end, which ends it)."""
        if close_first:
            self._conn.close()
        try:
            self._proc.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not exit within %g s: killed", EXIT_WAIT_S)
            self._proc.kill()
            self._proc.wait()


# ---- the child's side -------------------------------------------------------------------------------
class _Running:
    """One session in the child: started, then stepped back to back on one of the host's
    session threads."""

    def __init__(self, host: _Host, start: Start) -> None:
        self.host = host
        self.sid = start.sid
        self._start = start
        self._cond = threading.Condition()
        self._took = 0
        self._stop = False
        self._session: DecodeSession | None = None
        self.done = threading.Event()  # its session closed (or never started)

    def took(self, steps: int) -> None:
        with self._cond:
            self._took = max(self._took, steps)
            self._cond.notify()

    def stop(self) -> None:
        """Cancel (the server closed it or cancelled it): no more steps."""
        with self._cond:
            self._stop = True
            session = self._session
            self._cond.notify()
        if session is not None:
            session.cancel()

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.done.set()

    def _run(self) -> None:
        start, send = self._start, self.host.sender.send
        session: DecodeSession | None = None
        try:
            kv: ReceivedKV = pickle.loads(start.kv)
            params = self.host.with_matcher(start.params)
            session = self.host.engine.start(kv, start.handoff, params)
            del kv
            with self._cond:
                self._session = session
                stopped = self._stop
            if stopped:
                session.cancel()
            try:
                self.host.sender.send_now(Started(self.sid, session.first_token))
            except OSError:  # the server is gone: the command loop ends on its own
                return
            produced, stepped = 1, 0
            while produced < params.max_tokens:
                with self._cond:
                    while not self._stop and stepped - self._took >= RUN_AHEAD:
                        self._cond.wait()
                    if self._stop:
                        return
                tokens = session.step()
                stepped += 1
                produced += len(tokens)
                send(Stepped(self.sid, tokens, replace(session.stats)))
            send(Ended(self.sid))
        except Cancelled as exc:
            send(Failed(self.sid, str(exc) or "cancelled", cancelled=True))
        except EngineError as exc:
            send(Failed(self.sid, str(exc)))
        except Exception as exc:  # the server reports it as an engine failure
            log.exception("engine session %d failed", self.sid)
            send(Failed(self.sid, f"{type(exc).__name__}: {exc}"))
        finally:
            if session is not None:
                try:
                    session.close()
                except Exception:
                    log.exception("engine session %d: close failed", self.sid)


class _Host:
    """The child's engine and sessions, driven by the server's messages on ``conn``."""

    def __init__(self, engine: Engine, conn: Connection, grammar: tuple[Path, JsonWhitespace] | None) -> None:
        self.engine = engine
        self._conn = conn
        self.sender = _Sender(conn)  # its writer pickles and sends a step's tokens while the next step runs
        self._grammar = grammar
        self._compiler: Any = None
        self._running: dict[int, _Running] = {}
        self._starts: queue.SimpleQueue[_Running | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"engine-session-{i}", daemon=True)
                         for i in range(engine.capabilities.slots)]  # waiting, so that a start needs no new thread
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while (running := self._starts.get()) is not None:
            running.run()

    def with_matcher(self, params: SamplingParams) -> SamplingParams:
        request = params.grammar
        if not isinstance(request, GrammarRequest):
            return params
        if self._compiler is None:
            if self._grammar is None:
                raise EngineError("structured output requested from an engine process without a grammar compiler")
            from decode_server.engine.structured import GrammarCompiler

            self._compiler = GrammarCompiler(*self._grammar)
        return replace(params, grammar=self._compiler.matcher(request.spec, request.stop_token_ids, request.budget))

    def serve(self) -> None:
        """Until the server closes its end: start, cancel, close sessions (in the order sent: a
        session's close has ended its steps before the next start is taken)."""
        while True:
            try:
                message = self._conn.recv()
            except (OSError, EOFError):
                break
            if isinstance(message, Start):
                self._running[message.sid] = _Running(self, message)
                self._starts.put(self._running[message.sid])
                continue
            if isinstance(message, Shutdown):
                break
            found = self._running.get(message.sid)
            if found is None:  # a session that ended already
                continue
            if isinstance(message, Took):
                found.took(message.steps)
            elif isinstance(message, Cancel):
                found.stop()
            elif isinstance(message, Close):
                del self._running[message.sid]
                found.stop()
                found.done.wait()
        for running in self._running.values():
            running.stop()
        for running in self._running.values():
            running.done.wait(EXIT_WAIT_S)
        for _ in self._threads:
            self._starts.put(None)
        self.sender.close(EXIT_WAIT_S)
        self.engine.shutdown()


def child_main(fd: int) -> NoReturn:
    """The child's life: its engine served until the server closes its end, then its exit
    (without the interpreter's finalisation: the engine's native threads may still run)."""
    code = _child(fd)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _child(fd: int) -> int:
    conn = Connection(fd)
    boot: Boot = conn.recv()
    from pd_http.logs import configure_logging

    configure_logging(boot.log_level, boot.log_format)  # type: ignore[arg-type]
    try:
        engine = boot.build()
    except Exception as exc:
        log.exception("the engine process could not load its engine")
        conn.send(LoadFailed(f"{type(exc).__name__}: {exc}"))
        return 1
    conn.send(Ready(engine.capabilities, engine.kv_layout))
    _Host(engine, conn, boot.grammar).serve()
    return 0

