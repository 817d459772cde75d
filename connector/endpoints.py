"""The decode KV endpoints this connector may dial and keeps handshaken.

Three sources, the same the router reads (:mod:`pd_settings.servers`): the fixed
``decode_endpoints``, the ``kv_endpoint`` of every decode server in ``servers_file``, and
every address the DNS names of ``decode_kv_dns`` (``NAME:PORT``) resolve to. The handshake
keeper re-reads them every ``handshake_interval_s`` (:meth:`DecodeEndpoints.refresh`):
a decode server added is handshaken within one interval, one removed is dropped. The
scheduler side (vLLM's engine-core process, which has no keeper) refreshes on a thread of
its own (:meth:`DecodeEndpoints.start`) and asks :meth:`DecodeEndpoints.allowed` for each
request's ``kv_endpoint``; an endpoint it does not know yet triggers an early re-read of the
servers file (at most every :data:`MISS_REFRESH_S`; no DNS lookup there: it runs on vLLM's
scheduling thread), so a request routed to a server added a moment ago is not refused
because this process looked before the router did.

A failed read of the file or a failed lookup keeps the endpoints found last (a DNS
hiccup must not drop every decode server).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from connector.config import ConnectorSettings
from connector.control import parse_endpoint
from pd_settings.servers import FileWatch, Resolver, resolve_all, system_resolver

log = logging.getLogger(__name__)
MISS_REFRESH_S = 0.25


class DecodeEndpoints:
    def __init__(self, settings: ConnectorSettings, resolver: Resolver = system_resolver) -> None:
        self._settings = settings
        self._resolver = resolver
        self._file = FileWatch(Path(settings.servers_file)) if settings.servers_file else None
        self._resolved: dict[str, tuple[str, ...]] = {}  # DNS name -> its last good lookup
        self._current: tuple[str, ...] = settings.decode_endpoints
        self._lock = threading.Lock()
        self._last = 0.0  # time.monotonic() of the last refresh
        self._stop: threading.Event | None = None

    @property
    def dynamic(self) -> bool:
        """A servers file or a DNS name is configured: the list may change."""
        return self._file is not None or bool(self._settings.decode_kv_dns)

    def current(self) -> tuple[str, ...]:
        return self._current

    def start(self, interval_s: float) -> None:
        """Refresh every ``interval_s`` on a daemon thread (the scheduler side); no-op when
        nothing can change or the interval is 0."""
        if not self.dynamic or interval_s <= 0:
            return
        stop = self._stop = threading.Event()

        def run() -> None:
            self.refresh()
            while not stop.wait(interval_s):
                self.refresh()

        threading.Thread(target=run, name="tilert-kv-endpoints", daemon=True).start()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def refresh(self, resolve: bool = True) -> tuple[str, ...]:
        """Read the sources again (``resolve``: DNS names too, else their last answers); the
        endpoints now (static ones first, each once)."""
        with self._lock:
            found = list(self._settings.decode_endpoints)
            if self._file is not None:
                self._file.poll()
                if self._file.error is not None:
                    log.warning("servers file: %s (keeping the last good list)", self._file.error)
                if self._file.current is not None:
                    found += self._valid(self._file.current.kv_endpoints())
            for name in self._settings.decode_kv_dns:
                found += self._lookup(name) if resolve else self._resolved.get(name, ())
            current = tuple(dict.fromkeys(found))
            if current != self._current:
                log.info("decode KV endpoints: %s", ", ".join(current) or "none")
            self._current, self._last = current, time.monotonic()
            return current

    def _lookup(self, name_port: str) -> tuple[str, ...]:
        try:
            self._resolved[name_port] = tuple(resolve_all(name_port, self._resolver))
        except OSError as exc:
            log.warning("DNS %s: %s (keeping the last lookup's endpoints)", name_port, exc)
        return self._resolved.get(name_port, ())

    @staticmethod
    def _valid(endpoints: tuple[str, ...]) -> list[str]:
        out = []
        for endpoint in endpoints:
            try:
                parse_endpoint(endpoint)
                out.append(endpoint)
            except ValueError as exc:
                log.warning("servers file: kv_endpoint %r ignored: %s", endpoint, exc)
        return out

    def allowed(self, endpoint: str) -> bool:
        """Whether a request may send its KV to ``endpoint`` (the connector dials only the
        decode servers its sources list; with no source at all, loopback endpoints only)."""
        if not self.dynamic:
            return self._settings.endpoint_allowed(endpoint)
        if endpoint in self._current:
            return True
        if time.monotonic() - self._last >= MISS_REFRESH_S:
            return endpoint in self.refresh(resolve=False)
        return False
