"""Keeps the KV handshake with every configured decode endpoint alive.

The endpoints may change at runtime (a servers file, DNS: :mod:`connector.endpoints`):
each round handshakes the ones added and drops the ones removed (their control
connection closed, their NIXL peer removed, once no handoff to them is pending).

vLLM's worker handshakes with its ``decode_endpoints`` at start-up. A decode server that
comes up after vLLM, or restarts, would otherwise only be handshaken again by the next
request routed to it, and the router routes nothing to a decode server without an ``ok``
handshake: a deadlock. This thread re-checks every endpoint each ``interval_s``:
``KVSender.connect`` is idempotent and handshakes again when the control connection is
gone (the endpoint closed it), so a restarted receiver sees this prefill as a peer again
within one interval. Outcome changes are logged; nothing here raises into vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from connector.kv_errors import HandshakeRejected

log = logging.getLogger(__name__)


class _Connects(Protocol):
    def connect(self, endpoint: str, timeout: float) -> None: ...


class HandshakeKeeper:
    """``endpoints``: fixed, or a callable that says them anew each round."""

    def __init__(self, sender: _Connects, endpoints: tuple[str, ...] | Callable[[], Iterable[str]],
                 interval_s: float, timeout_s: float, initial: dict[str, str] | None = None) -> None:
        self._sender = sender
        self._endpoints = endpoints
        self._interval = interval_s
        self._timeout = timeout_s
        self._state: dict[str, str] = dict(initial or {})  # endpoint -> "ok" | error text
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tilert-kv-handshake", daemon=True)

    def start(self) -> None:
        if self._endpoints and self._interval > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self._timeout + self._interval + 1)

    def state(self) -> dict[str, str]:
        return dict(self._state)

    def check_once(self) -> None:
        endpoints = tuple(self._endpoints() if callable(self._endpoints) else self._endpoints)
        for endpoint in [e for e in self._state if e not in endpoints]:
            self._drop(endpoint)
        for endpoint in endpoints:
            if self._stop.is_set():
                return
            try:
                self._sender.connect(endpoint, self._timeout)
                outcome = "ok"
            except HandshakeRejected as exc:
                outcome = f"rejected: {exc}"
            except Exception as exc:  # noqa: BLE001 - unreachable now: try again next interval
                outcome = f"unreachable: {exc}"
            previous = self._state.get(endpoint)
            self._state[endpoint] = outcome
            if outcome != previous:
                level = logging.INFO if outcome == "ok" else logging.WARNING
                log.log(level, "KV handshake with %s: %s", endpoint, outcome)

    def _drop(self, endpoint: str) -> None:
        """A decode endpoint no longer listed: forget it (kept while a handoff to it is pending)."""
        disconnect = getattr(self._sender, "disconnect", None)
        try:
            if disconnect is not None and not disconnect(endpoint):
                return
        except Exception as exc:  # noqa: BLE001 - never into vLLM; try again next round
            log.warning("dropping KV endpoint %s failed: %s", endpoint, exc)
            return
        del self._state[endpoint]
        log.info("KV endpoint %s no longer listed: dropped", endpoint)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.check_once()
