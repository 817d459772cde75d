"""Tracing (issue 14): one request through the router is one trace: the router's spans
(queue, prefill, handoff, decode), the ``traceparent`` the prefill server receives, and the
decode server's spans (kv_wait, engine_start, generation) under the router's queue span (where
the request's decode request took its slot),
exported over real OTLP (HTTP/protobuf and gRPC) to an in-process collector."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pd_http.tracing import otlp_tracing
from tests.fakes.otlp_collector import CollectedSpan, OtlpCollector
from tests.observability.conftest import MODEL

pytestmark = pytest.mark.timeout(90)

SERVER, CLIENT = 2, 3  # OTLP span kinds
ROUTER_SPANS = {"POST /v1/completions", "queue", "prefill", "handoff", "decode"}
DECODE_SPANS = {"POST /v1/completions", "kv_wait", "engine_start", "generation"}


def _by_name(spans: list[CollectedSpan], service: str) -> dict[str, CollectedSpan]:
    return {s.name: s for s in spans if s.service == service}


def _complete(spans: list[CollectedSpan]) -> bool:
    return (set(_by_name(spans, "pd-router")) >= ROUTER_SPANS
            and set(_by_name(spans, "pd-decode-server")) >= DECODE_SPANS)


@pytest.mark.parametrize("router_protocol", ["grpc", "http/protobuf"])
def test_one_request_is_one_trace_across_router_prefill_and_decode(collector: OtlpCollector, make_decode, make_rig,
                                                                    router_protocol: str):
    decode = make_decode(tracing=otlp_tracing(collector.http_endpoint, "http/protobuf", "pd-decode-server"))
    endpoint = collector.grpc_endpoint if router_protocol == "grpc" else collector.http_endpoint
    # the order whose spans follow one another (queue, prefill, handoff, then decode): the fake
    # prefill here has no KV channel to this real decode server, so the first token goes through
    # the router (a request asking for logprobs: the result posted from the prefill's answer)
    rig = make_rig(n_decode=0, decode_urls=(decode.url,), prefill={"model": MODEL},
                   otlp_traces_endpoint=endpoint, otlp_traces_protocol=router_protocol)
    resp = httpx.post(rig.url + "/v1/completions", timeout=30, headers={"X-Request-Id": "traced-1"},
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True, "logprobs": 1})
    assert resp.status_code == 200, resp.text
    assert resp.text.rstrip().endswith("data: [DONE]")

    router_tracing, decode_tracing = rig.state.tracing, decode.state.tracing
    assert router_tracing is not None and decode_tracing is not None
    spans = collector.wait_for(_complete, lambda: (router_tracing.force_flush(), decode_tracing.force_flush()))
    assert len({s.trace_id for s in spans}) == 1, "one request, one trace"
    router, dec = _by_name(spans, "pd-router"), _by_name(spans, "pd-decode-server")
    root = router["POST /v1/completions"]
    assert root.parent_span_id is None and root.kind == SERVER
    assert root.attributes["pd.request_id"] == "traced-1"
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["pd.stage"] == "decode"
    for name in ("queue", "prefill", "handoff", "decode"):
        assert router[name].parent_span_id == root.span_id, name
        assert root.start_ns <= router[name].start_ns <= router[name].end_ns <= root.end_ns, name
    assert router["prefill"].kind == CLIENT and router["decode"].kind == CLIENT
    assert router["queue"].end_ns <= router["prefill"].start_ns <= router["prefill"].end_ns <= router["decode"].start_ns
    assert router["queue"].attributes["pd.decode.backend"] == decode.url
    assert router["handoff"].attributes["pd.handoff.status"] == "sent"
    assert router["handoff"].attributes["pd.handoff.prompt_tokens"] == 5  # the fake prefill's answer

    # the prefill server got the prefill span as its parent (vLLM parents its request span on it)
    version, trace_id, parent_id, flags = rig.records(rig.prefills[0])["requests"][0]["traceparent"].split("-")
    assert (version, trace_id, parent_id) == ("00", root.trace_id, router["prefill"].span_id)
    assert int(flags, 16) & 1, "sampled"

    # the decode server's request span is a child of the router's queue span, where the request's
    # decode request took its slot before the prefill
    droot = dec["POST /v1/completions"]
    assert droot.kind == SERVER and droot.parent_span_id == router["queue"].span_id
    assert droot.attributes["pd.request_id"] == "traced-1" and droot.attributes["http.response.status_code"] == 200
    for name in ("kv_wait", "engine_start", "generation"):
        assert dec[name].parent_span_id == droot.span_id, name
        assert dec[name].status_code != 2, name
    assert dec["kv_wait"].end_ns <= dec["engine_start"].start_ns <= dec["engine_start"].end_ns
    assert dec["engine_start"].end_ns <= dec["generation"].start_ns
    generation = dec["generation"].attributes
    assert generation["pd.completion_tokens"] == 4 and generation["pd.finish_reason"] == "length"
    assert dec["kv_wait"].attributes["pd.handoff_id"] == "traced-1"
    rig.assert_no_leaks()
    decode.wait_idle()


def test_the_clients_trace_is_continued_and_failures_are_marked(collector: OtlpCollector, make_decode, make_rig):
    decode = make_decode(tracing=otlp_tracing(collector.http_endpoint, "http/protobuf", "pd-decode-server"))
    rig = make_rig(n_decode=0, decode_urls=(decode.url,), prefill={"model": MODEL},
                   otlp_traces_endpoint=collector.http_endpoint, otlp_traces_protocol="http/protobuf")
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    resp = httpx.post(rig.url + "/v1/chat/completions", timeout=30,
                      headers={"traceparent": f"00-{client_trace}-{client_span}-01"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                            "logprobs": True})  # (its result posted, as above)
    assert resp.status_code == 200, resp.text
    tracing = rig.state.tracing
    assert tracing is not None
    flush = tracing.force_flush
    spans = collector.wait_for(lambda s: "decode" in _by_name(s, "pd-router"), flush)
    root = _by_name(spans, "pd-router")["POST /v1/chat/completions"]
    assert (root.trace_id, root.parent_span_id) == (client_trace, client_span)

    rig.config(rig.prefills[0], fail="status", fail_status=500, fail_body='{"error": "boom"}', fail_times=1)
    resp = httpx.post(rig.url + "/v1/completions", timeout=30, headers={"X-Request-Id": "broken"},
                      json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 502
    spans = collector.wait_for(
        lambda s: any(x.attributes.get("pd.request_id") == "broken" for x in s), flush)
    root = next(s for s in spans if s.attributes.get("pd.request_id") == "broken")
    prefill = next(s for s in spans if s.name == "prefill" and s.trace_id == root.trace_id)
    assert root.status_code == 2 and root.attributes["error.type"] == "bad_upstream_response"
    assert root.attributes["pd.stage"] == "prefill"
    assert prefill.status_code == 2 and prefill.attributes["error.type"] == "bad_upstream_response"
    rig.assert_no_leaks()


def test_tracing_off_creates_nothing_and_sends_no_traceparent(make_rig):
    rig = make_rig()
    assert rig.state.tracing is None
    resp = httpx.post(rig.url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True})
    assert resp.status_code == 200
    assert rig.records(rig.prefills[0])["requests"][0]["traceparent"] is None
    assert "traceparent" not in {k.lower() for k in resp.headers}


def test_a_queued_requests_decode_request_is_in_its_trace_under_the_queue_span(collector: OtlpCollector,
                                                                                 make_decode, make_rig):
    """A request that waits for a slot waits with its own decode request in the decode server's
    queue (issue 34): that request carries the ``traceparent`` of the router's queue span, so the
    decode server's request span is in the client request's trace, under the span it waited in."""
    decode = make_decode(tracing=otlp_tracing(collector.http_endpoint, "http/protobuf", "pd-decode-server"), slots=1)
    # vLLM's answers held: the first request holds the one slot (its decode request waits for the
    # result the router posts from that answer: the first token's logprobs), the second one queues
    rig = make_rig(n_decode=0, decode_urls=(decode.url,), prefill={"model": MODEL, "hold_answer": True},
                   otlp_traces_endpoint=collector.http_endpoint, otlp_traces_protocol="http/protobuf")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(httpx.post, rig.url + "/v1/chat/completions", json=body, timeout=30,
                            headers={"X-Request-Id": "holder"})
        rig.wait(lambda: rig.records(rig.prefills[0])["active"] == ["holder"], what="the first prefill held")
        second = pool.submit(httpx.post, rig.url + "/v1/chat/completions", json=body, timeout=30,
                             headers={"X-Request-Id": "queued"})
        rig.wait(lambda: decode.state.slots.queued == 1, what="the second request in the decode server's queue")
        while not (first.done() and second.done()):  # each held answer, as it comes
            httpx.post(rig.prefills[0].url + "/fake/release")
            rig.wait(lambda: first.done() and second.done() or bool(rig.records(rig.prefills[0])["active"]),
                     what="an answer released, the next one held")
    assert first.result().status_code == second.result().status_code == 200, second.result().text

    router_tracing, decode_tracing = rig.state.tracing, decode.state.tracing
    assert router_tracing is not None and decode_tracing is not None

    def queued_trace(spans: list[CollectedSpan]) -> list[CollectedSpan]:
        root = next((s for s in spans if s.attributes.get("pd.request_id") == "queued"
                     and s.service == "pd-router" and s.parent_span_id is None), None)
        return [] if root is None else [s for s in spans if s.trace_id == root.trace_id]

    spans = collector.wait_for(lambda s: {"queue", "decode", "generation"} <= {x.name for x in queued_trace(s)},
                               lambda: (router_tracing.force_flush(), decode_tracing.force_flush()))
    trace = queued_trace(spans)
    queue_spans = {s.span_id for s in trace if s.service == "pd-router" and s.name == "queue"}
    served = [s for s in trace if s.service == "pd-decode-server" and s.kind == SERVER
              and s.attributes.get("http.response.status_code") == 200]
    assert len(served) == 1 and served[0].parent_span_id in queue_spans, (served, queue_spans)
    rig.assert_no_leaks()
    decode.wait_idle()
