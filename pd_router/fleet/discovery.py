"""Which prefill and decode servers the router uses, from four sources at once:

========  ===================================================================================
static    ``--prefill`` / ``--decode`` (fixed for the router's life)
file      ``--servers-file`` (:class:`pd_settings.servers.FileWatch`): re-read when it changes
dns       ``--prefill-dns`` / ``--decode-dns`` ``http://NAME:PORT``: every address ``NAME``
          resolves to is one server (a Kubernetes headless Service); a failed lookup keeps
          the addresses of the last one that worked
admin     ``POST`` / ``DELETE /admin/backends`` (:mod:`pd_router.server.admin`)
========  ===================================================================================

Every ``--discovery-interval`` seconds (and at once after an admin call) the union of the
sources is compared with :class:`pd_router.fleet.backends.Backends`: a new server is added and
probed at once; a server no source lists any more is drained (no new requests;
the ones in flight finish) and dropped when nothing of it is in flight; a drained server
listed again comes back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pd_router.answers import BackendEntry, BackendList, BackendState
from pd_router.fleet.backends import Backends, DecodeBackend, PrefillBackend, Role
from pd_router.settings import RouterSettings, dns_target
from pd_settings.servers import FileWatch, Resolver, resolve_all, system_resolver

log = logging.getLogger("pd_router.discovery")
ROLES: tuple[Role, ...] = ("prefill", "decode")
Backend = PrefillBackend | DecodeBackend


class NotAdminOwned(Exception):
    """The server to remove comes from another source (``sources``) than the admin API."""

    def __init__(self, sources: list[str]) -> None:
        super().__init__(", ".join(sources))
        self.sources = sources


class Discovery:
    def __init__(
        self,
        settings: RouterSettings,
        backends: Backends,
        on_added: Callable[[Backend], None] = lambda _: None,
        on_change: Callable[[], None] = lambda: None,
        resolver: Resolver = system_resolver,
    ) -> None:
        self.backends = backends
        self.interval = settings.discovery_interval
        self.on_added = on_added
        self.on_change = on_change  # after each look
        self.resolver = resolver
        self._sources: dict[str, dict[Role, set[str]]] = {
            "static": {"prefill": set(settings.prefill), "decode": set(settings.decode)},
            "admin": {"prefill": set(), "decode": set()},
            "file": {"prefill": set(), "decode": set()},
            "dns": {"prefill": set(), "decode": set()},
        }
        self._file = FileWatch(settings.servers_file) if settings.servers_file is not None else None
        self._dns: list[tuple[Role, str]] = [("prefill", u) for u in settings.prefill_dns]
        self._dns += [("decode", u) for u in settings.decode_dns]
        self._resolved: dict[str, set[str]] = {}  # DNS target -> the URLs of its last good lookup

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # a bug: log it, keep the lists as they are, look again next time
                log.exception("discovery failed; keeping the current servers")

    async def refresh(self) -> None:
        """Look at the servers file and the DNS names again, then apply what changed."""
        if self._file is not None:
            self._file.poll()
            if self._file.error is not None:
                log.warning("servers file: %s (keeping the last good list)", self._file.error)
            if self._file.current is not None:
                self._sources["file"] = {"prefill": set(self._file.current.prefill),
                                         "decode": {d.url for d in self._file.current.decode}}
        if self._dns:
            found = await asyncio.gather(*(asyncio.to_thread(self._lookup, url) for _, url in self._dns))
            dns: dict[Role, set[str]] = {"prefill": set(), "decode": set()}
            for (role, _), urls in zip(self._dns, found, strict=True):
                dns[role] |= urls
            self._sources["dns"] = dns
        self.apply()

    def _lookup(self, url: str) -> set[str]:
        scheme, name, port = dns_target(url)
        try:
            urls = {f"{scheme}://{address}" for address in resolve_all(f"{name}:{port}", self.resolver)}
        except OSError as exc:
            log.warning("DNS %s: %s (keeping the %d address(es) of the last lookup)", name, exc,
                        len(self._resolved.get(url, ())))
            return self._resolved.get(url, set())
        if urls != self._resolved.get(url):
            log.info("DNS %s: %s", name, ", ".join(sorted(urls)) or "no address")
        self._resolved[url] = urls
        return urls

    def wanted(self, role: Role) -> set[str]:
        return set().union(*(source[role] for source in self._sources.values()))

    def sources_of(self, role: Role, url: str) -> list[str]:
        return [name for name, source in self._sources.items() if url in source[role]]

    def apply(self) -> None:
        """Add what a source lists and the router has not; drain what no source lists; drop
        the drained servers with nothing in flight."""
        for role in ROLES:
            wanted = self.wanted(role)
            for url in sorted(wanted):
                added = self.backends.add(role, url)
                if added is not None:
                    log.info("%s server %s added (%s)", role, url, ", ".join(self.sources_of(role, url)))
                    self.on_added(added)
            listed: list[Backend] = [*(self.backends.prefill if role == "prefill" else self.backends.decode)]
            for backend in listed:
                if backend.url not in wanted and not backend.draining:
                    self.backends.drain(role, backend.url)
                    log.info("%s server %s removed: draining (%s in flight)", role, backend.url, _busy(backend))
        for backend in self.backends.sweep():
            log.info("%s server %s drained and dropped", _role(backend), backend.url)
        self.on_change()

    # -- the admin API's source ---------------------------------------------------------

    def add_admin(self, role: Role, url: str) -> bool:
        """List ``url`` through the admin API; True if the router did not have it."""
        had = self.backends.find(role, url)
        new = had is None or had.draining
        self._sources["admin"][role].add(url)
        self.apply()
        return new

    def remove_admin(self, role: Role, url: str) -> bool:
        """Unlist ``url`` from the admin API; False if no source lists it. Raises
        :class:`NotAdminOwned` when another source lists it (remove it there)."""
        admin = self._sources["admin"][role]
        if url not in admin:
            others = self.sources_of(role, url)
            if others:
                raise NotAdminOwned(others)
            return False
        admin.discard(url)
        self.apply()
        return True

    def entry(self, role: Role, url: str) -> BackendEntry | None:
        backend = self.backends.find(role, url)
        return None if backend is None else self._entry(backend)

    def listing(self) -> BackendList:
        listed: list[Backend] = [*self.backends.prefill, *self.backends.decode]
        return BackendList(backends=[self._entry(b) for b in listed])

    def _entry(self, backend: Backend) -> BackendEntry:
        role = _role(backend)
        if isinstance(backend, PrefillBackend):
            ready, reason = backend.healthy, backend.reason
        else:
            ready, reason = backend.usable, backend.incompatible_reason or backend.reason
        state: BackendState = "draining" if backend.draining else "ready" if ready else "unhealthy"
        return BackendEntry(role=role, url=backend.url, sources=self.sources_of(role, backend.url), state=state,
                            reason=None if ready else reason, in_flight=_busy(backend))


def _role(backend: Backend) -> Role:
    return "prefill" if isinstance(backend, PrefillBackend) else "decode"


def _busy(backend: Backend) -> int:
    return backend.in_flight if isinstance(backend, PrefillBackend) else backend.in_use
