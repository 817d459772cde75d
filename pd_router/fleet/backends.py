"""What the router knows about its prefill and decode servers.

Health comes from :mod:`pd_router.fleet.probes`; load (in-flight prefills, decode
slots held) from the request path, and vLLM's own count of running and waiting requests from
:mod:`pd_router.fleet.load`. Readiness and the healthy-backend filters live here, in one place.

The lists change at runtime (:mod:`pd_router.fleet.discovery`): :meth:`Backends.add` appends a
server (or takes back one being drained), :meth:`Backends.drain` stops new work going to
one, and :meth:`Backends.sweep` drops the drained ones once nothing of theirs is in flight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from pd_router.answers import DecodeStatus, PrefillStatus, ReadinessReport
from pd_router.fleet.kept import Affinity, KeptKeys, PrefillAffinity
from pd_router.upstream.calls import Target
from pd_wire.decode import DecodeCapabilities
from pd_wire.handoff import PROTOCOL_VERSION


@dataclass
class PrefillBackend:
    url: str
    healthy: bool = False
    reason: str = "not probed yet"
    models: frozenset[str] = frozenset()
    in_flight: int = 0
    draining: bool = False  # removed: no new requests; dropped once in_flight is 0
    # vLLM's running + waiting requests at the last scrape of its /metrics (None: unknown),
    # and this router's requests sent in all / by the time that scrape was asked for
    scraped: float | None = None
    sent_total: int = 0
    sent_at_scrape: int = 0
    target: Target = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.target = Target.parse(self.url)

    @property
    def load(self) -> float:
        """What least-loaded compares: vLLM's running + waiting requests at the last scrape
        plus the requests this router sent since (the scrape could not count them), never
        less than this router's own in-flight count."""
        if self.scraped is None:
            return self.in_flight
        return max(float(self.in_flight), self.scraped + self.sent_total - self.sent_at_scrape)

    def sent(self) -> None:
        self.in_flight += 1
        self.sent_total += 1

    def report(self) -> PrefillStatus:
        return PrefillStatus(
            url=self.url,
            healthy=self.healthy,
            reason=self.reason,
            models=sorted(self.models),
            in_flight=self.in_flight,
            draining=self.draining,
            load=self.load,
        )


@dataclass
class DecodeBackend:
    url: str
    default_slots: int | None  # --decode-slots, for servers without capabilities
    api_key: str | None = field(default=None, repr=False)  # sent on every call (--decode-api-key-file)
    healthy: bool = False
    reason: str = "not probed yet"
    capabilities: DecodeCapabilities | None = None
    plain: bool = False  # no capabilities endpoint (e.g. vLLM): no cancel, no kv_endpoint
    models: frozenset[str] = frozenset()
    in_use: int = 0  # slots this router's requests hold there
    refusals: int = 0  # refusals in a row (a busy server, a standing decode request refused): its back-off
    draining: bool = False  # removed: no new requests; dropped once nothing is in use
    free_slots: int = 0  # free slots as last heard from a server of ours (a cache, not the count)
    compatible: bool = False
    incompatible_reason: str | None = None
    kept: KeptKeys = field(default_factory=KeptKeys, repr=False)  # conversation keys it keeps (a server of ours)
    target: Target = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.target = Target.parse(self.url, self.api_key)

    @property
    def auth_headers(self) -> dict[str, str]:
        """The headers every call to this server carries (its API key, if any)."""
        return dict(self.target.auth)

    @property
    def slots(self) -> float:
        if self.capabilities is not None:
            return self.capabilities.slots
        return self.default_slots if self.default_slots is not None else math.inf

    @property
    def owns_slots(self) -> bool:
        """A server of ours: its slots are held by decode requests (it counts them, the router
        asks); else (a plain vLLM) the router counts its slots."""
        return self.capabilities is not None

    @property
    def free(self) -> float:
        return self.free_slots if self.owns_slots else self.slots - self.in_use

    @property
    def usable(self) -> bool:
        return self.healthy and self.compatible

    @property
    def accepting(self) -> bool:
        """Usable and not being drained: may get new requests."""
        return self.usable and not self.draining

    def serves(self, model: str) -> bool:
        return model in self.models

    def report(self) -> DecodeStatus:
        caps = self.capabilities
        return DecodeStatus(
            url=self.url,
            healthy=self.healthy,
            compatible=self.compatible,
            reason=self.incompatible_reason if self.healthy and not self.compatible else self.reason,
            models=sorted(self.models),
            engine=caps.engine if caps else ("plain" if self.plain else None),
            slots=None if math.isinf(self.slots) else int(self.slots),
            in_use=self.in_use,
            peers=list(caps.peers) if caps else [],
            draining=self.draining,
        )


Role = Literal["prefill", "decode"]


def _room(d: DecodeBackend) -> tuple[float, float, int]:
    """How a request continuing nothing ranks a server with a free slot (higher first)."""
    return d.free - len(d.kept), d.free, -d.in_use


@dataclass
class Backends:
    prefill: list[PrefillBackend]
    decode: list[DecodeBackend]
    require_handshake: bool = True
    decode_slots: int | None = None  # for decode servers added later (--decode-slots)
    decode_api_key: str | None = field(default=None, repr=False)
    policy: Literal["least-loaded", "round-robin"] = "least-loaded"  # --prefill-policy
    prefill_slack: float = 2.0  # --prefill-affinity-slack
    prefill_affinity: PrefillAffinity = field(default_factory=PrefillAffinity, repr=False)
    _served: frozenset[str] = field(default=frozenset(), init=False)
    _turn: int = field(default=0, init=False)  # round-robin's position

    @classmethod
    def from_urls(
        cls,
        prefill: tuple[str, ...],
        decode: tuple[str, ...],
        decode_slots: int | None,
        require_handshake: bool,
        decode_api_key: str | None = None,
    ) -> Backends:
        return cls(
            [PrefillBackend(u) for u in prefill],
            [DecodeBackend(u, decode_slots, decode_api_key) for u in decode],
            require_handshake,
            decode_slots,
            decode_api_key,
        )

    # -- the lists at runtime ---------------------------------------------------------

    def find(self, role: Role, url: str) -> PrefillBackend | DecodeBackend | None:
        found: list[PrefillBackend] | list[DecodeBackend] = self.prefill if role == "prefill" else self.decode
        return next((b for b in found if b.url == url), None)

    def add(self, role: Role, url: str) -> PrefillBackend | DecodeBackend | None:
        """Add the server ``url`` (or take it back if it is being drained); the new backend
        (to probe at once), or None if it was there already."""
        existing = self.find(role, url)
        if existing is not None:
            existing.draining = False
            return None
        if role == "prefill":
            p = PrefillBackend(url)
            self.prefill.append(p)
            return p
        d = DecodeBackend(url, self.decode_slots, self.decode_api_key)
        self.decode.append(d)
        return d

    def drain(self, role: Role, url: str) -> bool:
        """No new requests for ``url``; it is dropped by
        :meth:`sweep` once nothing of it is in flight. False if there is no such server."""
        backend = self.find(role, url)
        if backend is None:
            return False
        backend.draining = True
        return True

    def sweep(self) -> list[PrefillBackend | DecodeBackend]:
        """Drop the drained servers with nothing in flight; returns them."""
        gone: list[PrefillBackend | DecodeBackend] = [p for p in self.prefill if p.draining and not p.in_flight]
        gone += [d for d in self.decode if d.draining and not d.in_use]
        if gone:
            self.prefill = [p for p in self.prefill if p not in gone]
            self.decode = [d for d in self.decode if d not in gone]
        return gone

    def prefill_models(self) -> frozenset[str]:
        return self._served

    def refresh(self) -> None:
        """Recompute served models and decode compatibility after a probe round."""
        self._served = frozenset().union(*(p.models for p in self.prefill if p.healthy))
        for d in self.decode:
            if d.capabilities is not None:
                d.free_slots = max(0, d.capabilities.slots - d.capabilities.busy_slots)
            d.incompatible_reason = self._incompatibility(d)
            d.compatible = d.incompatible_reason is None

    def _incompatibility(self, d: DecodeBackend) -> str | None:
        """Why ``d`` cannot take requests, or None. The decode server's own problems
        (protocol, handshake) come first: they say the most about a broken deployment."""
        if not d.healthy:
            return d.reason
        caps = d.capabilities
        if caps is not None and caps.protocol_version != PROTOCOL_VERSION:
            return f"protocol_version {caps.protocol_version}, router speaks {PROTOCOL_VERSION}"
        if caps is not None and self.require_handshake and not any(p.state == "ok" for p in caps.peers):
            rejected = [p for p in caps.peers if p.state == "rejected"]
            if rejected:
                return "KV handshake rejected: " + "; ".join(f"{p.peer}: {p.reason}" for p in rejected)
            return "no prefill connector has completed the KV handshake yet"
        if not self._served:
            return "no healthy prefill server to compare models with"
        if not d.models & self._served:
            return f"serves {sorted(d.models)}, prefill servers serve {sorted(self._served)}"
        return None

    def pick_prefill(self, model: str, exclude: PrefillBackend | None = None) -> PrefillBackend | None:
        """A healthy prefill server for ``model`` (not ``exclude``, not draining), for a request
        without conversation keys: :meth:`choose_prefill`'s."""
        return self.choose_prefill(model, exclude)[0]

    def choose_prefill(self, model: str, exclude: PrefillBackend | None = None,
                       prefer: Mapping[str, int] | None = None) -> tuple[PrefillBackend | None, Affinity]:
        """A healthy prefill server for ``model`` (not ``exclude``, not draining), and how the
        request's prefix keys (``prefer``) chose it: the server that last prefilled the
        request's longest recorded prefix (:class:`PrefillAffinity`) when it is eligible and its
        :attr:`PrefillBackend.load` is at most the least load + ``prefill_slack``; else the one
        with the least load (``least-loaded``; ties: the first listed), or the next in turn
        (``round-robin``)."""
        eligible = [p for p in self.prefill
                    if p.healthy and not p.draining and p is not exclude and model in p.models]
        outcome: Affinity = "none"
        if prefer:
            url = self.prefill_affinity.server(prefer)
            if url is not None:
                outcome = "kept_server_busy"
                recorded = next((p for p in eligible if p.url == url), None)
                if recorded is not None and recorded.load <= min(p.load for p in eligible) + self.prefill_slack:
                    return recorded, "kept_server_free"
        if not eligible:
            return None, outcome
        if self.policy == "round-robin":
            self._turn += 1
            return eligible[self._turn % len(eligible)], outcome
        return min(eligible, key=lambda p: p.load), outcome

    def pick_decode(self, model: str) -> DecodeBackend | None:
        """An accepting decode server for ``model`` with a free slot, for a request without
        conversation keys: :meth:`choose_decode`'s."""
        return self.choose_decode(model)[0]

    def choose_decode(self, model: str,
                      prefer: Mapping[str, int] | None = None) -> tuple[DecodeBackend | None, Affinity]:
        """An accepting decode server for ``model`` with a free slot, and how the request's
        prefix keys (``prefer``: key -> index in its chain) chose it: the one keeping the
        request's longest prefix (:attr:`DecodeBackend.kept`; the highest index; ties: the most
        free slots), else the one with the most free slots keeping nothing (then the most free
        slots, the fewest this router holds): a request that continues nothing takes a slot
        whose kept KV serves no other conversation when there is one. A server keeping a prefix
        without a free slot is not waited for."""
        best = None
        kept: tuple[DecodeBackend, int] | None = None
        busy = False
        for d in self.decode:
            if not (d.accepting and d.serves(model)):
                continue
            if prefer:
                match = d.kept.match(prefer)
                if match is not None:
                    if d.free <= 0:
                        busy = True
                    elif kept is None or (match[1], d.free) > (kept[1], kept[0].free):
                        kept = (d, match[1])
            if d.free > 0 and (best is None or _room(d) > _room(best)):
                best = d
        if kept is not None:
            return kept[0], "kept_server_free"
        return best, "kept_server_busy" if busy else "none"

    def decode_available(self, model: str) -> bool:
        return any(d.accepting and d.serves(model) for d in self.decode)

    def readiness(self) -> ReadinessReport:
        prefill_ok = any(p.healthy and not p.draining for p in self.prefill)
        decode_ok = any(d.accepting for d in self.decode)
        decode = [d.report() for d in self.decode]
        problems = [f"prefill {p.url}: {p.reason}" for p in self.prefill if not p.healthy]
        problems += [
            f"decode {r.url}: {r.reason}" for d, r in zip(self.decode, decode, strict=True) if not d.usable
        ]
        return ReadinessReport(
            ready=prefill_ok and decode_ok,
            problems=problems,
            prefill=[p.report() for p in self.prefill],
            decode=decode,
        )
