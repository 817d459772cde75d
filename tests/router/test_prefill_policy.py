"""--prefill-policy: least-loaded from vLLM's own gauges (scraped from /metrics) plus what
this router sent since the scrape, and round-robin."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pd_router.fleet.backends import Backends, PrefillBackend
from pd_router.fleet.load import LoadScraper, vllm_load
from tests.router.conftest import MODEL


def backends(n: int, policy: str = "least-loaded") -> Backends:
    b = Backends([PrefillBackend(f"http://p{i}:1") for i in range(n)], [], policy=policy)  # type: ignore[arg-type]
    for p in b.prefill:
        p.healthy, p.models = True, frozenset({MODEL})
    return b


def test_least_loaded_counts_the_scrape_plus_what_was_sent_since() -> None:
    b = backends(2)
    p0, p1 = b.prefill
    p0.scraped, p1.scraped = 4.0, 1.0  # other routers' requests are in vLLM's gauges
    assert b.pick_prefill(MODEL) is p1
    for _ in range(3):  # this router sends three to p1 before the next scrape
        b.pick_prefill(MODEL).sent()
    assert (p1.load, p0.load) == (4.0, 4.0) and b.pick_prefill(MODEL) is p0  # a tie: the first listed
    p1.sent()
    assert b.pick_prefill(MODEL) is p0
    # the next scrape counts what it can see; sent_at_scrape marks where it was asked
    p1.scraped, p1.sent_at_scrape, p1.in_flight = 0.0, p1.sent_total, 0
    assert p1.load == 0.0 and b.pick_prefill(MODEL) is p1
    # never less than this router's own in-flight count (a scrape older than its requests)
    p1.in_flight = 9
    assert p1.load == 9.0 and b.pick_prefill(MODEL) is p0


def test_least_loaded_without_gauges_uses_the_in_flight_count_and_skips_draining() -> None:
    b = backends(3)
    p0, p1, p2 = b.prefill
    p0.in_flight, p1.in_flight, p2.in_flight = 2, 1, 0
    p2.draining = True
    assert b.pick_prefill(MODEL) is p1
    assert b.pick_prefill(MODEL, exclude=p1) is p0


def test_round_robin_takes_each_in_turn() -> None:
    b = backends(3, "round-robin")
    b.prefill[0].scraped = 100.0  # ignored
    picks = [b.pick_prefill(MODEL).url for _ in range(6)]
    assert sorted(picks[:3]) == [p.url for p in b.prefill] and picks[:3] == picks[3:]


def test_vllm_load_sums_running_and_waiting_over_models() -> None:
    text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="a"} 2.0\n'
            'vllm:num_requests_running{model_name="b"} 1.0\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="a"} 3.0\n'
            '# TYPE vllm:other gauge\nvllm:other 50\n')
    assert vllm_load(text) == 6.0
    assert vllm_load("# TYPE x gauge\nx 1\n") is None


async def test_scraper_reads_each_prefill_servers_metrics(make_rig) -> None:
    rig = make_rig(n_prefill=3, prefill={"running": 0.0}, prefill_load_interval=0.05)
    busy, idle, plain = rig.prefills
    rig.config(busy, running=3.0, waiting=2.0)
    rig.config(plain, running=None)  # no /metrics: falls back to the in-flight count
    b = rig.state.backends
    p_busy, p_idle, p_plain = (b.find("prefill", s.url) for s in rig.prefills)
    async with httpx.AsyncClient() as client:
        scraper = LoadScraper(b, client, 0.05)
        p_idle.sent()  # sent before the scrape was asked for: vLLM's gauges include it
        await scraper.scrape_all()
    p_idle.in_flight = 0
    assert (p_busy.load, p_idle.load, p_plain.scraped) == (5.0, 0.0, None)
    assert b.pick_prefill(MODEL) in (p_idle, p_plain)


async def test_a_scrape_asked_earlier_that_answers_later_is_dropped() -> None:
    """Two scrapes of one server overlap (a slow /metrics, or a test's scraper beside the
    router's): the one asked before a request was sent must not overwrite the newer one,
    or that request would be counted twice (once in vLLM's gauges, once as sent since)."""
    b = backends(1)
    (p,) = b.prefill
    first_asked, release_first = asyncio.Event(), asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if not first_asked.is_set():
            first_asked.set()
            await release_first.wait()  # the old scrape answers last, still seeing 0
            return httpx.Response(200, text="# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n")
        return httpx.Response(200, text="# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        scraper = LoadScraper(b, client, 0.05)
        old = asyncio.create_task(scraper.scrape(p))
        await first_asked.wait()
        p.sent()  # vLLM counts it in the newer scrape
        await scraper.scrape(p)
        assert (p.scraped, p.load) == (1.0, 1.0)
        release_first.set()
        await old
    assert (p.scraped, p.load) == (1.0, 1.0)


@pytest.mark.parametrize("policy", ["least-loaded", "round-robin"])
def test_requests_follow_the_policy(make_rig, policy: str) -> None:
    rig = make_rig(n_prefill=2, prefill={"running": 0.0}, prefill_policy=policy, prefill_load_interval=0.05)
    loaded = rig.prefills[0]
    rig.config(loaded, running=8.0)  # another router's requests
    p_loaded = rig.state.backends.find("prefill", loaded.url)
    if policy == "least-loaded":
        rig.wait(lambda: p_loaded.scraped == 8.0, 5, "the scrape of the loaded server")
    else:
        assert p_loaded.scraped is None  # round-robin scrapes nothing
    for i in range(4):
        r = httpx.post(rig.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                       headers={"X-Request-Id": f"{policy}-{i}"}, timeout=10)
        assert r.status_code == 200, r.text
    counts = [len(rig.records(p)["requests"]) for p in rig.prefills]
    assert counts == ([0, 4] if policy == "least-loaded" else [2, 2])
    rig.assert_no_leaks()
