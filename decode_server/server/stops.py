"""Stop strings over a stream of text deltas.

A stop string may span several deltas (token boundaries), so text that could be
the beginning of a stop string is held back until it is decided; text after a
stop is never released.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...], include_stop: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop
        self._held = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Returns the text that is safe to emit; sets :attr:`matched` on a stop."""
        if self.matched is not None:
            return ""
        if not self._stops:
            return delta
        buf = self._held + delta
        hit = self._earliest(buf)
        if hit is not None:
            pos, stop = hit
            self.matched = stop
            self._held = ""
            return buf[: pos + len(stop)] if self._include else buf[:pos]
        keep = partial_suffix_len(buf, self._stops)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, once the sequence ended for another reason."""
        out, self._held = self._held, ""
        return "" if self.matched is not None else out

    def _earliest(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            pos = buf.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best


def partial_suffix_len(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of a marker:
    text that must be held back until the next delta decides it."""
    if not markers:
        return 0
    for k in range(min(len(buf), max(len(m) for m in markers) - 1), 0, -1):
        tail = buf[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0
