"""Health probes: poll every backend each ``--probe-interval`` seconds with httpx.

Prefill (vLLM): ``GET /health`` and ``GET /v1/models``.
Decode: ``GET CAPABILITIES_PATH``; 200 -> our decode server, then ``GET /ready``;
404 -> a plain OpenAI server (e.g. vLLM), then ``GET /health`` and ``GET /v1/models``.

An answer that says "not ready", a refused connection or a malformed answer marks a backend
down at once (a kept-alive connection the server closed as the probe reused it is not one: the
request goes once more on a new connection). A probe that times out is a miss: a healthy
backend is marked down only after ``misses`` of them in a row (a starved machine answers late
now and then; one late ``/health`` must not turn every client away until the next round). A
request that fails on the hot path still marks its backend down at once
(``RouterState.mark_down``). A decode server's ``kept`` keys replace the router's view of
them, less what answers that ended after the probe was sent changed (``KeptKeys.probed``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import perf_counter

import httpx
from pydantic import ValidationError

from pd_router.fleet.backends import Backends, DecodeBackend, PrefillBackend
from pd_wire.decode import CAPABILITIES_PATH, DecodeCapabilities

log = logging.getLogger("pd_router.probes")


def _why(resp: httpx.Response) -> str:
    text = resp.text.strip().replace("\n", " ")
    return f"{resp.request.url.path} answered {resp.status_code}" + (f": {text[:200]}" if text else "")


def _models(resp: httpx.Response) -> frozenset[str]:
    data = resp.json().get("data", [])
    return frozenset(str(m["id"]) for m in data if isinstance(m, dict) and "id" in m)


class Prober:
    def __init__(
        self, backends: Backends, client: httpx.AsyncClient, interval: float, on_change: Callable[[], None],
        misses: int = 1,
    ) -> None:
        self.backends = backends
        self.client = client
        self.interval = interval
        self.on_change = on_change
        self.misses = misses
        self._missed: dict[str, int] = {}  # backend url -> probes in a row that timed out

    async def run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval)

    async def probe_all(self) -> None:
        await asyncio.gather(
            *(self._prefill(p) for p in self.backends.prefill),
            *(self._decode(d) for d in self.backends.decode),
        )
        live = {b.url for b in self.backends.prefill} | {b.url for b in self.backends.decode}
        self._missed = {url: n for url, n in self._missed.items() if url in live}
        self.backends.refresh()
        self.on_change()

    async def probe_one(self, b: PrefillBackend | DecodeBackend) -> None:
        """Probe one server now (just added), then recompute what depends on it."""
        await (self._prefill(b) if isinstance(b, PrefillBackend) else self._decode(b))
        self.backends.refresh()
        self.on_change()

    async def _get(self, url: str, headers: dict[str, str] | None = None) -> httpx.Response:
        """``GET url``; once more, on a new connection, when the server closed the kept-alive one
        as the probe reused it (its idle timeout, met when probes come late on a starved machine)."""
        try:
            return await self.client.get(url, headers=headers)
        except httpx.RemoteProtocolError:
            return await self.client.get(url, headers=headers)

    async def _health_and_models(self, b: PrefillBackend | DecodeBackend) -> bool:
        """``GET /health`` then ``GET /v1/models``; False (and the reason set) if either fails."""
        auth = b.auth_headers if isinstance(b, DecodeBackend) else None
        for path in ("/health", "/v1/models"):
            resp = await self._get(b.url + path, auth)
            if resp.status_code != 200:
                self._set(b, False, _why(resp))
                return False
        b.models = _models(resp)
        return True

    async def _prefill(self, b: PrefillBackend) -> None:
        try:
            if await self._health_and_models(b):
                self._set(b, bool(b.models), "ok" if b.models else "/v1/models lists no model")
        except httpx.TimeoutException as exc:
            self._miss(b, exc)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self._set(b, False, f"unreachable: {type(exc).__name__}: {exc}")

    async def _decode(self, b: DecodeBackend) -> None:
        try:
            sent = perf_counter()  # answers recorded after this are not in its kept keys
            caps = await self._get(b.url + CAPABILITIES_PATH, b.auth_headers)
            if caps.status_code == 404:
                b.capabilities, b.plain = None, True
                b.kept.probed([], sent, 1)
                if await self._health_and_models(b):
                    self._set(b, True, "ok (no capabilities endpoint)")
                return
            if caps.status_code != 200:
                return self._set(b, False, _why(caps))
            b.capabilities, b.plain = DecodeCapabilities.model_validate_json(caps.content), False
            b.kept.probed(b.capabilities.kept, sent, b.capabilities.slots)
            b.models = frozenset({b.capabilities.model})
            ready = await self._get(b.url + "/ready")
            self._set(b, ready.status_code == 200, "ok" if ready.status_code == 200 else _why(ready))
        except ValidationError as exc:
            self._set(b, False, f"invalid capabilities: {exc.errors()[0]['msg']}")
        except httpx.TimeoutException as exc:
            self._miss(b, exc)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self._set(b, False, f"unreachable: {type(exc).__name__}: {exc}")

    def _miss(self, b: PrefillBackend | DecodeBackend, exc: httpx.TimeoutException) -> None:
        """A probe timed out: down once ``misses`` probes in a row did, or at once if not healthy."""
        missed = self._missed[b.url] = self._missed.get(b.url, 0) + 1
        reason = f"unreachable: {type(exc).__name__}: {exc} ({missed} probe(s) in a row timed out)"
        if b.healthy and missed < self.misses:
            log.info("backend %s: probe timed out (%d of %d before it is marked down)", b.url, missed, self.misses)
            return
        self._set(b, False, reason, missed=missed)

    def _set(self, b: PrefillBackend | DecodeBackend, healthy: bool, reason: str, missed: int = 0) -> None:
        self._missed[b.url] = missed
        if healthy != b.healthy:
            log.log(
                logging.INFO if healthy else logging.WARNING,
                "backend %s %s: %s",
                b.url,
                "healthy" if healthy else "unhealthy",
                reason,
            )
        b.healthy, b.reason = healthy, reason
