"""The real PD stack across three nodes (tests/multinode/stack.py): vLLM prefill with
TileRTConnector and the router on node 0, reference decode servers on nodes 1 and 2, every
role on its node's address, API key and KV secret on, UCX choosing its transport; node 2's
cable is the link emulator's (tests/link_emulator.py), node 1's a veth pair. One stack for
the module: greedy output as vLLM alone's, both decode nodes serving; the KV across a
lossy, slow link; then a decode node's link pulled mid-stream (the answer goes on on the other
node) and mid-transfer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pd_router.answers import ReadinessReport
from tests.e2e.agents.test_tools import CALL_WEATHER, WEATHER
from tests.e2e.prompts import long_prompt
from tests.e2e.test_equivalence import assert_matches_vllm_alone, poster
from tests.multinode.stack import API_KEY, NodeStack, node_stack
from tests.multinode.streams import StreamRecord, read_stream
from tests.nodes import Node
from tests.stream_choices import choices_of, each_choice_streams
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
DEAD_PEER_S = 4.0
LOSSY = 2  # node 2's cable is the link emulator's (tests/link_emulator.py): clean unless impaired


@pytest.fixture(scope="module")
def stack3(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeStack]:
    with node_stack(tiny_model_dir, tmp_path_factory.mktemp("multinode-logs"), dead_peer_s=DEAD_PEER_S,
                    emulated=frozenset({LOSSY})) as stack:
        yield stack


def _all_healthy(stack: NodeStack) -> None:
    """Wait until the router counts every backend usable again: after a test cut a link, or after
    vLLM alone, decoding on this host's 2 cores, starved the prefill's probes."""
    def healthy() -> bool:
        report = _report(stack)
        return all(b.healthy for b in [*report.prefill, *report.decode])

    wait_until(healthy, 60, "every backend healthy at the router")


@pytest.fixture(autouse=True)
def _every_backend_healthy(stack3: NodeStack) -> None:
    """Each test starts with every backend usable: one test's fault is not the next one's."""
    _all_healthy(stack3)


def _served(stack: NodeStack, node: Node) -> float:
    """Requests the node's decode server answered 200 (not one refused 429 at once: a router
    whose count said the slot was free asks there with its decode request)."""
    lines = stack.get(stack.decode_url(node) + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("decode_server_requests_total{") and 'status="200"' in line)


def test_greedy_output_as_vllm_alone_with_both_decode_nodes_serving(stack3: NodeStack, vllm_alone: str) -> None:
    assert_matches_vllm_alone(lambda path, body: stack3.post(path, body), poster(vllm_alone), stack3.model_name)
    # one slot per decode server: with one node's slot taken (held by the test, as by another
    # router), the request is the other node's; so each node serves once, as vLLM alone answers
    alone = poster(vllm_alone)
    for i, node in enumerate(stack3.decode_nodes):
        other = next(n for n in stack3.decode_nodes if n is not node)
        body = {"model": stack3.model_name, "prompt": f"Request {i}: the quick brown fox", "max_tokens": 48,
                "temperature": 0, "ignore_eos": True}
        before = {n.index: _served(stack3, n) for n in stack3.decode_nodes}
        with stack3.held_slot(other):
            resp = stack3.post("/v1/completions", body)
        assert resp.status_code == 200, resp.text
        served = {n.index: _served(stack3, n) - before[n.index] for n in stack3.decode_nodes}
        assert served == {node.index: 1, other.index: 0}, f"served per node, {other.name}'s slot held: {served}"
        assert resp.json()["choices"][0]["text"] == alone("/v1/completions", body).json()["choices"][0]["text"]
    for node in stack3.decode_nodes:  # every peer of a decode server came from node 0's address
        peers = stack3.capabilities(node).peers
        assert peers and all(p.state == "ok" for p in peers), peers
        assert stack3.capabilities(node).kv_endpoint == f"{node.name}:9100"


def _handoff_tokens(stack: NodeStack, kv: str) -> float:
    """Prompt tokens of the completed handoffs whose KV was ``kv`` (pushed, reused), both nodes."""
    name = "decode_server_kv_handoff_tokens_total"
    return sum(float(line.rsplit(" ", 1)[1]) for node in stack.decode_nodes
               for line in stack.get(stack.decode_url(node) + "/metrics").text.splitlines()
               if line.startswith(name + "{") and f'kv="{kv}"' in line)


def test_an_agent_session_across_hosts_moves_only_its_new_kv(stack3: NodeStack, vllm_alone: str) -> None:
    """A conversation's turns (token ids: the last prompt, its answer, 70 new ids) across the
    nodes, KV secret on: from the second turn on, the decode node that kept the last turn's KV
    serves it and only the KV past what it kept crosses the link, the answers vLLM alone's."""
    alone = poster(vllm_alone)
    prompt, new, reusing = [100 + (i * 37) % 800 for i in range(150)], [], 0
    for turn in range(3):
        body = {"model": stack3.model_name, "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 0,
                "return_tokens_as_token_ids": True}
        pushed, reused = _handoff_tokens(stack3, "pushed"), _handoff_tokens(stack3, "reused")
        resp = stack3.post("/v1/completions", body)
        assert resp.status_code == 200, resp.text
        pushed, reused = _handoff_tokens(stack3, "pushed") - pushed, _handoff_tokens(stack3, "reused") - reused
        ids = [int(t.split(":", 1)[1]) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]
        want = alone("/v1/completions", body).json()["choices"][0]["logprobs"]["tokens"]
        assert ids == [int(t.split(":", 1)[1]) for t in want]
        if reused:  # on the node keeping the last turn (a rare routing miss pushes in full, once at most)
            assert pushed <= len(new) + 64, (turn, pushed, reused)
            reusing += 1
        new = [100 + (turn * 91 + i * 13) % 800 for i in range(70)]
        prompt = prompt + ids + new
    assert reusing >= 1


def test_kv_across_a_lossy_slow_link(stack3: NodeStack) -> None:
    """1% loss and 2 ms delay on decode node 2's cable (both ways): every request succeeds with
    the clean link's output; the handoff times (admission to KV complete, prefill's compute
    included) are printed beside the clean link's (the link alone: bench/kv_link.py)."""
    node = stack3.nodes[LOSSY]
    other = next(n for n in stack3.decode_nodes if n is not node)
    link = stack3.nodes.link(LOSSY)
    url = stack3.decode_url(node)
    bodies = [{"model": stack3.model_name, "prompt": f"{i}: " + long_prompt(3000), "max_tokens": 8,
               "temperature": 0} for i in range(4)]

    def handoffs() -> tuple[list[str], float, float]:
        """The answers' texts, the mean handoff seconds and the KV bytes of one handoff."""
        n0, s0, b0 = (stack3.metric(url, "decode_server_kv_handoff_seconds_count"),
                      stack3.metric(url, "decode_server_kv_handoff_seconds_sum"),
                      stack3.metric(url, "decode_server_kv_received_bytes_total"))
        texts = []
        for body in bodies:
            resp = stack3.post("/v1/completions", body, timeout=300)
            assert resp.status_code == 200, resp.text
            texts.append(resp.json()["choices"][0]["text"])
        n = stack3.metric(url, "decode_server_kv_handoff_seconds_count") - n0
        assert n == len(bodies), f"{n} handoffs to {node.name} for {len(bodies)} requests"
        return (texts, (stack3.metric(url, "decode_server_kv_handoff_seconds_sum") - s0) / n,
                (stack3.metric(url, "decode_server_kv_received_bytes_total") - b0) / n)

    with stack3.held_slot(other):  # every request is node 2's
        clean, clean_s, kv_bytes = handoffs()
        _, dropped_before = link.stats()
        link.impair(loss=0.01, delay_s=0.002)
        try:
            lossy, lossy_s, _ = handoffs()
            _, dropped = link.stats()
        finally:
            link.impair()
    assert dropped > dropped_before, "the link emulator dropped no frame: the loss was not in force"
    assert lossy == clean
    # what carried the KV, as the connector reports it on vLLM's /metrics: TCP over the nodes' link
    wait_until(lambda: _carried(stack3), 30, "the prefill reporting its handoffs' transport")
    assert set(_carried(stack3)) == {"tcp/eth0"}, _carried(stack3)
    print(f"\nKV handoff ({kv_bytes / 1e6:.2f} MB) to {node.name}: clean link {clean_s * 1e3:.1f} ms, "
          f"1% loss + 2 ms delay {lossy_s * 1e3:.1f} ms (mean of {len(bodies)}; {dropped - dropped_before} "
          f"frames dropped)")


def _carried(stack: NodeStack) -> dict[str, float]:
    """KV bytes of the landed handoffs by what carried them (vllm:tilert_kv_transport_bytes_total)."""
    found: dict[str, float] = {}
    for line in stack.get(stack.prefill_url + "/metrics").text.splitlines():
        if line.startswith("vllm:tilert_kv_transport_bytes_total{"):
            transport = line.split('transport="', 1)[1].split('"', 1)[0]
            found[transport] = found.get(transport, 0.0) + float(line.rsplit(" ", 1)[1])
    return {t: n for t, n in found.items() if n}


def _serving(stack: NodeStack, several: bool = False) -> Node:
    """The decode node whose slot is busy (asked on each node itself); ``several``: the first of
    those busy."""
    busy = [n for n in stack.decode_nodes if stack.capabilities(n, from_node=n).busy_slots]
    assert busy and (several or len(busy) == 1), f"{len(busy)} decode nodes busy"
    return busy[0]


def _logs(stack: NodeStack) -> str:
    """The last lines of every process's log, for a failure's message."""
    return "\n".join(f"--- {name}:\n{proc.log_tail(30)}" for name, proc in stack.processes.items())


def _report(stack: NodeStack) -> ReadinessReport:
    return ReadinessReport.model_validate_json(
        stack.from_head(lambda: httpx.get(stack.router_url + "/ready", timeout=5)).content)


MID_STREAM = {
    # long enough to be cut mid-way: the pull comes after a few events and the nodes' own answers
    "completion": ("/v1/completions", {"prompt": "Count: one, two, three,", "max_tokens": 1000}),
    "chat, n = 2, logprobs": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 1500, "n": 2,
        "logprobs": True, "top_logprobs": 1}),
    # (vLLM alone, without GLM's tool parser, would answer the call as text: the uninterrupted answer only)
    "chat, structured output and a tool call": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 1600, "tools": [WEATHER],
        "ignore_eos": False, "structured_outputs": {"regex": "([a-z]{1,8} ){120,140}" + CALL_WEATHER}}),
}


@pytest.mark.parametrize("case", MID_STREAM)
def test_a_decode_nodes_link_down_mid_stream(stack3: NodeStack, vllm_alone: str, case: str) -> None:
    """The serving decode node's cable pulled mid-stream: the stream completes on the other node,
    greedy as the same request uninterrupted and as vLLM alone (with n = 2, one choice per node:
    only the lost choice moves, once the other's slot is free); the lost node, on its own, frees
    its slots, vLLM its KV blocks, /ready names the node unreachable; with the cable back the same
    node serves again without a restart."""
    path, extra = MID_STREAM[case]
    body = {"model": stack3.model_name, "stream": True, "ignore_eos": True, "temperature": 0, **extra}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    whole = StreamRecord()
    stack3.from_head(read_stream, stack3.router_url + path, body, headers, whole)
    expected = choices_of(whole.events)
    assert -1 not in expected, expected[-1]
    if "tools" not in body:  # (vLLM refuses greedy n > 1: its one choice is each of ours)
        alone = poster(vllm_alone)(path, {k: v for k, v in body.items() if k != "n"} | {"stream": False})
        assert alone.status_code == 200, alone.text
        [c] = alone.json()["choices"]
        assert all((c.get("text") or c["message"]["content"]) == e["text"] for i, e in expected.items())
        _all_healthy(stack3)
    else:
        assert expected[0]["calls"].startswith("get_weather") and expected[0]["finish"] == "tool_calls", expected
    record = StreamRecord()
    events, ended = record.events, record.ended
    served = {n.index: _served(stack3, n) for n in stack3.decode_nodes}
    moved = stack3.metric(stack3.router_url, "pd_router_migration_seconds_count")
    client = threading.Thread(target=stack3.from_head, args=(read_stream, stack3.router_url + path, body, headers,
                                                             record))
    client.start()
    node: Node | None = None
    try:
        try:
            wait_until(lambda: len(events) >= 6 and each_choice_streams(events, body.get("n", 1)) or ended, 120,
                       "the first tokens of each choice")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; events so far: {events}\n{_logs(stack3)}") from None
        assert len(events) >= 6 and not ended, f"the stream ended after {len(events)} events\n{_logs(stack3)}"
        node = _serving(stack3, several=True)
        other = next(n for n in stack3.decode_nodes if n is not node)
        node.cable(up=False)
        client.join(120)
        assert ended, "the client still waits, 120 s after the decode node's link went down"
        assert choices_of(events) == expected, f"{choices_of(events).get(-1)}\n{_logs(stack3)}"
        assert stack3.metric(stack3.router_url, "pd_router_migration_seconds_count") == moved + 1
        assert _served(stack3, other) >= served[other.index] + 1  # the rest of the answer (n = 2: and its own)
        # the decode node, on its own: its generation ended and both its slots are free
        wait_until(lambda: (c := stack3.capabilities(node, from_node=node)).busy_slots == 0 and
                   c.kv_busy_slots == 0, DEAD_PEER_S + 5, "the decode node to free its slots")
        wait_until(lambda: stack3.metric(stack3.prefill_url, "vllm:kv_cache_usage_perc") == 0, 30,
                   "vLLM to free the request's KV blocks")
        wait_until(lambda: any(d.url.endswith(f"{node.name}:8200") and not d.healthy for d in _report(stack3).decode),
                   10, "/ready to name the decode node unreachable")
    finally:
        if node is not None:
            node.cable(up=True)
        client.join(30)
    wait_until(lambda: all(d.healthy for d in _report(stack3).decode), 30, "/ready once the link is back")
    before = _served(stack3, node)
    deadline = time.monotonic() + 60
    while _served(stack3, node) == before:  # least-loaded: within a few requests it is the node's turn
        assert time.monotonic() < deadline, "the node never served again after its link came back"
        resp = stack3.post("/v1/completions", {"model": stack3.model_name, "prompt": "Hello", "max_tokens": 4})
        assert resp.status_code == 200, resp.text


def test_a_decode_nodes_link_down_during_the_kv_transfer(stack3: NodeStack) -> None:
    """The cable of the decode node receiving a prompt's KV is pulled once its receiver has
    admitted the handoff (before any token): the request is served by the other decode node
    (failover before the first byte) or fails with an OpenAI error; either way nothing is
    left held on either decode node, in vLLM or in the router."""
    prompt = long_prompt(9000) + "\nIn summary,"  # ~2.7k tokens: seconds of prefill on a CPU
    answer: list[httpx.Response] = []
    client = threading.Thread(target=lambda: answer.append(stack3.post(
        "/v1/completions", {"model": stack3.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=300)))
    t0 = time.monotonic()
    client.start()
    node: Node | None = None
    try:
        found: list[Node] = []

        def receiving() -> bool:  # asked on each node itself; the one found is kept
            found.extend(n for n in stack3.decode_nodes if stack3.capabilities(n, from_node=n).kv_busy_slots)
            return bool(found)

        wait_until(receiving, 120, "a decode node to admit the KV")
        node = found[0]
        node.cable(up=False)
        client.join(240)
        assert answer, "no answer 240 s after the KV link went down"
        resp = answer[0]
        took = time.monotonic() - t0
        print(f"\nKV link down mid-transfer: {resp.status_code} after {took:.1f}s: {resp.text[:300]}")
        if resp.status_code != 200:
            assert resp.json()["error"]["type"] and resp.json()["error"]["message"], resp.text
        wait_until(lambda: all((c := stack3.capabilities(n, from_node=n)).busy_slots == 0 and c.kv_busy_slots == 0
                               for n in stack3.decode_nodes), 60, "both decode nodes to hold nothing")
        wait_until(lambda: stack3.metric(stack3.prefill_url, "vllm:kv_cache_usage_perc") == 0, 60,
                   "vLLM to free the request's KV blocks")
        wait_until(lambda: stack3.metric(stack3.router_url, "pd_router_in_flight_requests") == 0, 30,
                   "the router to hold no request")
        assert resp.status_code in (200, 502, 503, 504), resp.text
    finally:
        if node is not None:
            node.cable(up=True)
        client.join(30)
    wait_until(lambda: all(d.healthy for d in _report(stack3).decode), 60, "/ready once the link is back")
    ok = stack3.post("/v1/completions", {"model": stack3.model_name, "prompt": "Hello", "max_tokens": 4})
    assert ok.status_code == 200, ok.text
