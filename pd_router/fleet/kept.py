"""What the router knows of the KV kept for conversations' next turns (docs/router.md, "Which
decode server a conversation's next turn goes to"): per decode server, the conversation keys it
keeps in its free slots (:class:`KeptKeys`: its probe's ``DecodeCapabilities.kept`` and the
answers this router saw end since), and which prefill server last prefilled a conversation
(:class:`PrefillAffinity`). The keys are the router's own
(:mod:`pd_router.request.keys`); a request names its own as ``prefixes``: each prefix key of its
conversation -> its index in the chain (the longest match, the highest index, is preferred).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

# how a request's kept prefix chose its server (pd_router_decode_affinity_total and
# pd_router_prefill_affinity_total): the keeping server was chosen; a server keeps it but had no
# free slot (decode) or was loaded past --prefill-affinity-slack or not eligible (prefill); none keeps it
Affinity = Literal["kept_server_free", "kept_server_busy", "none"]
AFFINITY_OUTCOMES: tuple[Affinity, ...] = ("kept_server_free", "kept_server_busy", "none")
RECORDED_MAX = 1024  # answers recorded between two probes of one server (older ones are dropped)
PREFILL_AFFINITY_MAX = 4096  # conversations whose prefill server is remembered (the least recent forgotten)
# an answer recorded at most this long before a probe was sent may be missing from that probe's
# kept keys: the router records it at the relay's end, the server keeps it once its worker gave
# the slot back, a little later
KEPT_RECORD_GRACE_S = 1.0


def best_match(keys: Sequence[str], prefixes: Mapping[str, int]) -> tuple[str, int] | None:
    """Of ``keys``, the one that is the longest prefix of the request (the highest index in
    ``prefixes``) and that index; None when none is one."""
    best: tuple[str, int] | None = None
    for key in keys:
        index = prefixes.get(key)
        if index is not None and (best is None or index > best[1]):
            best = (key, index)
    return best


@dataclass
class KeptKeys:
    """The conversation keys one decode server keeps in its free slots, most recent first, as the
    router sees them: the last probe's ``DecodeCapabilities.kept``, with the answers recorded
    after that probe was sent applied on top (a probe sent before an answer ended cannot know
    its key, so it does not erase it). At most ``limit`` keys (the server's slots) are kept."""

    _keys: list[str] = field(default_factory=list)
    # (when, the answer's conversation key, the kept key it continued): answers recorded since
    # the last probe was sent, on the router's perf_counter clock
    _recorded: deque[tuple[float, str, str | None]] = field(default_factory=lambda: deque(maxlen=RECORDED_MAX))

    @property
    def keys(self) -> list[str]:
        """The keys, most recent first."""
        return list(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, prefixes: Mapping[str, int]) -> tuple[str, int] | None:
        """The kept key that is the request's longest prefix, and its index; None if none is."""
        return best_match(self._keys, prefixes) if self._keys and prefixes else None

    def record(self, key: str, continues: str | None, when: float, limit: int) -> None:
        """An answer that ended cleanly at ``when``: the server keeps ``key`` now (the most
        recent), and no longer ``continues`` (that KV became this answer's)."""
        self._recorded.append((when, key, continues))
        self._apply(key, continues, limit)

    def probed(self, kept: Sequence[str], sent_at: float, limit: int) -> None:
        """A probe sent at ``sent_at`` answered ``kept``: it replaces the view, except for the
        answers recorded after it was sent, or less than :data:`KEPT_RECORD_GRACE_S` before,
        which are applied again on top."""
        while self._recorded and self._recorded[0][0] <= sent_at - KEPT_RECORD_GRACE_S:
            self._recorded.popleft()
        self._keys = list(dict.fromkeys(kept))[:limit]
        for _, key, continues in self._recorded:
            self._apply(key, continues, limit)

    def _apply(self, key: str, continues: str | None, limit: int) -> None:
        keys = [k for k in self._keys if k != key and k != continues]
        keys.insert(0, key)
        del keys[max(1, limit):]
        self._keys = keys


@dataclass
class PrefillAffinity:
    """Which prefill server last prefilled a conversation (its conversation key -> the server's
    URL; at most ``limit`` conversations, the least recently used forgotten): its prefix cache
    likely holds the conversation's next turn's beginning."""

    limit: int = PREFILL_AFFINITY_MAX
    _servers: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._servers)

    def record(self, conversation: str, url: str) -> None:
        self._servers[conversation] = url
        self._servers.move_to_end(conversation)
        while len(self._servers) > self.limit:
            self._servers.popitem(last=False)

    def server(self, prefixes: Mapping[str, int]) -> str | None:
        """The prefill server of the request's longest prefix recorded here, if any (that
        conversation becomes the most recently used)."""
        best: tuple[str, int] | None = None
        for key, index in prefixes.items():  # at most the request's units (pd_router.request.keys.MAX_UNITS)
            if key in self._servers and (best is None or index > best[1]):
                best = (key, index)
        if best is None:
            return None
        self._servers.move_to_end(best[0])
        return self._servers[best[0]]
