"""Everything one router app owns: settings, metrics, backends, slot pool, the two
HTTP clients (a raw keep-alive pool for the hot path, httpx for probes and control calls) and its
background tasks. Created by :func:`pd_router.server.app.create_app`; started and stopped by
the app's lifespan. Nothing here is module-global."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import httpx

from pd_build.info import collect
from pd_grammar.spec import SchemaLimits, warm_up
from pd_http.drain import wait_then_cut
from pd_net.tcp import DeadPeer
from pd_router.errors import RouterError, Unreachable, UpstreamRejected
from pd_router.fleet.backends import Backends, DecodeBackend, PrefillBackend
from pd_router.fleet.discovery import Discovery
from pd_router.fleet.load import LoadScraper
from pd_router.fleet.probes import Prober
from pd_router.metrics import RouterMetrics, ServerView, priority_label
from pd_router.settings import RouterSettings
from pd_router.slots.pool import Slot, SlotHooks, SlotPool
from pd_router.tenants import Tenants
from pd_router.upstream.connections import ConnectionPool
from pd_settings.servers import Resolver, system_resolver
from pd_wire.decode import CANCEL_PATH, CancelRequest

if TYPE_CHECKING:
    from pd_http.tracing import Tracing

log = logging.getLogger("pd_router")
CANCEL_TIMEOUT_S = 5.0


class RouterState:
    def __init__(self, settings: RouterSettings, tracing: Tracing | None = None,
                 resolver: Resolver | None = None) -> None:
        self.settings = settings
        self.schema_limits = SchemaLimits(max_bytes=settings.max_schema_bytes, max_depth=settings.max_schema_depth)
        self.build = collect("router")
        self.metrics = RouterMetrics(self.build, self._server_view)
        self.tracing = tracing if tracing is not None else router_tracing(settings, self.build.version)
        self.backends = Backends.from_urls(
            settings.prefill, settings.decode, settings.decode_slots, settings.require_handshake,
            settings.decode_api_key(),
        )
        self.backends.policy = settings.prefill_policy
        self.backends.prefill_slack = settings.prefill_affinity_slack
        self.discovery = Discovery(settings, self.backends, self._added, self._on_probe,
                                   resolver if resolver is not None else system_resolver)
        self.tenants = Tenants(settings.api_key, settings.api_keys_file, settings.tenant_header,
                               settings.min_priority, settings.max_queued_per_tenant)
        self.pool = SlotPool(self.backends, settings.max_queue, settings.queue_timeout,
                             f"pd-router-{uuid.uuid4().hex[:8]}",
                             SlotHooks(self.spawn, self.metrics.slot_rtt.observe, self._slot_answered,
                                       self._decode_unreachable,
                                       lambda outcome: self.metrics.child(self.metrics.decode_affinity, outcome).inc()),
                             aging=settings.priority_aging or None, fair=self.tenants.named)
        self._pool: ConnectionPool | None = None
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._prober: Prober | None = None
        self._loops: set[asyncio.Task[Any]] = set()  # probes, discovery, load scrapes: run until stop
        self.request_ids: set[str] = set()  # X-Request-Ids of the requests being served
        # the completion requests being served: their task -> how to end it at the drain's deadline
        self.live: dict[asyncio.Task[Any], Callable[[], None]] = {}
        self.draining = False
        self._idle: asyncio.Event | None = None  # set when a drain finds nothing live

    @property
    def connections(self) -> ConnectionPool:
        if self._pool is None:
            raise RuntimeError("router not started")
        return self._pool

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("router not started")
        return self._client

    async def start(self) -> None:
        self._pool = ConnectionPool(dead_peer=DeadPeer.within(self.settings.dead_peer_timeout))
        probe_timeout = min(5.0, max(0.5, self.settings.probe_interval))
        self._client = httpx.AsyncClient(timeout=probe_timeout, trust_env=False)
        await self.discovery.refresh()
        prober = self._prober = Prober(self.backends, self._client, self.settings.probe_interval, self._on_probe,
                                       misses=self.settings.probe_misses)
        # the schema checker's import before the first request, not while serving (an import in a
        # thread holds the GIL in long stretches that stall this loop); no xgrammar: the router
        # checks grammars without compiling them (pd_grammar.spec), and stays free of torch
        await asyncio.to_thread(warm_up, False)
        await prober.probe_all()
        loops = [prober.run(), self.discovery.run(), self._reload_keys()]
        if self.settings.prefill_policy == "least-loaded":
            loops.append(LoadScraper(self.backends, self._client, self.settings.prefill_load_interval).run())
        self._loops = {self.spawn(loop) for loop in loops}

    async def stop(self) -> None:
        """Let pending cancels reach the decode servers (bounded), then stop everything."""
        for loop in self._loops:
            loop.cancel()
        pending = [t for t in self._tasks if t not in self._loops]
        if pending:
            await asyncio.wait(pending, timeout=CANCEL_TIMEOUT_S)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._pool is not None:
            self._pool.close()
        if self._client is not None:
            await self._client.aclose()
        if self.tracing is not None:  # exports what is still queued
            await asyncio.to_thread(self.tracing.shutdown)

    def request_ended(self, task: asyncio.Task[Any]) -> None:
        self.live.pop(task, None)
        if not self.live and self._idle is not None:
            self._idle.set()

    async def drain(self) -> None:
        """SIGTERM: ``/ready`` turns 503 and new requests get 503 at once; the requests in
        flight may finish for ``--drain-timeout`` seconds, then the rest are ended with an
        error (an SSE error event when they stream). Their slots go back through the
        usual paths (a cancel on the decode server)."""
        self.draining = True
        self.metrics.draining.set(1)
        idle = self._idle = asyncio.Event()
        if not self.live:
            idle.set()

        def cut() -> None:
            for end in list(self.live.values()):
                end()

        await wait_then_cut(idle.wait, lambda: len(self.live), cut, self.settings.drain_timeout,
                            CANCEL_TIMEOUT_S, "request(s)")

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _decode_unreachable(self, backend: DecodeBackend, why: str) -> None:
        """A decode request found the decode server down: down until a probe says otherwise."""
        self.upstream_failed("decode", backend, Unreachable(f"decode server {backend.url} unreachable: {why}"),
                             mark_down=True)

    def _slot_answered(self, backend: str, result: str) -> None:
        self.metrics.child(self.metrics.slot_requests, backend, result).inc()

    def background_tasks(self) -> int:
        """Tasks besides the loops that run until stop (cancels, probes of new servers)."""
        return len(self._tasks - self._loops)

    def _added(self, backend: PrefillBackend | DecodeBackend) -> None:
        """A server discovery added: probe it now rather than at the next round."""
        if self._prober is not None:
            self.spawn(self._prober.probe_one(backend))

    def abort(self, slot: Slot, request_id: str, handoff_id: str | None = None, busy: bool = False) -> None:
        """Cancel the request (its handoff ``handoff_id``, default the request id) on its
        decode server, then give its slot back (in the background). ``busy``: a server the
        router counts had no free slot although this router counted one: the slot is held for
        a back-off instead (:meth:`SlotPool.hold`). A decode request still open and unread is
        closed first, at once: the decode server frees what it held for it."""
        opened = slot.take_opened()
        if opened is not None:
            opened.close()
        self.spawn(self._cancel_then_release(slot, request_id, handoff_id, busy))

    async def _cancel_then_release(self, slot: Slot, request_id: str, handoff_id: str | None, busy: bool) -> None:
        backend = slot.backend
        try:
            if backend.capabilities is not None:
                cancel = CancelRequest(request_id=request_id, handoff_id=handoff_id)
                resp = await self.client.post(
                    backend.url + CANCEL_PATH,
                    timeout=CANCEL_TIMEOUT_S,
                    json=cancel.model_dump(exclude_none=True),
                    # the id travels in the body; the header only as ASCII (httpx refuses anything else)
                    headers={"X-Request-Id": request_id.encode("ascii", "backslashreplace").decode(),
                             **backend.auth_headers},
                )
                log.info(
                    "request_id=%s cancel on %s: %d %s",
                    request_id,
                    backend.url,
                    resp.status_code,
                    resp.text[:100],
                )
        except httpx.HTTPError as exc:
            log.warning("request_id=%s cancel on %s failed: %s", request_id, backend.url, exc)
        except Exception:  # a bug, not the network: still free the slot below
            log.exception("request_id=%r cancel on %s failed", request_id, backend.url)
        finally:
            if busy:
                self.pool.hold(slot)
            else:
                self.pool.release(slot)

    def upstream_failed(
        self, role: str, backend: PrefillBackend | DecodeBackend, err: RouterError, mark_down: bool = False
    ) -> None:
        if isinstance(err, UpstreamRejected):
            return
        self.metrics.child(self.metrics.upstream_errors, role, backend.url, err.type).inc()
        if mark_down and backend.healthy:
            backend.healthy, backend.reason = False, err.message
            log.warning("backend %s marked unhealthy until the next probe: %s", backend.url, err.message)
            self._on_probe()

    def _on_probe(self) -> None:
        self.backends.sweep()  # drop what drained since the last look
        self.backends.refresh()
        for d in self.backends.decode:  # the virtual clock of the queues' fair shares (pd_router.slots.fair)
            if d.capabilities is not None and d.capabilities.share_clock:
                self.pool.shares.observe(d.capabilities.share_clock)
        self.pool.dispatch()

    async def _reload_keys(self) -> None:
        """The keys file, read again when it changed (every --discovery-interval)."""
        if self.tenants.keys_file is None:
            return
        while True:
            await asyncio.sleep(self.settings.discovery_interval)
            self.tenants.reload()

    def _server_view(self) -> ServerView:
        """The queue and the servers as the ``/metrics`` gauges report them."""
        counts = {(role, s): 0 for role in ("prefill", "decode") for s in ("ready", "unhealthy", "draining")}
        free, healthy = {}, {}
        for d in self.backends.decode:
            free[d.url] = d.free if d.accepting else 0.0
            healthy["decode", d.url] = d.usable
            counts["decode", "draining" if d.draining else "ready" if d.usable else "unhealthy"] += 1
        for p in self.backends.prefill:
            healthy["prefill", p.url] = p.healthy
            counts["prefill", "draining" if p.draining else "ready" if p.healthy else "unhealthy"] += 1
        depths = {(label, "0"): 0 for label in self.tenants.labels()}  # every tenant's series, from the start
        for tenant, priority in self.pool.queue.depths():
            key = (self.tenants.label(tenant), priority_label(priority))
            depths[key] = depths.get(key, 0) + 1
        return ServerView(self.pool.queue_depth, free, healthy, counts, depths)

    def leaks(self) -> dict[str, int]:
        """Non-zero counts of things that should be zero when the router is idle."""
        counts = {
            "queued": self.pool.queue_depth,
            "held_slots": self.pool.held(),
            "prefill_in_flight": sum(p.in_flight for p in self.backends.prefill),
            "request_ids": len(self.request_ids),
        }
        return {k: v for k, v in counts.items() if v}


def router_tracing(settings: RouterSettings, version: str) -> Tracing | None:
    """The router's tracer, exporting to ``--otlp-traces-endpoint``; None (tracing off) without one."""
    if settings.otlp_traces_endpoint is None:
        return None
    from pd_http.tracing import otlp_tracing

    return otlp_tracing(settings.otlp_traces_endpoint, settings.otlp_traces_protocol, "pd-router",
                        {"service.version": version})


__all__ = ["RouterState", "router_tracing"]
