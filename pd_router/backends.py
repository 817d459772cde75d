"""What the router knows about its prefill and decode servers.

Health comes from :mod:`pd_router.probes`; load (in-flight prefills, leased decode
slots) from the request path. Readiness and the healthy-backend filters live here,
in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from connector.protocol import PROTOCOL_VERSION
from decode_server.contract import DecodeCapabilities
from pd_router.upstream import Target
from pd_router.wire import DecodeStatus, PrefillStatus, ReadinessReport


@dataclass
class PrefillBackend:
    url: str
    healthy: bool = False
    reason: str = "not probed yet"
    models: frozenset[str] = frozenset()
    in_flight: int = 0
    target: Target = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.target = Target.parse(self.url)

    def report(self) -> PrefillStatus:
        return PrefillStatus(
            url=self.url,
            healthy=self.healthy,
            reason=self.reason,
            models=sorted(self.models),
            in_flight=self.in_flight,
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
    in_use: int = 0
    busy_refusals: int = 0  # "busy" answers in a row for slots counted free here (slots.SlotPool.hold)
    lease_free: int = 0  # free slots as last heard from a server granting leases (a cache, not the count)
    compatible: bool = False
    incompatible_reason: str | None = None
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
    def leases(self) -> bool:
        """The server owns its slots and grants leases (slots.SlotPool asks it)."""
        return self.capabilities is not None and self.capabilities.lease_ttl_s is not None

    @property
    def free(self) -> float:
        return self.lease_free if self.leases else self.slots - self.in_use

    @property
    def usable(self) -> bool:
        return self.healthy and self.compatible

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
        )


@dataclass
class Backends:
    prefill: list[PrefillBackend]
    decode: list[DecodeBackend]
    require_handshake: bool = True
    _served: frozenset[str] = field(default=frozenset(), init=False)

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
        )

    def prefill_models(self) -> frozenset[str]:
        return self._served

    def refresh(self) -> None:
        """Recompute served models and decode compatibility after a probe round."""
        self._served = frozenset().union(*(p.models for p in self.prefill if p.healthy))
        for d in self.decode:
            if d.leases and d.capabilities is not None:
                d.lease_free = max(0, d.capabilities.slots - d.capabilities.busy_slots)
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
        best = None
        for p in self.prefill:
            if (
                p.healthy
                and p is not exclude
                and model in p.models
                and (best is None or p.in_flight < best.in_flight)
            ):
                best = p
        return best

    def pick_decode(self, model: str) -> DecodeBackend | None:
        """The usable decode server for ``model`` with the most free slots, if one is free."""
        best = None
        for d in self.decode:
            if (
                d.usable
                and d.free > 0
                and d.serves(model)
                and (best is None or (d.free, -d.in_use) > (best.free, -best.in_use))
            ):
                best = d
        return best

    def decode_available(self, model: str) -> bool:
        return any(d.usable and d.serves(model) for d in self.decode)

    def readiness(self) -> ReadinessReport:
        prefill_ok = any(p.healthy for p in self.prefill)
        decode_ok = any(d.usable for d in self.decode)
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
