"""``summary.md``: the benchmarks' headline numbers (AIPerf per concurrency, lm-eval gsm8k)
and the KV transfer (what carried the handoffs, how fast; :mod:`pd_deploy.report.kv_transfer`)
next to the fingerprint they ran under. Reads the files the tools and the summary step
write; a result that is missing is said to be missing."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from pd_build.info import ABSENT
from pd_deploy.report.kv_transfer import kv_section
from pd_deploy.report.model import Fingerprint

AIPERF_SUMMARY = "profile_export_aiperf.json"
AIPERF_SERVER_METRICS = "server_metrics_export.json"
_VERSIONS = ("version", "git_revision", "vllm", "nixl", "ucx", "torch", "cuda", "tilert", "gpu", "gpu_driver")


class AiperfMetric(BaseModel):
    """One metric of AIPerf's ``profile_export_aiperf.json`` (the fields read here)."""

    model_config = ConfigDict(extra="ignore")
    unit: str
    avg: float | None = None
    p50: float | None = None
    p99: float | None = None


class AiperfSummary(BaseModel):
    model_config = ConfigDict(extra="ignore")
    aiperf_version: str | None = None
    request_count: AiperfMetric | None = None
    request_throughput: AiperfMetric | None = None
    output_token_throughput: AiperfMetric | None = None
    time_to_first_token: AiperfMetric | None = None
    inter_token_latency: AiperfMetric | None = None
    request_latency: AiperfMetric | None = None


class ServerMetricsCollection(BaseModel):
    """``server_metrics_export.json``'s ``summary``: which /metrics AIPerf read."""

    model_config = ConfigDict(extra="ignore")
    endpoints_configured: list[str]
    endpoints_successful: list[str]


class ServerMetricsExport(BaseModel):
    model_config = ConfigDict(extra="ignore")
    summary: ServerMetricsCollection


def _num(metric: AiperfMetric | None, field: str = "avg") -> str:
    value = getattr(metric, field) if metric is not None else None
    return "-" if value is None else f"{value:.4g}"


def _what_ran(fp: Fingerprint) -> list[str]:
    lines = ["## What ran", "",
             "| role | step | host | " + " | ".join(_VERSIONS) + " | KV layout | model | config.json sha256 |",
             "|" + "---|" * (len(_VERSIONS) + 6)]
    why: dict[tuple[str, str], list[str]] = {}  # (field, reason) -> the steps it is absent from
    for s in fp.services:
        if not s.build:
            lines.append(f"| {s.role} | {s.id} | {s.host} | " + " | ".join(["?"] * (len(_VERSIONS) + 3)) + " |")
            why.setdefault(("no build info", s.absent or "unknown"), []).append(s.id)
        for b in s.build:
            cells = [getattr(b, f) for f in (*_VERSIONS, "kv_layout", "model")] + [b.model_config_sha256[:16]]
            lines.append(f"| {s.role} | {s.id} | {s.host} | " + " | ".join(cells) + " |")
            for field, reason in b.absent.items():
                why.setdefault((field, reason), []).append(s.id)
    if why:
        lines += ["", f"Why `{ABSENT}` (`?`: no build info at all):", ""]
        lines += [f"* {field} ({', '.join(steps)}): {reason}" for (field, reason), steps in sorted(why.items())]
    return lines


def _aiperf(fp: Fingerprint, job_dir: Path) -> list[str]:
    """One row per AIPerf step of the job (its artifact directory is ``bench/<step id>``)."""
    runs = [job_dir / "bench" / s.id for s in fp.steps if s.role == "benchmark" and s.id.startswith("aiperf-c")]
    if not runs:
        return ["## AIPerf", "", "no AIPerf run in this job (recipe: no benchmark, or aiperf off)"]
    lines = ["## AIPerf", "",
             "| concurrency | requests | req/s | output tok/s | TTFT avg (ms) | TTFT p99 (ms) | ITL avg (ms) "
             "| latency avg (ms) | server metrics read |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        c = run.name.removeprefix("aiperf-c")
        try:
            s = AiperfSummary.model_validate_json((run / AIPERF_SUMMARY).read_text())
        except (OSError, ValidationError) as exc:
            lines.append(f"| {c} | no {AIPERF_SUMMARY}: {type(exc).__name__} |||||||")
            continue
        try:
            metrics = ServerMetricsExport.model_validate_json((run / AIPERF_SERVER_METRICS).read_text()).summary
            read = f"{len(metrics.endpoints_successful)}/{len(metrics.endpoints_configured)}"
        except (OSError, ValidationError):
            read = f"no {AIPERF_SERVER_METRICS}"
        lines.append(" | ".join([
            f"| {c}", _num(s.request_count), _num(s.request_throughput), _num(s.output_token_throughput),
            _num(s.time_to_first_token), _num(s.time_to_first_token, "p99"), _num(s.inter_token_latency),
            _num(s.request_latency), read]) + " |")
    return lines


def _gsm8k(job_dir: Path) -> list[str]:
    results = sorted(job_dir.glob("bench/gsm8k/**/results_*.json"))
    if not results:
        return []
    lines = ["## lm-eval gsm8k", "", "| task | metric | value |", "|---|---|---|"]
    data = json.loads(results[-1].read_text()).get("results", {})
    for task, values in sorted(data.items()):
        for metric, value in sorted(values.items()):
            if isinstance(value, int | float) and "stderr" not in metric:
                lines.append(f"| {task} | {metric} | {value:.4g} |")
    return lines


def expected_kv_network(fp: Fingerprint) -> str:
    """The recipe's ``kv_network.expect`` ("any" when the recipe has none)."""
    import yaml

    data = yaml.safe_load(fp.recipe.text)
    network = data.get("kv_network") if isinstance(data, dict) else None
    return str(network.get("expect", "any")) if isinstance(network, dict) else "any"


def render_summary(fp: Fingerprint, job_dir: Path) -> str:
    lines = [f"# {fp.recipe.name}: job {fp.job_id or '-'}", "",
             f"* recipe: `{fp.recipe.source}` sha256 `{fp.recipe.sha256}`",
             f"* fingerprint: `fingerprint.json` ({fp.kind}, {fp.created}); hosts: {', '.join(fp.hosts)}",
             f"* server metrics collected from: {', '.join(fp.server_metrics)}", ""]
    lines += _what_ran(fp) + [""] + _aiperf(fp, job_dir) + [""] + kv_section(fp, job_dir, expected_kv_network(fp))
    lines += [""] + _gsm8k(job_dir)
    return "\n".join(lines).rstrip() + "\n"
