"""The observability of the real CPU stack (vLLM prefill + TileRTConnector + reference decode
server + router, real NIXL), one stack for both tests:

* a real Prometheus (Debian's ``prometheus``, installed by ``make system-deps``) scrapes the
  three servers with deploy/observability/prometheus.yml (targets and a 1 s interval
  swapped in) and evaluates alerts.yml; after traffic, every query of every panel of
  grafana-dashboard.json and every alert's quantity returns series, every rule evaluates
  without error, and the connector's and the KV receiver's figures have counted the traffic;
* every process sends its spans to one in-process OTLP collector: one request is one
  trace with the router's spans, vLLM's ``llm_request`` and the decode server's spans;
* last, the decode server killed: the no-ready-backend alert goes off for the decode role.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pd_deploy.stack.launcher import Stack
from tests.e2e.conftest import MODEL_NAME, make_stack_config, running_stack
from tests.fakes.otlp_collector import CollectedSpan, OtlpCollector
from tests.procs import free_port, server
from tests.test_metrics_doc import documented, exposed
from tests.waits import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "observability"
JOBS = ("pd-router", "pd-prefill", "pd-decode")
SERVER, CLIENT = 2, 3  # OTLP span kinds
# an alert's expression: "(QUANTITY) OP THRESHOLD" (alerts.yml says so)
ALERT = re.compile(r"\((?P<quantity>.*)\)\s*(?:>|<|>=|<=|==|!=)\s*-?[0-9.]+(?:e-?[0-9]+)?", re.DOTALL)


def _binary(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} is not installed: it is a Debian package (run 'make system-deps' as root)"
    return path


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel of the dashboard."""
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_promtool_accepts_the_config_and_the_rules():
    promtool = _binary("promtool")
    for args in (("check", "config", "prometheus.yml"), ("check", "rules", "alerts.yml")):
        done = subprocess.run([promtool, *args], cwd=DEPLOY, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    assert {r["alert"] for r in alert_rules()} == {"PDNoReadyBackend", "PDKVHandoffFailures", "PDQueueSaturated",
                                                   "PDTTFTSLO"}
    for rule in alert_rules():
        assert ALERT.fullmatch(rule["expr"].strip()), f"{rule['alert']}: not '(QUANTITY) OP THRESHOLD'"


def test_the_dashboard_is_a_grafana_dashboard_over_one_datasource_variable():
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert g["x"] + g["w"] <= 24 and not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] != "row":
            assert p["description"] and p["fieldConfig"]["defaults"]["unit"] and p["targets"], p["title"]
            for item in (p, *p["targets"]):
                assert item["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    titles = {p["title"] for p in panels}
    assert {"TTFT at the router", "Slot occupancy per decode server", "Prefill load (vLLM)", "KV handoff time",
            "KV bandwidth", "Failures by type", "Queue wait"} <= titles
    described = (DEPLOY.parents[1] / "docs" / "metrics.md").read_text()
    for p in panels:  # docs/metrics.md describes every panel, by its title
        assert (f"**{p['title']}.**" if p["type"] == "row" else f"*{p['title']}*") in described, p["title"]


@dataclass
class Observed:
    stack: Stack
    collector: OtlpCollector
    prometheus: str  # its URL


def _prometheus_config(stack: Stack, tmp: Path) -> Path:
    """The shipped prometheus.yml with the stack's targets, a 1 s interval and alerts.yml by path."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert [job["job_name"] for job in config["scrape_configs"]] == list(JOBS)
    cfg = stack.config
    targets = {"pd-router": [cfg.router_url], "pd-prefill": [cfg.prefill_url], "pd-decode": cfg.decode_urls}
    for job in config["scrape_configs"]:
        job["static_configs"][0]["targets"] = [url.removeprefix("http://") for url in targets[job["job_name"]]]
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / name) for name in config["rule_files"]]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def observed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("observed")
    collector = OtlpCollector().start()
    try:
        cfg = make_stack_config(tiny_model_dir, tmp / "logs", otlp_traces_endpoint=collector.grpc_endpoint)
        with running_stack(cfg) as stack:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            argv = [_binary("prometheus"), f"--config.file={_prometheus_config(stack, tmp)}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"]
            with server(argv, tmp / "prometheus.log", f"{url}/-/ready", 60):
                yield Observed(stack, collector, url)
    finally:
        collector.stop()


def _query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=10)
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", f"{promql}: {body.get('error', resp.text)}"
    return body["data"]["result"]


def _value(prometheus: str, promql: str) -> float:
    result = _query(prometheus, promql)
    return float(result[0]["value"][1]) if result else 0.0


def _traffic(url: str) -> None:
    """Streamed and plain completions and chats, and one request for a model nobody serves."""
    for i in range(4):
        body = {"model": MODEL_NAME, "prompt": "The quick brown fox " * (1 + 4 * i), "max_tokens": 12,
                "temperature": 0, "stream": i % 2 == 0}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
    resp = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True})
    assert resp.status_code == 200, resp.text
    assert httpx.post(url + "/v1/completions", json={"model": "nobody", "prompt": "x"}, timeout=30).status_code == 404


@pytest.mark.slow
def test_dashboard_and_alert_queries_return_series_from_a_real_prometheus(observed: Observed):
    prom, cfg = observed.prometheus, observed.stack.config
    wait_until(lambda: len(_query(prom, "up == 1")) == 2 + len(cfg.decode_urls), 60, "every target scraped and up")
    _traffic(cfg.router_url)
    # the traffic counted everywhere: the connector's stats on vLLM's /metrics (its job), the receiver's
    # on the decode server's, the router's token counter with the model name
    counted = {
        'sum(vllm:tilert_kv_handoffs_total{job="pd-prefill",outcome="posted"})': 5,
        'sum(vllm:tilert_kv_posted_bytes_total{job="pd-prefill"})': 1,
        'sum(vllm:tilert_kv_post_seconds_count{job="pd-prefill"})': 5,
        'sum(vllm:tilert_kv_transport_bytes_total{job="pd-prefill"})': 1,
        'sum(decode_server_kv_handoffs_total{job="pd-decode",outcome="complete"})': 5,
        'sum(decode_server_kv_received_bytes_total{job="pd-decode"})': 1,
        'sum(decode_server_kv_wait_seconds_count{job="pd-decode"})': 5,
        'sum(decode_server_kv_handoff_seconds_count{job="pd-decode"})': 5,
        f'sum(pd_router_prompt_tokens_total{{model_name="{MODEL_NAME}"}})': 5,
        f'sum(decode_server_generation_tokens_total{{model_name="{MODEL_NAME}"}})': 5,
    }
    for promql, least in counted.items():
        wait_until(lambda q=promql, n=least: _value(prom, q) >= n, 30, f"{promql} >= {least}")
    # the connector's metrics on vLLM's /metrics are the ones docs/metrics.md lists
    connector = exposed(httpx.get(cfg.prefill_url + "/metrics", timeout=10).text, "vllm:tilert_")
    assert connector == documented("vllm:tilert_") and "vllm:tilert_kv_failures_total" in connector
    # what prefill posted is what the decode server received
    assert _value(prom, 'sum(vllm:tilert_kv_posted_bytes_total)') == _value(
        prom, 'sum(decode_server_kv_received_bytes_total)')

    for title, promql in panel_queries():
        wait_until(lambda q=promql: _query(prom, q), 30, f"panel {title!r}: series for {promql}")
    rules = alert_rules()
    for rule in rules:
        match = ALERT.fullmatch(rule["expr"].strip())
        assert match, rule["alert"]
        quantity = match["quantity"]
        wait_until(lambda q=quantity: _query(prom, q), 30, f"alert {rule['alert']}: series for {quantity}")

    def evaluated() -> list[dict[str, Any]]:
        groups = httpx.get(f"{prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
        loaded = [r for g in groups for r in g["rules"]]
        done = [r for r in loaded if r.get("lastEvaluation", "").startswith("20")]
        return loaded if len(done) == len(rules) else []

    wait_until(evaluated, 30, "every alert rule evaluated")
    for rule in evaluated():
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
        # a healthy stack: every backend ready, no failed handoff, an empty queue (the CPU stack's
        # TTFT, on a loaded machine, may be over the SLO: pending at most, its "for" is 5 min)
        allowed = ("inactive", "pending") if rule["name"] == "PDTTFTSLO" else ("inactive",)
        assert rule["state"] in allowed, (rule["name"], rule["state"])


def _one_trace(spans: list[CollectedSpan], request_id: str) -> list[CollectedSpan]:
    root = next((s for s in spans if s.attributes.get("pd.request_id") == request_id and s.service == "pd-router"
                 and s.parent_span_id is None), None)
    return [] if root is None else [s for s in spans if s.trace_id == root.trace_id]


@pytest.mark.slow
def test_one_request_is_one_trace_across_router_vllm_and_decode_server(observed: Observed):
    cfg, collector = observed.stack.config, observed.collector
    rid = "one-trace-3-processes"
    resp = httpx.post(cfg.router_url + "/v1/completions", headers={"X-Request-Id": rid}, timeout=120,
                      json={"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 6, "stream": True,
                            "ignore_eos": True})
    assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]"), resp.text

    def complete(spans: list[CollectedSpan]) -> bool:
        names = {(s.service, s.name) for s in _one_trace(spans, rid)}
        return {("pd-router", "decode"), ("pd-decode-server", "generation")} <= names and any(
            n == "llm_request" for _, n in names)

    # the processes export on their own schedule (batches every few seconds): nothing to flush from here
    spans = _one_trace(collector.wait_for(complete, lambda: None, timeout=60), rid)
    router = {s.name: s for s in spans if s.service == "pd-router"}
    dec = {s.name: s for s in spans if s.service == "pd-decode-server"}
    vllm = [s for s in spans if s.name == "llm_request"]
    root = router["POST /v1/completions"]
    assert root.kind == SERVER and root.attributes["http.response.status_code"] == 200
    for name in ("queue", "prefill", "handoff", "decode"):
        assert router[name].parent_span_id == root.span_id, name
    # vLLM's request span is a child of the router's prefill span
    assert len(vllm) == 1 and vllm[0].service not in ("pd-router", "pd-decode-server")
    assert vllm[0].parent_span_id == router["prefill"].span_id
    # the decode server's request span is a child of the router's queue span (where the decode
    # request took its slot, before the prefill), its stages children of it
    droot = dec["POST /v1/completions"]
    assert droot.kind == SERVER and droot.parent_span_id == router["queue"].span_id
    assert droot.attributes["pd.request_id"] == rid
    for name in ("kv_wait", "engine_start", "generation"):
        assert dec[name].parent_span_id == droot.span_id, name
    assert dec["generation"].attributes["pd.completion_tokens"] == 6
    assert router["handoff"].attributes["pd.handoff.status"] in ("sent", "pending")
    assert {s.trace_id for s in spans} == {root.trace_id}


@pytest.mark.slow
def test_the_no_ready_backend_alert_goes_off_when_the_decode_server_dies(observed: Observed):
    """Last in this module: it kills the stack's decode server. Its alert turns pending (its
    expression holds) for the decode role only, within a few probes and evaluations."""
    prom, stack = observed.prometheus, observed.stack
    decode = next(p for p in stack.processes if p.name == "decode-0")
    os.killpg(decode.pid, signal.SIGKILL)

    def alerting() -> list[dict[str, Any]]:
        alerts = httpx.get(f"{prom}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "PDNoReadyBackend"]

    wait_until(alerting, 60, "PDNoReadyBackend pending or firing")
    assert [(a["labels"]["role"], a["state"] in ("pending", "firing")) for a in alerting()] == [("decode", True)]
