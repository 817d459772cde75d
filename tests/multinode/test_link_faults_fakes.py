"""Links between hosts failing under the real router, with fake prefill and decode servers
on their own nodes (tests/nodes.py): fast, so every such fault is checked in seconds. The
same faults on the real stack (vLLM, NIXL, the reference decode engine) are in
test_stack_across_nodes.py.

A pulled cable sends no FIN and no RST: before the router set TCP keepalive and a user
timeout on its connections (pd_net.tcp), a stream whose decode host vanished waited for
``--decode-timeout`` (120 s by default) before its client heard anything."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import pytest

from pd_router import RouterApp, create_app
from pd_router.server.serve import router_server
from pd_router.settings import validate_settings
from tests.fakes.fake_backends import FakeDecode, FakePrefill, ServerThread
from tests.multinode.streams import StreamRecord, read_stream
from tests.nodes import Nodes
from tests.waits import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL = "tiny"
API_KEY = "multinode-test-key"
DEAD_PEER_S = 4.0  # the router's --dead-peer-timeout here
QUEUE_TIMEOUT_S = 20.0  # a request still waiting for a slot after this gets 429
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROUTER_PORT, PREFILL_PORT, DECODE_PORT = 8000, 8100, 8200  # each node has its own ports


@dataclass
class Cluster:
    nodes: Nodes
    router: RouterApp
    servers: list[ServerThread] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.nodes[0].address}:{ROUTER_PORT}"

    def ready(self) -> int:
        return self.nodes[0].call(lambda: httpx.get(self.url + "/ready", timeout=5).status_code)


@contextmanager
def _cluster(num_decode: int) -> Iterator[Cluster]:
    """Router and a fake prefill on node 0, a fake decode server (one slot, tokens 10 ms
    apart) on each of nodes 1..num_decode."""
    with Nodes(1 + num_decode) as nodes:
        prefill = ServerThread(FakePrefill(model=MODEL), PREFILL_PORT, host=nodes[0].address, netns=nodes[0].netns)
        decodes = [ServerThread(FakeDecode(model=MODEL, token_delay=0.01, max_seq_len=8192), DECODE_PORT,
                                host=node.address, netns=node.netns) for node in nodes.nodes[1:]]
        settings = validate_settings({
            "prefill": (prefill.url,), "decode": tuple(d.url for d in decodes), "host": nodes[0].address,
            "port": ROUTER_PORT, "api_key": API_KEY, "probe_interval": 0.5, "dead_peer_timeout": DEAD_PEER_S,
            "queue_timeout": QUEUE_TIMEOUT_S, "log_level": "warning"})
        app = create_app(settings)
        router = ServerThread(app, ROUTER_PORT, server=router_server(app, settings), host=nodes[0].address,
                              netns=nodes[0].netns)
        running = Cluster(nodes, app, [prefill, *decodes, router])
        try:
            for server in running.servers:
                server.start()
            wait_until(lambda: running.ready() == 200, 20, "the router ready")
            yield running
        finally:
            for server in running.servers:
                server.server.should_exit = True
            for server in running.servers:
                server.stop()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with _cluster(1) as running:
        yield running


def test_a_decode_host_whose_link_goes_down_mid_stream(cluster: Cluster) -> None:
    """The only decode host: the stream ends with an OpenAI error event within the bound (no
    hang; no other host to move the answer to), nothing is left in the router, /ready says the
    decode server is unreachable, and once the cable is back the next request is served
    without a restart."""
    record = StreamRecord()
    events, ended = record.events, record.ended
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5000, "stream": True}
    client = threading.Thread(target=cluster.nodes[0].call,
                              args=(read_stream, cluster.url + "/v1/completions", body, AUTH, record))
    client.start()
    try:
        wait_until(lambda: len(events) >= 10, 20, "the first tokens")
        pulled = time.monotonic()
        cluster.nodes[1].cable(up=False)
        client.join(60)
        assert ended, "the client still waits for the stream, 60 s after the decode host's link went down"
        took = ended[0] - pulled
        assert "error" in events[-1], f"the stream did not end with an error event: {events[-1]}"
        bound = DEAD_PEER_S + 2.0  # the dead-peer bound, plus the relay's own reaction
        assert took <= bound, f"the error came {took:.1f}s after the link went down (bound {bound:g}s)"
        print(f"link down mid-stream: error event {took:.2f}s after the cable was pulled: {events[-1]}")
        wait_until(lambda: cluster.ready() == 503, 10, "/ready to say the decode server is down")
        wait_until(lambda: not cluster.router.state.leaks(), 10, "the router to let go of the request")
    finally:
        cluster.nodes[1].cable(up=True)
        client.join(30)
    wait_until(lambda: cluster.ready() == 200, 20, "/ready once the link is back")
    resp = cluster.nodes[0].call(lambda: httpx.post(
        cluster.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5}, headers=AUTH,
        timeout=30))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "".join(f"t{k} " for k in range(5))


def test_a_decode_host_gone_while_requests_queue(cluster_of_two: Cluster) -> None:
    """Two decode hosts of one slot, six streams: two served, four queued. The host serving
    one of them drops off the network: that stream moves to the other host, ahead of the four
    queued (it came first), and all six are whole, none of them waiting out a timeout (the
    queue's would be a 429 after 20 s)."""
    c = cluster_of_two
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 100, "stream": True}  # ~1 s each
    records = [StreamRecord() for _ in range(6)]
    clients = [threading.Thread(target=c.nodes[0].call,
                                args=(read_stream, c.url + "/v1/completions", body, AUTH, record))
               for record in records]
    for thread in clients:
        thread.start()
    try:
        # the two served have streamed their first event: a decode request holds its slot from
        # before its prefill, so a host cut off before that first byte is failed over (all six
        # ok: the fresh-clone run of 6c75eb9 cut it that early once), not a stream broken mid-way
        wait_until(lambda: c.router.state.pool.queue_depth == 4 and sum(bool(r.events) for r in records) == 2, 20,
                   "four requests queued behind two that stream")
        c.nodes[1].cable(up=False)
        for thread in clients:
            thread.join(QUEUE_TIMEOUT_S + 20)
        assert all(r.ended for r in records), "a client still waits"
        outcomes = sorted("error" if "error" in r.events[-1] else "ok" for r in records)
        assert outcomes == ["ok"] * 6, [r.events[-1] for r in records]
        texts = ["".join(e["choices"][0]["text"] for e in r.events if e.get("choices")) for r in records]
        assert texts == ["".join(f"t{k} " for k in range(100))] * 6
    finally:
        c.nodes[1].cable(up=True)
        for thread in clients:
            thread.join(30)
    wait_until(lambda: not c.router.state.leaks(), 20, "the router to hold nothing")


@pytest.fixture
def cluster_of_two() -> Iterator[Cluster]:
    with _cluster(2) as running:
        yield running
