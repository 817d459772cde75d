"""The streamed answer's chunks go to the client through the connection's chunk writer
(:mod:`pd_http.chunk_writer`), in the framing uvicorn uses, and only when uvicorn would
write them at once."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from pd_http.chunk_writer import ChunkWriter
from pd_router.metrics import TokenHistogram
from pd_router.request.relay import Tally as _Tally
from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)


class _Transport:
    def __init__(self, closing: bool = False) -> None:
        self.closing, self.written = closing, []

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        self.written.append(data)


def _cycle(**state) -> SimpleNamespace:
    values = {"response_started": True, "response_complete": False, "disconnected": False,
              "chunked_encoding": True, "flow": SimpleNamespace(write_paused=False), "transport": _Transport()}
    return SimpleNamespace(**{**values, **state})


@pytest.mark.parametrize("state", [
    {"response_started": False},  # the start (status line, headers) is send's
    {"response_complete": True},
    {"disconnected": True},
    {"chunked_encoding": False},  # a Content-Length answer
    {"chunked_encoding": None},
    {"flow": SimpleNamespace(write_paused=True)},  # the client pushes back: send waits for the drain
    {"transport": _Transport(closing=True)},
])
def test_the_writer_declines_what_send_must_write(state):
    cycle = _cycle(**state)
    assert not ChunkWriter(cycle).writable()
    assert ChunkWriter(cycle).write(b"data: x\n\n") is False
    assert cycle.transport.written == []


@pytest.mark.parametrize("missing", ["response_started", "response_complete", "disconnected",
                                     "chunked_encoding", "flow", "transport", "flow.write_paused"])
def test_a_cycle_without_the_state_the_writer_reads_gets_no_writer(missing):
    """A uvicorn whose request/response cycle renamed what the writer reads: no writer, so
    the relay sends every chunk through ``send`` instead of failing in a callback."""
    cycle = _cycle()
    assert isinstance(ChunkWriter.of(cycle), ChunkWriter)
    owner, _, name = missing.rpartition(".")
    delattr(cycle.flow if owner else cycle, name)
    assert ChunkWriter.of(cycle) is None


def test_the_writer_frames_a_chunk_as_uvicorn_does():
    cycle = _cycle()
    writer = ChunkWriter(cycle)
    assert writer.write(b"data: hello\n\n") is True
    assert writer.write(b"") is False  # an empty chunk would end the body
    assert cycle.transport.written == [b"d\r\ndata: hello\n\n\r\n"]


def test_the_chunks_of_one_upstream_read_leave_as_one_write():
    """The relay's sink: what one read of the decode server's socket gave (several tokens'
    events when the router fell behind) is one write to the client, in order; nothing is
    taken while the client's connection cannot be written to."""
    itl = TokenHistogram("t", "t", (0.001,), CollectorRegistry())
    cycle = _cycle()
    tally = _Tally(itl, ChunkWriter(cycle))
    assert tally.take(b"data: 1\n\n") and tally.take(b"data: 2\n\n")
    assert cycle.transport.written == []  # not before the read is over
    tally.flush()
    assert cycle.transport.written == [b"12\r\ndata: 1\n\ndata: 2\n\n\r\n"]
    assert tally.chunks == 2 and tally.last == b"data: 2\n\n"
    tally.flush()  # nothing pending: nothing written
    assert len(cycle.transport.written) == 1
    cycle.flow.write_paused = True
    assert not tally.take(b"data: 3\n\n")  # the reader gets it, and send waits for the drain
    assert tally.chunks == 2


def test_nothing_overtakes_a_chunk_the_relay_is_sending():
    """The client drained (writable again) but the relay task has not yet been resumed to
    write the chunk it gave ``send``: a chunk arriving now must wait behind it."""
    cycle = _cycle()
    tally = _Tally(TokenHistogram("t", "t", (0.001,), CollectorRegistry()), ChunkWriter(cycle))
    tally.sending = True
    assert not tally.take(b"data: 4\n\n")
    tally.sending = False
    assert tally.take(b"data: 5\n\n")


def _in_lockstep(rig) -> threading.Semaphore:
    """The rig's decode server sends a token only with a permit (one to start with): the
    test releases one each time the router has written a token."""
    permits = threading.Semaphore(1)

    async def gate(_: int) -> None:
        assert await asyncio.to_thread(permits.acquire, timeout=30), "the router stopped writing"

    rig.decodes[0].app.token_gate = gate
    return permits


def _routers(rig):
    """Whether a transport is the router's side of a client connection (not a fake's)."""
    port = int(rig.url.rsplit(":", 1)[1])
    return lambda transport: transport.get_extra_info("sockname")[1] == port


def test_a_streamed_answer_reaches_the_client_through_the_chunk_writer(make_rig, monkeypatch):
    """Every chunk after the first is written by the writer (none was before it existed),
    the answer is whole and in order, and the connection serves the next request. The
    decode server streams in lockstep with the router (token i+1 leaves once the router
    wrote token i), so that no chunk arrives while the first is still in ``send``: which
    chunks the writer takes does not depend on the machine's speed."""
    rig = make_rig()
    permits, routers = _in_lockstep(rig), _routers(rig)
    written: list[bytes] = []
    original, send = ChunkWriter.write, RequestResponseCycle.send

    def counting(self: ChunkWriter, chunk: bytes) -> bool:
        done = original(self, chunk)
        if done:
            written.append(chunk)
            permits.release()
        return done

    async def sent(self: RequestResponseCycle, message: dict) -> None:
        await send(self, message)
        if routers(self.transport) and message.get("body"):
            permits.release()

    monkeypatch.setattr(ChunkWriter, "write", counting)
    monkeypatch.setattr(RequestResponseCycle, "send", sent)
    conn = http.client.HTTPConnection("127.0.0.1", int(rig.url.rsplit(":", 1)[1]), timeout=20)
    try:
        for i in range(2):  # the second on the same keep-alive connection
            written.clear()
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 20, "stream": True,
                               "stream_options": {"include_usage": True}})
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                            "X-Request-Id": f"cw-{i}"})
            resp = conn.getresponse()
            assert resp.status == 200 and resp.getheader("transfer-encoding") == "chunked"
            raw = resp.read()
            events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
            assert events[-1] == b"[DONE]"
            payloads = [json.loads(e) for e in events[:-1]]
            text = "".join(p["choices"][0]["text"] for p in payloads if p["choices"])
            assert text == "".join(f"t{k} " for k in range(20))
            assert payloads[-1]["usage"]["completion_tokens"] == 20
            through = sum(chunk.count(b"data: ") for chunk in written)
            assert through >= 19, f"only {through} of the 19 events after the first went through the writer"
            assert raw.endswith(b"".join(written[-2:]))  # in order, to the end
    finally:
        conn.close()
    rig.assert_no_leaks()


def test_a_slow_client_gets_every_chunk_in_order(make_rig, monkeypatch):
    """A client that stops reading fills the router's socket buffers: uvicorn's flow control
    pauses writing, the writer declines, the relay's ``send`` waits for the drain, and when
    writing resumes no chunk overtakes the one ``send`` holds.

    Nothing here rests on which thread is faster. The decode server streams in lockstep with
    the router: token i+1 leaves only once the router has written token i (taken by the
    writer, or written by ``send``). The router's connection has a small send buffer and the
    client reads nothing until the router recorded a paused write. Then, right after each
    drain, the token the decode server is let send arrives while ``send`` still holds the
    older chunk: the moment at which it could overtake it, made to happen every time."""
    rig = make_rig(decode={"max_seq_len": 8192})  # room for the 5000 tokens below
    for listener in rig.server.server.servers[0].sockets:  # accepted connections inherit it
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    permits, routers = _in_lockstep(rig), _routers(rig)  # permits: tokens the decode server may send now
    paused = threading.Event()
    port = int(rig.url.rsplit(":", 1)[1])
    race = {"windows": 0, "raced": 0, "held": False}
    window: list[asyncio.Event] = []  # set by the next chunk that reaches the router while open
    writable, take, drain, send = ChunkWriter.writable, _Tally.take, FlowControl.drain, RequestResponseCycle.send

    def recording(self: ChunkWriter) -> bool:
        ok = writable(self)
        if not ok and self._cycle.flow.write_paused:
            paused.set()
        return ok

    def offered(self: _Tally, chunk: bytes) -> bool:
        if window:
            window[0].set()
        taken = take(self, chunk)
        if taken:
            permits.release()
        return taken

    async def sent(self: RequestResponseCycle, message: dict) -> None:
        await send(self, message)
        if routers(self.transport) and message.get("body"):
            if race["held"]:  # the window already let the next token go
                race["held"] = False
            else:
                permits.release()

    async def held_drain(self: FlowControl) -> None:
        await drain(self)
        if not routers(self._transport) or race["windows"] >= 20:
            return
        window.append(arrived := asyncio.Event())
        race["held"] = True
        permits.release()  # the next token, while send holds this one
        try:
            await asyncio.wait_for(arrived.wait(), 10)
        finally:
            window.clear()
        race["windows"] += 1
        race["raced"] += arrived.is_set()

    monkeypatch.setattr(ChunkWriter, "writable", recording)
    monkeypatch.setattr(_Tally, "take", offered)
    monkeypatch.setattr(RequestResponseCycle, "send", sent)
    monkeypatch.setattr(FlowControl, "drain", held_drain)
    n = 5000  # ~700 kB: far more than the buffers between the router and a client that reads nothing
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": n, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    received = bytearray()
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: slow-1\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        assert paused.wait(60), "the router never paused writing though the client read nothing"
        while not received.endswith(b"0\r\n\r\n"):
            part = sock.recv(65536)
            assert part, "the router closed the connection mid-stream"
            received += part
    finally:
        sock.close()
    head, _, chunked = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    payload, rest = bytearray(), chunked
    while True:  # undo the chunked framing
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        payload += rest[:size]
        rest = rest[size + 2:]
    events = [e.removeprefix(b"data: ") for e in bytes(payload).split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert race["raced"] >= 1, f"no chunk arrived while send held one ({race})"
    assert text == "".join(f"t{k} " for k in range(n)), "a chunk overtook another"
    rig.assert_no_leaks()
