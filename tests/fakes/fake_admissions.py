"""An in-process stand-in for :class:`connector.admission.AdmissionClient` (same API), for unit
tests of the connector's scheduler side. Admissions are answered when the test says so
(``settle_all``, or at once with ``immediate``); offsets follow the layout packed from 0.
Knobs: ``refuse`` endpoint -> reason ("busy", "too_long", ...); ``held`` handoff ids left
under way until released. Records ``started``, ``aborted`` (handoff id, reason) and the
results sent with the KV (``prefilled_results``)."""

from __future__ import annotations

from connector.admission import Admission
from connector.layout import KVLayout, plane_offsets
from connector.prefix import NO_PREFIX, Prefix
from pd_wire.handoff import HandoffResult


class FakeAdmissions:
    def __init__(self, layout: KVLayout, immediate: bool = True) -> None:
        self.layout = layout
        self.immediate = immediate
        self.refuse: dict[str, str] = {}
        self.held: set[str] = set()
        self.started: list[str] = []
        self.aborted: list[tuple[str, str]] = []
        self.prefilled_results: list[HandoffResult] = []
        self.prefixes: dict[str, Prefix] = {}  # the prefix each Admit offered
        self.reuse: dict[str, int] = {}  # handoff id -> the reused tokens its Admitted says
        self._pending: dict[str, tuple[str, int]] = {}
        self._results: dict[str, Admission] = {}
        self.closed = False

    def start(self, handoff_id: str, endpoint: str, num_tokens: int, prefix: Prefix = NO_PREFIX) -> None:
        self.started.append(handoff_id)
        self.prefixes[handoff_id] = prefix
        self._pending[handoff_id] = (endpoint, num_tokens)
        if self.immediate:
            self.settle_all()

    def settle_all(self) -> None:
        for handoff_id, (endpoint, n) in list(self._pending.items()):
            if handoff_id in self.held:
                continue
            del self._pending[handoff_id]
            reason = self.refuse.get(endpoint)
            if reason is not None:
                self._results[handoff_id] = Admission(handoff_id, reason=reason,  # type: ignore[arg-type]
                                                      error=f"{endpoint} refused {handoff_id}: {reason}")
                continue
            size = self.layout.bytes_per_layer(n)
            planes = plane_offsets(self.layout, n)
            offsets = tuple(tuple(layer * size + p for p in planes) for layer in range(self.layout.num_layers))
            self._results[handoff_id] = Admission(handoff_id, slot=0, offsets=offsets,
                                                  reused=self.reuse.get(handoff_id, 0))

    def release(self, handoff_id: str) -> None:
        self.held.discard(handoff_id)
        self.settle_all()

    def result(self, handoff_id: str) -> Admission | None:
        return self._results.get(handoff_id)

    def abort(self, handoff_id: str, endpoint: str, reason: str) -> None:
        self.aborted.append((handoff_id, reason))

    def prefilled(self, result: HandoffResult) -> None:
        self.prefilled_results.append(result)

    def forget(self, handoff_id: str) -> None:
        self._results.pop(handoff_id, None)
        self._pending.pop(handoff_id, None)

    def outstanding(self) -> set[str]:
        """Admissions still remembered: empty once every request is done."""
        return set(self._results) | set(self._pending)

    def close(self) -> None:
        self.closed = True
