"""Unit tests of the pure parts: request rewrites and the FIFO slot pool."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pd_router.apis.completions import decode_body, parse_request, prefill_body
from pd_router.errors import InvalidRequest, NoHealthyBackend, Overloaded
from pd_router.fleet.backends import Backends
from pd_router.slots.fair import Place
from pd_router.slots.pool import SlotPool
from pd_wire.requests import Endpoint

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "endpoint,body,limits",
    [
        (Endpoint.CHAT, {"max_completion_tokens": 9}, {"max_completion_tokens": 1}),
        (
            Endpoint.CHAT,
            {"max_tokens": 9, "max_completion_tokens": 9},
            {"max_tokens": 1, "max_completion_tokens": 1},
        ),
        (Endpoint.CHAT, {}, {"max_tokens": 1}),
        (Endpoint.COMPLETIONS, {"max_tokens": 9}, {"max_tokens": 1}),
    ],
)
def test_prefill_rewrite(endpoint, body, limits):
    base = {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 3,
        "seed": 5,
        **(
            {"messages": [{"role": "user", "content": "x"}]} if endpoint is Endpoint.CHAT else {"prompt": "x"}
        ),
    }
    original = {**base, **body}
    out = json.loads(prefill_body(endpoint, original, {"handoff_id": "r", "kv_endpoint": "h:1"}))
    assert out["stream"] is False and "stream_options" not in out and "min_tokens" not in out
    assert {k: out[k] for k in ("max_tokens", "max_completion_tokens") if k in out} == limits
    assert out["seed"] == 5 and out["kv_transfer_params"] == {"handoff_id": "r", "kv_endpoint": "h:1"}
    assert original == {**base, **body}  # not mutated
    for raw in (json.dumps(original).encode(), b" \n" + json.dumps(original, indent=2).encode() + b"\n "):
        assert json.loads(decode_body(raw, original, {"a": 1})) == {
            **original,
            "kv_transfer_params": {"a": 1},
        }
    client_params = {**original, "kv_transfer_params": {"x": 1}}  # the client's own is replaced
    out = decode_body(json.dumps(client_params).encode(), client_params, {"a": 1})
    assert json.loads(out)["kv_transfer_params"] == {"a": 1} and out.count(b"kv_transfer_params") == 1
    utf16 = json.dumps(original).encode("utf-16")
    assert json.loads(decode_body(utf16, original, {"a": 1}))["kv_transfer_params"] == {"a": 1}


def test_parse_request_keeps_unknown_fields_and_rejects_bad_ones():
    body, req = parse_request(Endpoint.COMPLETIONS, b'{"model": "m", "prompt": [1, 2], "foo": {"bar": 1}}')
    assert body["foo"] == {"bar": 1} and req.model == "m" and not req.wants_logprobs()
    with pytest.raises(InvalidRequest) as err:
        parse_request(Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user"}], "logprobs": [1]}')
    assert err.value.param == "logprobs"


def _backends(n_decode: int, slots: int = 1, models: tuple[str, ...] = ("m",)) -> Backends:
    """Decode servers the router counts (plain ones: ``--decode-slots``)."""
    b = Backends.from_urls(("http://p",), tuple(f"http://d{i}" for i in range(n_decode)), slots, True)
    b.prefill[0].healthy, b.prefill[0].models = True, frozenset(models)
    for i, d in enumerate(b.decode):
        d.healthy, d.models, d.plain = True, frozenset({models[i % len(models)]}), True
    b.refresh()
    return b


class _Request:
    """A decode request as the pool sees it (never sent: the servers here are counted)."""

    def __init__(self) -> None:
        self.handoff_id = "h"
        self.place = Place(0, 0.0, time.perf_counter())
        self.tenant = "default"
        self.prefixes = None

    async def open(self, backend, wait):
        raise AssertionError("a counted server is not asked")


def _take(pool: SlotPool, model: str):
    return pool.take(model, _Request())


async def test_pool_fifo_per_model_and_timeout():
    backends = _backends(2, slots=1, models=("m", "n"))
    pool = SlotPool(backends, max_queue=10, queue_timeout=0.2, holder="r")
    first_m, first_n = await _take(pool, "m"), await _take(pool, "n")
    waiters = [asyncio.create_task(_take(pool, model)) for model in ("m", "n", "m")]
    await asyncio.sleep(0)
    assert pool.queue_depth == 3
    pool.release(first_n)  # only the "n" waiter can use it, although a "m" waiter is older
    await asyncio.sleep(0)
    assert waiters[1].done() and not waiters[0].done()
    pool.release(first_m)
    await asyncio.sleep(0)
    assert waiters[0].done() and not waiters[2].done()  # the older "m" waiter first
    with pytest.raises(Overloaded):
        await waiters[2]  # times out after 0.2 s
    for w in waiters[:2]:
        pool.release(w.result())
    assert pool.queue_depth == 0 and pool.held() == 0


async def test_pool_cancelled_waiter_and_backend_loss():
    backends = _backends(1)
    pool = SlotPool(backends, max_queue=1, queue_timeout=10, holder="r")
    held = await _take(pool, "m")
    waiter = asyncio.create_task(_take(pool, "m"))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await _take(pool, "m")  # queue full
    pool.release(held)  # granted to the waiter...
    waiter.cancel()  # ...which is cancelled before it runs: the slot must come back
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pool.held() == 0 and pool.queue_depth == 0
    held = await _take(pool, "m")
    waiter = asyncio.create_task(_take(pool, "m"))
    await asyncio.sleep(0)
    backends.decode[0].healthy = False
    backends.refresh()
    pool.dispatch()
    with pytest.raises(NoHealthyBackend):
        await waiter
    pool.release(held)
    with pytest.raises(NoHealthyBackend):
        await _take(pool, "m")
    assert pool.held() == 0


def test_backend_url_parsing():
    from pd_router.upstream.calls import Target

    assert Target.parse("http://[::1]:8100/").origin.authority == "[::1]:8100"
    t = Target.parse("https://decode.example:9443/pd")
    assert (t.origin.host, t.origin.port, t.origin.tls, t.prefix) == ("decode.example", 9443, True, "/pd")
    assert Target.parse("http://h").origin.port == 80


def test_token_histogram_matches_prometheus_semantics():
    from prometheus_client import CollectorRegistry, Histogram

    from pd_router.metrics import TokenHistogram

    ours, reference = CollectorRegistry(), CollectorRegistry()
    fast = TokenHistogram("itl_seconds", "doc", (0.001, 0.003, 0.01), ours)
    slow = Histogram("itl_seconds", "doc", buckets=(0.001, 0.003, 0.01), registry=reference)
    for value in (0.0005, 0.001, 0.002, 0.003, 0.0031, 0.5, 0.0):
        fast.observe(value)
        slow.observe(value)
    samples = {(s.name, tuple(s.labels.items())): s.value for m in ours.collect() for s in m.samples}
    expected = {
        (s.name, tuple(s.labels.items())): s.value
        for m in reference.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    }
    assert samples == pytest.approx(expected)
