"""gsm8k graded as InferenceX grades it (its ``utils/evals/validate_scores.py``): every
``exact_match`` filter of the task (strict-match and flexible-extract) at or above the
threshold (:mod:`pd_deploy.recipe.thresholds`). An evaluation that answered fewer questions
than it was to ask (the whole test split, or the recipe's ``limit``) is an error, not a score."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pd_deploy.recipe.plan import GSM8K_TASK
from pd_deploy.recipe.schema import BenchmarkSpec
from pd_deploy.recipe.thresholds import gsm8k_threshold

FILTERS = ("strict-match", "flexible-extract")


class _Samples(BaseModel):
    model_config = ConfigDict(extra="ignore")
    original: int
    effective: int


class LmEvalResults(BaseModel):
    """The parts of lm-eval's ``results_<time>.json`` read here."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    results: dict[str, dict[str, object]]
    n_samples: dict[str, _Samples] = Field(alias="n-samples")


@dataclass(frozen=True)
class Grade:
    verdict: Literal["PASS", "FAIL", "ERROR"]
    scores: dict[str, float]  # filter -> exact match
    threshold: float
    source: str  # where the threshold comes from
    why: str


def grade_gsm8k(b: BenchmarkSpec, job_dir: Path) -> Grade | None:
    """None when the recipe runs no gsm8k."""
    if b.gsm8k is None:
        return None
    threshold, source = gsm8k_threshold(b)

    def error(why: str, scores: dict[str, float] | None = None) -> Grade:
        return Grade("ERROR", scores or {}, threshold, source, why)

    files = sorted(job_dir.glob("bench/gsm8k/**/results_*.json"))
    if not files:
        return error("lm-eval wrote no results_*.json under bench/gsm8k")
    try:
        data = LmEvalResults.model_validate_json(files[-1].read_text())
    except (OSError, ValidationError) as exc:
        return error(f"{files[-1].name}: {type(exc).__name__}: {str(exc)[:300]}")
    task, samples = data.results.get(GSM8K_TASK), data.n_samples.get(GSM8K_TASK)
    if task is None or samples is None:
        return error(f"{files[-1].name} has no {GSM8K_TASK} result")
    scores = {f: float(v) for f in FILTERS if isinstance(v := task.get(f"exact_match,{f}"), int | float)}
    expected = min(b.gsm8k.limit, samples.original) if b.gsm8k.limit else samples.original
    if samples.effective < expected:
        return error(f"answered {samples.effective} of the {expected} questions it was to ask "
                     f"(the split holds {samples.original})", scores)
    if set(scores) != set(FILTERS):
        return error(f"scores of {sorted(scores)} only: both {', '.join(FILTERS)} are graded", scores)
    low = [f for f in FILTERS if scores[f] < threshold]
    if low:
        return Grade("FAIL", scores, threshold, source, f"{', '.join(low)} below {threshold:g}")
    return Grade("PASS", scores, threshold, source, f"both at or above {threshold:g}")


def gsm8k_section(grade: Grade | None) -> list[str]:
    if grade is None:
        return []
    lines = ["## gsm8k", "", f"**{grade.verdict}**: {grade.why} (threshold {grade.threshold:g}: {grade.source}).", ""]
    if grade.scores:
        lines += ["| filter | exact match |", "|---|---|"]
        lines += [f"| {f} | {grade.scores[f]:.4f} |" for f in FILTERS if f in grade.scores]
    return lines
