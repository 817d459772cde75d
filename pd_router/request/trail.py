"""What a decode answer has given the client so far, in tokens: the progress lines of an answer
whose claim asked for them (:data:`pd_wire.decode.PROGRESS_PREFIX`) stripped from the bytes
the client gets, their token ids kept, so that a decode server lost mid-answer can be replaced
by another that resumes where the client's answer stands (:mod:`pd_router.request.migration`).

A write of the decode server ends with its progress line: the bytes before a line are whole
events, passed on once the line came; bytes after the last line are held (a write not yet
whole, which a lost server never finishes, or the end of the answer: :meth:`Trail.rest`). Each
write comes in one read from the socket almost always, so holding it back costs nothing then.
"""

from __future__ import annotations

import json

from pd_wire.decode import PROGRESS_PREFIX, progress_ids

_NL = 10  # b"\n"


class Trail:
    """One answer's output tokens, from its progress lines (:meth:`feed` on each body chunk, in
    order). ``tokens``: every output token of the answer so far, the output before a cut
    included when the answer resumed one."""

    __slots__ = ("tokens", "_held", "steps")

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens: list[int] = tokens if tokens is not None else []
        self._held = b""
        self.steps = 0  # progress lines seen (engine steps)

    def feed(self, data: bytes) -> bytes:
        """The bytes of ``data`` to pass on: whole writes, their progress lines taken out."""
        buf = self._held + data if self._held else data
        out: list[bytes] = []
        pos = search = 0
        while True:
            i = buf.find(PROGRESS_PREFIX, search)
            if i < 0:
                break
            if i and buf[i - 1] != _NL:  # not a line's start: text inside an event
                search = i + 1
                continue
            j = buf.find(b"\n", i)
            if j < 0:
                break
            out.append(buf[pos:i])
            self.tokens.extend(progress_ids(buf[i:j]))
            self.steps += 1
            pos = search = j + 1
        self._held = buf[pos:]
        if not out:
            return b""
        return out[0] if len(out) == 1 else b"".join(out)

    def rest(self) -> bytes:
        """The bytes after the last progress line (the whole answer ended: a JSON body, or an
        error event the server ended its stream with); taken."""
        held, self._held = self._held, b""
        return held


def server_error(rest: bytes) -> str | None:
    """The message of the error event ``rest`` holds when the decode server says it failed
    (a 5xx: its engine failed, it is shutting down), which another server may not; None for
    anything else (a 4xx is the request's own)."""
    for line in rest.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            return None
        error = event.get("error") if isinstance(event, dict) else None
        if not isinstance(error, dict):
            return None
        code = error.get("code")
        if isinstance(code, int) and code >= 500:
            return str(error.get("message") or error.get("type") or "server error")
        return None
    return None
