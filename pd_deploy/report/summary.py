"""``summary.md``: the benchmark entry (a table per scenario from the result files,
:mod:`pd_deploy.report.entry`), gsm8k's grade (:mod:`pd_deploy.report.evals`)
and the KV transfer (what carried the handoffs, how fast; :mod:`pd_deploy.report.kv_transfer`)
next to the fingerprint they ran under. Reads the files the tools and the summary step
write; a result that is missing is said to be missing."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from pd_build.info import ABSENT
from pd_deploy.recipe.fingerprint_model import Fingerprint
from pd_deploy.recipe.plan import aiperf_run_id
from pd_deploy.recipe.schema import Recipe
from pd_deploy.report.entry import RESULTS_DIR, EntryFields, Unavailable, result_name
from pd_deploy.report.evals import Grade, gsm8k_section
from pd_deploy.report.kv_transfer import kv_section

AIPERF_SERVER_METRICS = "server_metrics_export.json"
_VERSIONS = ("version", "git_revision", "vllm", "nixl", "ucx", "torch", "cuda", "tilert", "gpu", "gpu_driver")


class ServerMetricsCollection(BaseModel):
    """``server_metrics_export.json``'s ``summary``: which /metrics AIPerf read."""

    model_config = ConfigDict(extra="ignore")
    endpoints_configured: list[str]
    endpoints_successful: list[str]


class ServerMetricsExport(BaseModel):
    model_config = ConfigDict(extra="ignore")
    summary: ServerMetricsCollection


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


def _cell(value: object, scale: float, why: list[str]) -> str:
    """A table cell: the value scaled, or n/a with the number of its reason in ``why``."""
    if isinstance(value, Unavailable):
        if value.unavailable not in why:
            why.append(value.unavailable)
        return f"n/a[{why.index(value.unavailable) + 1}]"
    return f"{float(value) * scale:.4g}"  # type: ignore[arg-type]  # a float field


def _metrics_read(run: Path) -> str:
    try:
        metrics = ServerMetricsExport.model_validate_json((run / AIPERF_SERVER_METRICS).read_text()).summary
    except (OSError, ValidationError):
        return f"no {AIPERF_SERVER_METRICS}"
    return f"{len(metrics.endpoints_successful)}/{len(metrics.endpoints_configured)}"


_COLUMNS = (("mean_ttft", 1), ("p99_ttft", 1), ("mean_tpot", 1e3), ("p99_tpot", 1e3), ("mean_intvty", 1),
            ("p99_itl", 1e3), ("mean_e2el", 1), ("tput_per_gpu", 1), ("output_tput_per_gpu", 1))


def _scenarios(recipe: Recipe | None, job_dir: Path, results: dict[str, object]) -> list[str]:
    """One table per scenario: the result files' headline fields (pd_deploy.report.entry)."""
    b = recipe.benchmark if recipe else None
    if recipe is None or b is None or not b.aiperf:
        return ["## Benchmark", "", "no benchmark in this job (recipe: no benchmark, or aiperf off)", ""]
    lines: list[str] = []
    why: list[str] = []
    for scenario in b.scenarios:
        lines += [f"## Scenario {scenario.name}: isl {scenario.isl}, osl {scenario.osl}", "",
                  f"Lengths uniform in [{b.random_range_ratio:g} x, 1 x], ignore_eos, warm-ups not measured; "
                  f"{b.entry.hw}, {b.entry.framework}, {b.entry.precision}, "
                  f"MTP {'on' if recipe.mtp.enabled else 'off'}.", "",
                  "| conc | requests (failed) | TTFT mean (s) | TTFT p99 (s) | TPOT mean (ms) | TPOT p99 (ms) | "
                  "interactivity mean (tok/s/user) | ITL p99 (ms) | E2EL mean (s) | tput/GPU (tok/s) | "
                  "output tput/GPU (tok/s) | server metrics read | result file |", "|" + "---|" * 13]
        for c in scenario.concurrency:
            name = result_name(recipe, scenario, c)
            run = job_dir / "bench" / aiperf_run_id(scenario, c)
            res = results.get(name)
            if not isinstance(res, EntryFields):
                lines.append(f"| {c} | no result: {res or 'not computed'} |" + " |" * 9
                             + f" {_metrics_read(run)} | - |")
                continue
            cells = [_cell(getattr(res, field), scale, why) for field, scale in _COLUMNS]
            lines.append(f"| {c} | {res.requests} ({res.failed_requests}) | " + " | ".join(cells)
                         + f" | {_metrics_read(run)} | `{RESULTS_DIR}/{name}` |")
        lines.append("")
    if why:
        lines += [f"[{i}] {reason}" for i, reason in enumerate(why, 1)] + [""]
    return lines


def job_recipe(fp: Fingerprint) -> Recipe | None:
    """The recipe the job ran (its text is in the fingerprint), or None if it no longer parses."""
    import yaml

    from pd_deploy.recipe.render import parse_recipe
    from pd_deploy.recipe.topology import RecipeError

    try:
        return parse_recipe(yaml.safe_load(fp.recipe.text), fp.recipe.source)
    except (RecipeError, yaml.YAMLError, AttributeError):
        return None


def render_summary(fp: Fingerprint, job_dir: Path, results: dict[str, object] | None = None,
                   grade: Grade | None = None) -> str:
    lines = [f"# {fp.recipe.name}: job {fp.job_id or '-'}", "",
             f"* recipe: `{fp.recipe.source}` sha256 `{fp.recipe.sha256}`",
             f"* fingerprint: `fingerprint.json` ({fp.kind}, {fp.created}); hosts: {', '.join(fp.hosts)}",
             f"* server metrics collected from: {', '.join(fp.server_metrics)}", ""]
    recipe = job_recipe(fp)
    lines += _what_ran(fp) + [""] + _scenarios(recipe, job_dir, results or {})
    lines += kv_section(fp, job_dir, recipe.kv_network.expect if recipe else "any") + [""] + gsm8k_section(grade)
    return "\n".join(lines).rstrip() + "\n"
