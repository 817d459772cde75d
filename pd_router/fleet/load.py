"""vLLM's own load signal for ``--prefill-policy least-loaded``.

Every ``--prefill-load-interval`` seconds each prefill server's ``/metrics`` is read and
its gauges ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (one series per
``model_name``) are summed into :attr:`PrefillBackend.scraped`. That count includes every
router's requests, so several routers in front of the same prefill servers spread their
load instead of each seeing only its own. What this router sent after the scrape was asked
for is added on top (:attr:`PrefillBackend.load`). A server whose ``/metrics`` fails or
lacks both gauges (not vLLM) falls back to this router's in-flight count.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pd_router.fleet.backends import Backends, PrefillBackend

log = logging.getLogger("pd_router.load")
LOAD_GAUGES = frozenset({"vllm:num_requests_running", "vllm:num_requests_waiting"})


def vllm_load(metrics_text: str) -> float | None:
    """Running + waiting requests from a vLLM ``/metrics`` page (all models); None if it
    carries neither gauge."""
    total, seen = 0.0, False
    for family in text_string_to_metric_families(metrics_text):
        if family.name in LOAD_GAUGES:
            seen = True
            total += sum(sample.value for sample in family.samples)
    return total if seen else None


class LoadScraper:
    def __init__(self, backends: Backends, client: httpx.AsyncClient, interval: float) -> None:
        self.backends = backends
        self.client = client
        self.interval = interval

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self.interval)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(p) for p in self.backends.prefill if p.healthy))

    async def scrape(self, p: PrefillBackend) -> None:
        mark = p.sent_total  # requests sent after this may be missing from the answer
        try:
            resp = await self.client.get(p.url + "/metrics", timeout=max(0.2, self.interval))
            load = vllm_load(resp.text) if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            if p.scraped is not None:
                log.warning("prefill %s: /metrics unreadable (%s); least-loaded uses this router's count", p.url, exc)
            load = None
        if mark < p.sent_at_scrape:  # a scrape asked later has answered first: it is newer
            return
        p.scraped, p.sent_at_scrape = load, mark
