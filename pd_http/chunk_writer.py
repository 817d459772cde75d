"""Writing a streamed response's body chunks straight to the connection: an ASGI
extension of the limited uvicorn protocol (:mod:`pd_http.limits`).

An ASGI ``send`` of one body chunk is a coroutine: whoever relays an upstream stream has to
be woken (a future, a task step, the frames of an ``async for``) to call it, and uvicorn
then runs its per-message checks before the one ``transport.write`` that matters. For a
relay of one small SSE chunk per generated token (the router's decode relay) that is most
of its Python work per token. :class:`ChunkWriter`, found in the request scope's
``extensions`` under :data:`EXTENSION`, writes a chunk in the framing uvicorn would have
used, synchronously, from wherever the chunk arrived (the upstream connection's protocol
callback), but only while the response is in a state where uvicorn's ``send`` would have
written the same bytes at once: started, chunked, not complete, the client connected and
not pushing back (uvicorn's write flow control). Otherwise :meth:`ChunkWriter.write`
declines and the caller uses ``send``. A response's start and its end always go through
``send``, so uvicorn's own view of the exchange (keep-alive, completion) stays right.

The writer reads uvicorn's request/response cycle, which is not a public API:
:meth:`ChunkWriter.of` gives no writer for a cycle that lacks any of what it reads (a
uvicorn that renamed it), and the relay then sends every chunk through ``send``, slower
but right. ``tests/router/test_chunk_writer.py`` fails when the installed uvicorn gets no
writer.
"""

from __future__ import annotations

from typing import Any

EXTENSION = "pd.chunk_writer"
# what the writer reads of uvicorn's httptools RequestResponseCycle (and of its ``flow``)
_CYCLE_STATE = ("response_started", "response_complete", "disconnected", "chunked_encoding", "flow", "transport")


class ChunkWriter:
    """Writes body chunks of one request's response (one uvicorn request/response cycle)."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle  # uvicorn's httptools RequestResponseCycle

    @classmethod
    def of(cls, cycle: Any) -> ChunkWriter | None:
        """A writer for ``cycle``; None when the cycle lacks state the writer reads."""
        if all(hasattr(cycle, name) for name in _CYCLE_STATE) and hasattr(cycle.flow, "write_paused"):
            return cls(cycle)
        return None

    def writable(self) -> bool:
        """Whether uvicorn's ``send`` would write a body chunk at once now."""
        cycle = self._cycle
        return (
            cycle.response_started
            and not cycle.response_complete
            and not cycle.disconnected
            and cycle.chunked_encoding is True
            and not cycle.flow.write_paused
            and not cycle.transport.is_closing()
        )

    def write(self, chunk: bytes) -> bool:
        """Write ``chunk`` as one HTTP chunk now; False (nothing written) when ``send`` must do it."""
        if not chunk or not self.writable():
            return False
        self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True


def chunk_writer(scope: Any) -> ChunkWriter | None:
    """The request's writer, when its server provides one (the router's uvicorn does)."""
    extensions = scope.get("extensions")
    return extensions.get(EXTENSION) if extensions else None
