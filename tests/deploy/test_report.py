"""summary.md from a fingerprint and the files AIPerf and lm-eval write: headline numbers per
run, a missing result said to be missing, absent versions with their reasons."""

from __future__ import annotations

import json
from pathlib import Path

from pd_deploy.recipe import build_plan, parse_recipe
from pd_deploy.report.fingerprint import build_fingerprint, recipe_record
from pd_deploy.report.summary import render_summary
from tests.deploy.conftest import load_recipe_dict


def test_summary_puts_the_numbers_next_to_what_ran(tmp_path: Path) -> None:
    data = load_recipe_dict("cpu-tiny.yaml")
    data["benchmark"] = {"isl": 16, "osl": 8, "concurrency": [1, 2],
                         "gsm8k": {"data_path": "/shared/gsm8k", "limit": 4}}
    plan = build_plan(parse_recipe(data))
    fp = build_fingerprint(plan, recipe_record("cpu-tiny", "/r.yaml", "name: cpu-tiny\n"), ["node0"], str(tmp_path),
                           job_id="7", live=False)
    run = tmp_path / "bench" / "aiperf-c1"
    run.mkdir(parents=True)
    metric = {"unit": "ms", "avg": 12.5, "p50": 12.0, "p99": 20.0}
    (run / "profile_export_aiperf.json").write_text(json.dumps({
        "aiperf_version": "0.13.0", "request_count": {"unit": "requests", "avg": 20},
        "request_throughput": {"unit": "requests/sec", "avg": 3.25}, "output_token_throughput": {"unit": "t/s",
                                                                                                 "avg": 26.0},
        "time_to_first_token": metric, "inter_token_latency": metric, "request_latency": metric}))
    (run / "server_metrics_export.json").write_text(json.dumps({"summary": {
        "endpoints_configured": fp.server_metrics, "endpoints_successful": fp.server_metrics[:2]}}))
    results = tmp_path / "bench" / "gsm8k" / "tiny"
    results.mkdir(parents=True)
    (results / "results_2026.json").write_text(json.dumps({"results": {"gsm8k_local": {
        "alias": "gsm8k_local", "exact_match,strict-match": 0.75, "exact_match_stderr,strict-match": 0.1}}}))

    text = render_summary(fp, tmp_path)
    assert text.startswith("# cpu-tiny: job 7\n") and fp.recipe.sha256 in text
    assert "| 1 | 20 | 3.25 | 26 | 12.5 | 20 | 12.5 | 12.5 | 2/3 |" in text
    assert "| 2 | no profile_export_aiperf.json: FileNotFoundError |" in text
    assert "| gsm8k_local | exact_match,strict-match | 0.75 |" in text and "stderr" not in text
    # a dry run: no server reported its build info, and the summary says why
    for step in ("decode0", "prefill", "router"):
        assert f"| {step.rstrip('0')} | {step} | node0 | ?" in text
    assert "* no build info (decode0, prefill, router): dry run" in text


_PREFILL_METRICS = """# HELP vllm:tilert_kv_transport_bytes_total KV bytes of the handoffs that landed
# TYPE vllm:tilert_kv_transport_bytes_total counter
vllm:tilert_kv_transport_bytes_total{engine="0",model_name="m",transport="tcp/eth0"} 3.0e+09
vllm:tilert_kv_transport_bytes_total{engine="0",model_name="m",transport="rc_mlx5/mlx5_0:1"} 1.0e+09
# HELP vllm:tilert_kv_write_seconds Per handoff and rank
# TYPE vllm:tilert_kv_write_seconds histogram
vllm:tilert_kv_write_seconds_bucket{engine="0",le="+Inf",model_name="m",transport="tcp/eth0"} 3.0
vllm:tilert_kv_write_seconds_count{engine="0",model_name="m",transport="tcp/eth0"} 3.0
vllm:tilert_kv_write_seconds_sum{engine="0",model_name="m",transport="tcp/eth0"} 6.0
vllm:tilert_kv_write_seconds_bucket{engine="0",le="+Inf",model_name="m",transport="rc_mlx5/mlx5_0:1"} 1.0
vllm:tilert_kv_write_seconds_count{engine="0",model_name="m",transport="rc_mlx5/mlx5_0:1"} 1.0
vllm:tilert_kv_write_seconds_sum{engine="0",model_name="m",transport="rc_mlx5/mlx5_0:1"} 0.05
"""
_DECODE_METRICS = """# TYPE decode_server_kv_received_bytes counter
decode_server_kv_received_bytes_total{model_name="m"} 4.0e+09
# TYPE decode_server_kv_handoff_seconds histogram
decode_server_kv_handoff_seconds_bucket{model_name="m",le="+Inf"} 4.0
decode_server_kv_handoff_seconds_count{model_name="m"} 4.0
decode_server_kv_handoff_seconds_sum{model_name="m"} 8.0
"""


def test_summary_says_what_carried_the_kv_and_flags_a_tcp_fallback(tmp_path: Path) -> None:
    """The KV transfer section from the servers' saved /metrics: per transport (prefill's
    connector) and per decode server; bytes carried otherwise than the recipe expects are
    flagged, a TCP fallback where RDMA was expected by name."""
    from pd_deploy.report.kv_transfer import METRICS_DIR, kv_section

    data = load_recipe_dict("cpu-tiny.yaml")
    plan = build_plan(parse_recipe(data))
    fp = build_fingerprint(plan, recipe_record("cpu-tiny", "/r.yaml", "name: cpu-tiny\n"), ["node0"], str(tmp_path),
                           job_id="7", live=False)
    (tmp_path / METRICS_DIR).mkdir()
    (tmp_path / METRICS_DIR / "prefill.prom").write_text(_PREFILL_METRICS)
    (tmp_path / METRICS_DIR / "decode0.prom").write_text(_DECODE_METRICS)

    text = "\n".join(kv_section(fp, tmp_path, "rdma"))
    assert "| tcp/eth0 | tcp | 3 | 2861 | 2000 | 0.5 |" in text, text  # 3e9 B in 6 s
    assert "| rc_mlx5/mlx5_0:1 | rdma | 1 | 953.7 | 50 | 20 |" in text, text
    assert "| decode0 | 4 | 3815 | 2000 | 0.5 |" in text, text
    assert "**FLAG: KV expected over rdma, but 2.79 GiB over tcp/eth0 (tcp) (a TCP fallback).**" in text
    tcp = "\n".join(kv_section(fp, tmp_path, "tcp"))
    assert "**FLAG: KV expected over tcp, but 0.931 GiB over rc_mlx5/mlx5_0:1 (rdma).**" in tcp
    assert "TCP fallback" not in tcp
    assert "Expected transport: any" in "\n".join(kv_section(fp, tmp_path, "any"))

    (tmp_path / METRICS_DIR / "prefill.prom").write_text(_PREFILL_METRICS.replace("rc_mlx5/mlx5_0:1", "tcp/eth0"))
    assert "Expected transport: tcp; every handoff went over it." in "\n".join(kv_section(fp, tmp_path, "tcp"))
    # a server whose /metrics could not be read is named; no landed handoff is said, not assumed
    (tmp_path / METRICS_DIR / "prefill.prom").unlink()
    text = "\n".join(kv_section(fp, tmp_path, "rdma"))
    assert "no /metrics saved from prefill" in text and "not checked: no handoff landed" in text
    # render_summary reads the recipe's expectation from the fingerprint
    assert "Expected transport: any" in render_summary(fp, tmp_path)
