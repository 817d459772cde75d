"""A request's place in the decode queues (docs/router.md, "Who waits for a decode slot").

The place is ``(priority, share, arrived)``, compared in that order, lower first, in this
router's queue and in every decode server's (``SlotWait``):

- ``priority``: the client's (vLLM's field: lower is served sooner, default 0); a request that
  has waited ``--priority-aging`` seconds here is moved to :data:`AGED`, ahead of every class,
  where the aged go by arrival. So no request waits longer than that bound behind requests that
  came after it, whatever their class.
- ``share``: its start tag in start-time fair queuing over tenants, within its class: a
  tenant's request starts at ``max(F, v - 1/(2w))`` and the tenant's next at ``F = start + 1/w``
  (``w``: the tenant's weight), where ``v`` is the class's virtual clock, the largest tag granted
  a slot (this router's grants and the decode servers' ``share_clock``, read with every probe).
  A tenant with 64 queued requests and one with 1 then alternate instead of queueing one behind
  the other; a tenant that comes back after a pause starts at the clock, with no credit for the
  pause beyond half a request (which makes it win a tie against a tenant served meanwhile).
- ``arrived``: this router's ``perf_counter`` at the request's arrival: equal tags go by arrival.

Each router keeps its own ``F`` per tenant: a tenant sending through several routers at once
gets up to one share at each (clients spread over routers by a load balancer spread every tenant
alike), and its requests are in arrival order at each router, in the order of their shares
across routers. The clock is shared through the decode servers, so the tags of two routers
compare. Without tenants (no keys file, no tenant header) there are no shares (all 0): each
class is served in exact arrival order across routers.
Bounded: past :data:`MAX_TENANTS` tenants, the finish tags behind the clock are dropped (those
tenants tag as new ones), then the least recently used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pd_wire.handoff import advance_share_clock

AGED = -(2**63)  # the class of a request that waited --priority-aging: ahead of all
MAX_TENANTS = 4096  # finish tags kept before those behind the clock are dropped


@dataclass(frozen=True, order=True)
class Place:
    """Where a request waits for a decode slot: lower is served sooner."""

    priority: int
    share: float
    arrived: float


class FairShares:
    """The router's fair-share tags (its tenants' finish tags) and each class's virtual clock.
    ``enabled`` false (no tenants configured: every request is the default tenant's): every
    share is 0, so that a class is served in exact arrival order across routers."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._clock: dict[int, float] = {}  # class -> largest share granted (known here: pd_wire's share clock)
        self._finish: dict[tuple[int, str], float] = {}  # (class, tenant) -> its last request's finish tag

    def place(self, priority: int, tenant: str, weight: float, arrived: float) -> Place:
        """A new request's place (it takes its tenant's next share)."""
        if not self.enabled:
            return Place(priority, 0.0, arrived)
        v = self._clock.get(priority, 0.0)
        key = (priority, tenant)
        start = max(self._finish.pop(key, float("-inf")), v - 0.5 / weight)
        if len(self._finish) >= MAX_TENANTS:  # those behind the clock first, then the least recent
            finish = {k: f for k, f in self._finish.items() if f > self._clock.get(k[0], 0.0)}
            while len(finish) >= MAX_TENANTS:
                del finish[next(iter(finish))]
            self._finish = finish
        self._finish[key] = start + 1.0 / weight  # (the most recent last)
        return Place(priority, start, arrived)

    def granted(self, place: Place) -> None:
        """A request of this router got its slot: the clock of its class moves to its tag."""
        if place.priority != AGED:
            advance_share_clock(self._clock, place.priority, place.share)

    def observe(self, clock: Mapping[int, float]) -> None:
        """A decode server's ``share_clock``."""
        for priority, share in clock.items():
            if priority != AGED:
                advance_share_clock(self._clock, priority, share)

    def clock(self, priority: int) -> float:
        return self._clock.get(priority, 0.0)

