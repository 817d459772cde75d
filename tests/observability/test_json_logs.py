"""JSON logs (issue 14): ``--log-format json`` makes every line one JSON object; every line
of a request carries its request id and, with tracing on, its trace id (the one its spans
have); each request has one access line with its status, the stage it reached and its
latency."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import httpx
import pytest

from pd_deploy.commands import RouterSpec, router_argv
from pd_http.logs import JsonFormatter
from pd_http.tracing import otlp_tracing
from tests.fakes.fake_backends import FakeDecode, FakePrefill, ServerThread
from tests.fakes.otlp_collector import OtlpCollector
from tests.procs import free_port, server
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(90)
KEYS = {"time", "level", "logger", "message"}


def _parse(text: str) -> list[dict[str, Any]]:
    lines = [line for line in text.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line, or the test fails here
    assert all(isinstance(r, dict) and KEYS <= r.keys() for r in records), records
    return records


def _access(records: list[dict[str, Any]], rid: str) -> dict[str, Any]:
    lines = [r for r in records if r.get("event") == "access" and r.get("request_id") == rid]
    assert len(lines) == 1, (rid, records)
    return lines[0]


def test_router_json_logs_parse_line_by_line_and_join_the_trace(tmp_path, collector: OtlpCollector):
    prefill = ServerThread(FakePrefill(model="tiny"), free_port()).start()
    decode = ServerThread(FakeDecode(model="tiny"), free_port()).start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = router_argv(RouterSpec((prefill.url,), (decode.url,), port=port, extra_args=(
        "--probe-interval", "0.2", "--log-format", "json", "--otlp-traces-endpoint", collector.http_endpoint,
        "--otlp-traces-protocol", "http/protobuf")))
    try:
        with server(argv, tmp_path / "router.log", url + "/ready", timeout=30) as proc:
            body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "stream": True}
            assert httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "json-ok"},
                              timeout=10).status_code == 200
            assert httpx.post(url + "/v1/completions", json={**body, "model": "nope"},
                              headers={"X-Request-Id": "json-404"}, timeout=10).status_code == 404
            httpx.post(decode.url + "/fake/config", json={"fail": "status"}, timeout=5).raise_for_status()
            assert httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "json-502"},
                              timeout=10).status_code == 502
            wait_until(lambda: "json-502" in httpx.get(decode.url + "/fake/records", timeout=5).json()["cancels"],
                       10.0, "the router's cancel of json-502")
            proc.stop()  # SIGTERM: drains, flushes the spans, stops
            records = _parse(proc.log_path.read_text())
    finally:
        prefill.stop()
        decode.stop()

    assert any(r["message"] == "Application shutdown complete." for r in records)  # uvicorn's own lines too
    assert any(r["logger"] == "pd_http.heap" and r["message"].startswith("router: ") for r in records), \
        "the router process froze its start-up heap"
    ok, missing, failed = (_access(records, rid) for rid in ("json-ok", "json-404", "json-502"))
    assert (ok["status"], ok["stage"], ok["endpoint"]) == (200, "decode", "/v1/completions")
    assert ok["latency_ms"] > 0 and ok["error_type"] is None
    assert 0 < ok["slot_ms"] < ok["ttft_ms"] <= ok["latency_ms"]
    assert missing["ttft_ms"] is None and failed["ttft_ms"] is None  # no token reached the client
    assert missing["slot_ms"] is None and 0 < failed["slot_ms"]  # 404 before any slot; 502 after one
    assert (missing["status"], missing["error_type"]) == (404, "model_not_found")
    assert (failed["status"], failed["stage"], failed["error_type"]) == (502, "decode", "bad_upstream_response")
    request_lines = [r for r in records if "request_id" in r]
    assert {r["request_id"] for r in request_lines} == {"json-ok", "json-404", "json-502"}
    assert all(len(r.get("trace_id", "")) == 32 for r in request_lines), request_lines
    assert any(r["request_id"] == "json-502" and "cancel on" in r["message"] for r in request_lines), \
        "the cancel's line (a task the request spawned) carries the request's ids"
    roots = {s.attributes["pd.request_id"]: s.trace_id for s in collector.spans() if s.parent_span_id is None}
    assert {r["request_id"]: r["trace_id"] for r in request_lines} == roots


def test_decode_server_json_logs(make_decode, collector: OtlpCollector):
    decode = make_decode(tracing=otlp_tracing(collector.http_endpoint, "http/protobuf", "pd-decode-server"))
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    root, access = logging.getLogger(), logging.getLogger("decode_server.access")
    level = access.level
    root.addHandler(handler)
    access.setLevel(logging.INFO)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        kv = {"handoff_id": "dec-ok", "kv_endpoint": "127.0.0.1:1", "num_prompt_tokens": 5, "first_token_id": 7,
              "last_prompt_token_id": 3, "status": "sent"}
        resp = httpx.post(decode.url + "/v1/completions", timeout=10,
                          headers={"X-Request-Id": "dec-ok", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
                          json={"prompt": "x", "max_tokens": 3, "kv_transfer_params": kv})
        assert resp.status_code == 200, resp.text
        resp = httpx.post(decode.url + "/v1/completions", timeout=10, headers={"X-Request-Id": "dec-bad"},
                          json={"prompt": "x", "max_tokens": 3})
        assert resp.status_code == 400
        decode.wait_idle()
    finally:
        root.removeHandler(handler)
        access.setLevel(level)
    records = _parse(out.getvalue())
    ok, bad = _access(records, "dec-ok"), _access(records, "dec-bad")
    assert (ok["status"], ok["stage"], ok["trace_id"]) == (200, "done", trace_id)
    assert ok["latency_ms"] > 0
    assert (bad["status"], bad["stage"], bad["error_type"]) == (400, "validating", "invalid_request_error")
    assert len(bad["trace_id"]) == 32 and bad["trace_id"] != trace_id  # a trace of its own
