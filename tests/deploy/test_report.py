"""summary.md from a fingerprint and the files AIPerf and lm-eval write: headline numbers per
run, a missing result said to be missing, absent versions with their reasons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pd_deploy.recipe import build_plan, parse_recipe
from pd_deploy.recipe.fingerprint import build_fingerprint, recipe_record
from pd_deploy.report.summary import render_summary
from tests.deploy.conftest import load_recipe_dict
from tests.deploy.entry_check import check_against_aiperf


def _record(start_ns: int, ttft_ms: float, latency_ms: float, out: int, prompt: int, chunks: list[float],
            phase: str = "profiling", error: bool = False) -> str:
    """One request as AIPerf 0.13 exports it (profile_export.jsonl), the fields read."""
    metrics = {"time_to_first_token": {"value": ttft_ms, "unit": "ms"},
               "request_latency": {"value": latency_ms, "unit": "ms"},
               "usage_completion_tokens": {"value": out, "unit": "tokens"},
               "usage_prompt_tokens": {"value": prompt, "unit": "tokens"},
               "inter_chunk_latency": {"value": chunks, "unit": "ms"}}
    record = {"metadata": {"benchmark_phase": phase, "request_start_ns": start_ns,
                           "request_end_ns": start_ns + int(latency_ms * 1e6), "was_cancelled": False},
              "metrics": {} if error else metrics}
    if error:
        record["error"] = {"code": 502, "message": "upstream"}
    return json.dumps(record)


def _recipe_with_benchmark(tmp_path: Path) -> tuple[dict, object]:
    data = load_recipe_dict("cpu-tiny.yaml")
    data["benchmark"] = {"entry": {"hw": "cpu", "framework": "vllm-reference", "precision": "bf16",
                                   "model_prefix": "tiny"},
                         "scenarios": [{"isl": 16, "osl": 8, "concurrency": [1, 2]}],
                         "gsm8k": {"data_path": "/shared/gsm8k", "limit": 4}}
    return data, parse_recipe(data)


def test_the_entry_is_aggregated_as_inferencex_does_and_summarised(tmp_path: Path) -> None:
    """A run's result file from AIPerf's per-request export: warm-ups and failed requests left
    out, every statistic as numpy computes it here, throughput per GPU unavailable with the
    reason on a CPU recipe; the summary's table per scenario; a missing run said so."""
    import numpy as np

    from pd_deploy.report.entry import LATENCIES, STATS, write_results

    data, recipe = _recipe_with_benchmark(tmp_path)
    plan = build_plan(recipe)
    fp = build_fingerprint(plan, recipe_record("cpu-tiny", "/r.yaml", yaml.safe_dump(data)), ["node0"],
                           str(tmp_path), job_id="7", live=False)
    run = tmp_path / "bench" / "aiperf-16_8-c1"
    run.mkdir(parents=True)
    t0 = 1_000_000_000_000
    measured = [(t0 + 10**9, 100.0, 170.0, 8, 15, [10.0, 0.0, 20.0]), (t0 + 2 * 10**9, 120.0, 160.0, 4, 16, [10.0]),
                (t0 + 3 * 10**9, 90.0, 90.0, 1, 13, [])]
    lines = [_record(t0, 500.0, 900.0, 8, 16, [50.0], phase="warmup")]
    lines += [_record(*m) for m in measured] + [_record(t0 + 4 * 10**9, 0, 5.0, 0, 0, [], error=True)]
    (run / "profile_export.jsonl").write_text("\n".join(lines) + "\n")
    (run / "server_metrics_export.json").write_text(json.dumps({"summary": {
        "endpoints_configured": fp.server_metrics, "endpoints_successful": fp.server_metrics[:2]}}))

    results = write_results(recipe, tmp_path)
    res = json.loads((tmp_path / "results" / "agg_tiny_16_8_conc1.json").read_text())
    assert results["agg_tiny_16_8_conc2.json"].startswith("FileNotFoundError")
    check_against_aiperf(res, run / "profile_export.jsonl", prefill_gpus=0, decode_gpus=0)
    ttft = np.array([m[1] for m in measured])
    tpot = np.array([(m[2] - m[1]) / (m[3] - 1) for m in measured if m[3] > 1])
    assert {f"{s}_{w}" for s in STATS for w in LATENCIES} <= set(res)
    assert res["duration_s"] == pytest.approx((measured[-1][0] + 90e6 - measured[0][0]) / 1e9)  # first sent, last done
    assert (res["requests"], res["failed_requests"], res["conc"], res["isl"], res["osl"]) == (3, 1, 1, 16, 8)
    assert (res["hw"], res["framework"], res["precision"], res["spec_decoding"], res["disagg"]) == (
        "cpu", "vllm-reference", "bf16", "mtp", True)

    text = render_summary(fp, tmp_path, dict(results))
    assert text.startswith("# cpu-tiny: job 7\n") and fp.recipe.sha256 in text
    assert "## Scenario 16_8: isl 16, osl 8" in text
    row = next(line for line in text.splitlines() if line.startswith("| 1 | 3 (1) |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2:6] == [f"{ttft.mean() / 1000:.4g}", f"{np.percentile(ttft, 99) / 1000:.4g}",
                          f"{tpot.mean():.4g}", f"{np.percentile(tpot, 99):.4g}"]
    assert cells[6] == f"{1000 / tpot.mean():.4g}" and (cells[9], cells[10]) == ("n/a[1]", "n/a[2]")
    assert cells[11:] == ["2/3", "`results/agg_tiny_16_8_conc1.json`"]
    assert "[1] the deployment has no prefill or decode GPU (a CPU recipe)" in text
    assert "[2] the deployment has no decode GPU (a CPU recipe)" in text
    assert "| 2 | no result: FileNotFoundError" in text
    # a dry run: no server reported its build info, and the summary says why
    for step in ("decode0", "prefill", "router"):
        assert f"| {step.rstrip('0')} | {step} | node0 | ?" in text
    assert "* no build info (decode0, prefill, router): dry run" in text


def test_throughput_per_gpu_counts_every_gpu_as_inferencex_does(tmp_path: Path) -> None:
    """The B200 recipe (8 prefill + 8 decode GPUs): total tokens over all 16, output tokens over
    the decode GPUs, input tokens over the prefill GPUs."""
    from pd_deploy.report.entry import aggregate

    data = load_recipe_dict("glm5.1-fp8-b200.yaml")
    data["benchmark"]["scenarios"] = [{"isl": 16, "osl": 8, "concurrency": [1]}]
    recipe = parse_recipe(data)
    export = tmp_path / "profile_export.jsonl"
    t0 = 5 * 10**12
    export.write_text("\n".join(_record(t0 + i * 10**8, 20.0 + i, 80.0 + 3 * i, 8 - i, 16 - i, [5.0, 6.0 + i])
                                for i in range(4)) + "\n")
    res = aggregate(recipe, recipe.benchmark.scenarios[0], 1, export).model_dump(mode="json")
    assert (res["num_prefill_gpu"], res["num_decode_gpu"], res["hw"], res["precision"]) == (8, 8, "b200", "fp8")
    assert (res["infmax_model_prefix"], res["framework"], res["is_multinode"]) == ("glm5.1", "vllm-tilert", True)
    check_against_aiperf(res, export, prefill_gpus=8, decode_gpus=8)


def _lm_eval(tmp_path: Path, strict: float, flexible: float, effective: int, original: int = 1319) -> None:
    out = tmp_path / "bench" / "gsm8k" / "model"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results_2026-12-03T00-00-00.json").write_text(json.dumps({
        "results": {"gsm8k_local": {"alias": "gsm8k_local", "exact_match,strict-match": strict,
                                    "exact_match_stderr,strict-match": 0.01, "exact_match,flexible-extract": flexible,
                                    "exact_match_stderr,flexible-extract": 0.01}},
        "n-samples": {"gsm8k_local": {"original": original, "effective": effective}}}))


@pytest.mark.parametrize(("limit", "threshold", "strict", "flexible", "effective", "verdict", "why"), [
    (None, None, 0.95, 0.94, 1319, "PASS", "both at or above 0.93"),
    (None, None, 0.93, 0.93, 1319, "PASS", "both at or above 0.93"),  # equal passes, as InferenceX's check
    (None, None, 0.95, 0.92, 1319, "FAIL", "flexible-extract below 0.93"),
    (None, 0.5, 0.6, 0.55, 1319, "PASS", "both at or above 0.5"),
    (None, None, 0.99, 0.99, 1300, "ERROR", "answered 1300 of the 1319 questions"),
    (40, None, 0.99, 0.99, 39, "ERROR", "answered 39 of the 40 questions"),
    (40, None, 0.99, 0.99, 40, "PASS", "both at or above 0.93"),
])
def test_gsm8k_is_graded_as_inferencex_grades_it(tmp_path: Path, limit, threshold, strict, flexible, effective,
                                                 verdict, why) -> None:
    from pd_deploy.recipe.schema import BenchmarkSpec
    from pd_deploy.report.evals import grade_gsm8k, gsm8k_section

    b = BenchmarkSpec.model_validate({
        "entry": {"model_prefix": "glm5.1"}, "scenarios": [{"isl": 1024, "osl": 1024, "concurrency": [1]}],
        "gsm8k": {"data_path": "/d", "limit": limit, "threshold": threshold}})
    assert grade_gsm8k(b, tmp_path).verdict == "ERROR"  # no results at all
    _lm_eval(tmp_path, strict, flexible, effective)
    grade = grade_gsm8k(b, tmp_path)
    assert (grade.verdict, grade.scores) == (verdict, {"strict-match": strict, "flexible-extract": flexible})
    assert why in grade.why
    text = "\n".join(gsm8k_section(grade))
    assert f"**{verdict}**: " in text and f"| strict-match | {strict:.4f} |" in text


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
