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
