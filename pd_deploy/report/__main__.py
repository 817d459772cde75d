"""``python -m pd_deploy.report {fingerprint,summary} --job-dir DIR``: steps of the Slurm job
(``deploy/slurm/submit.sh``) writing ``DIR/fingerprint.json`` and ``DIR/summary.md``."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, Field
from pydantic_settings import CliSubCommand, SettingsConfigDict

from pd_deploy.recipe.fingerprint_model import FINGERPRINT_FILE, SUMMARY_FILE, Fingerprint
from pd_settings.loader import EntrySettings, load, subcommand
from pd_settings.problems import SettingsError


class FingerprintCmd(BaseModel):
    """write JOB_DIR/fingerprint.json: recipe and hash, exact commands, every server's build info"""

    job_dir: Path = Field(description="the job's directory (plan/ and hosts written by submit.sh)")


class SummaryCmd(BaseModel):
    """write JOB_DIR/summary.md: the benchmarks' headline numbers and the KV transfer next to the fingerprint
    (saves the prefill and decode servers' /metrics into JOB_DIR/metrics first)"""

    job_dir: Path = Field(description="the job's directory (fingerprint.json and bench/)")


class ReportCommand(EntrySettings):
    """Write what a deployment job ran (fingerprint.json) and its benchmark summary (summary.md)."""

    model_config = SettingsConfigDict(env_prefix="PD_REPORT_", cli_prog_name="python -m pd_deploy.report")

    fingerprint: CliSubCommand[FingerprintCmd]
    summary: CliSubCommand[SummaryCmd]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cmd = subcommand(load(ReportCommand, sys.argv[1:] if argv is None else argv))
    except SettingsError as exc:
        print(f"pd_deploy.report: {exc}", file=sys.stderr)
        return 2
    if isinstance(cmd, FingerprintCmd):
        from pd_deploy.recipe.fingerprint import job_fingerprint, write

        fp = job_fingerprint(cmd.job_dir)
        print(write(fp, cmd.job_dir / FINGERPRINT_FILE))
        missing = [s.id for s in fp.services if not s.build]
        if missing:
            print(f"pd_deploy.report: no build info from {', '.join(missing)} (see {FINGERPRINT_FILE})",
                  file=sys.stderr)
        return 0
    from pd_deploy.report.entry import write_results
    from pd_deploy.report.evals import grade_gsm8k
    from pd_deploy.report.kv_transfer import save_metrics
    from pd_deploy.report.summary import job_recipe, render_summary

    fp = Fingerprint.model_validate_json((cmd.job_dir / FINGERPRINT_FILE).read_text())
    for step, why in save_metrics(fp, cmd.job_dir).items():
        print(f"pd_deploy.report: no /metrics from {step}: {why}", file=sys.stderr)
    recipe = job_recipe(fp)
    results: dict[str, object] = dict(write_results(recipe, cmd.job_dir)) if recipe else {}
    grade = grade_gsm8k(recipe.benchmark, cmd.job_dir) if recipe and recipe.benchmark else None
    out = cmd.job_dir / SUMMARY_FILE
    out.write_text(render_summary(fp, cmd.job_dir, results, grade))
    print(out)
    for name, result in results.items():
        if isinstance(result, str):  # summary.md says so too
            print(f"pd_deploy.report: no {name}: {result}", file=sys.stderr)
    if grade is not None and grade.verdict != "PASS":  # the job ends failed
        print(f"pd_deploy.report: gsm8k {grade.verdict}: {grade.why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
