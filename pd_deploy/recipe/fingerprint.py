"""Building ``fingerprint.json`` from a plan: every step's exact command, and each server's
build info read from its own ``/metrics`` (``*_build_info``) when the servers run."""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from pd_build.info import BuildInfo, collect
from pd_build.prometheus import parse
from pd_deploy.recipe.fingerprint_model import Fingerprint, RecipeRecord, ServiceRecord, StepRecord
from pd_deploy.recipe.plan import Plan, Step
from pd_deploy.recipe.render import masked, substitute

RECIPE_COPY = "recipe.yaml"  # in JOB_DIR/plan: the recipe's bytes, as rendered
RECIPE_SOURCE = "recipe.source"  # in JOB_DIR/plan: the path it was rendered from
DRY_RUN_ABSENT = "dry run: no server was started, so none reported its build info"


def recipe_record(name: str, source: str, text: str) -> RecipeRecord:
    return RecipeRecord(name=name, source=source, sha256=hashlib.sha256(text.encode()).hexdigest(), text=text)


def _step(step: Step, hosts: list[str], job_dir: str) -> dict[str, object]:
    command = [substitute(a, hosts, job_dir) for a in step.argv]
    return {
        "id": step.id,
        "role": step.role,
        "node": step.node,
        "host": hosts[step.node],
        "image": step.image,
        "command": command,
        "command_line": substitute(step.command_line(), hosts, job_dir),
        "env": {k: substitute(masked(k, v), hosts, job_dir) for k, v in step.env.items()},
    }


def scrape(metrics_url: str, timeout: float = 30.0) -> tuple[list[BuildInfo], str | None]:
    """(build infos, None) from ``metrics_url``'s ``*_build_info``, or ([], why not)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout) as resp:
            text = resp.read().decode()
    except (OSError, urllib.error.URLError) as exc:
        return [], f"GET {metrics_url} failed: {exc}"
    found = [info for infos in parse(text).values() for info in infos]
    return (found, None) if found else ([], f"{metrics_url} has no *_build_info metric")


def build_fingerprint(plan: Plan, recipe: RecipeRecord, hosts: list[str], job_dir: str, *,
                      job_id: str | None, live: bool) -> Fingerprint:
    """The fingerprint of ``plan`` run on ``hosts``; ``live``: ask every server's /metrics
    (a job, after the gates), else mark their build info absent (a dry run)."""
    services = []
    for step in plan.services:
        record = _step(step, hosts, job_dir)
        url = substitute(step.base_url, hosts, job_dir)
        build, absent = scrape(f"{url}/metrics") if live else ([], DRY_RUN_ABSENT)
        services.append(ServiceRecord.model_validate(
            {**record, "url": url, "metrics_url": f"{url}/metrics", "build": build, "absent": absent}))
    others = [s for s in plan.steps if s not in plan.services]
    return Fingerprint(
        kind="job" if live else "dry-run",
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        job_id=job_id,
        job_dir=job_dir,
        hosts=hosts,
        recipe=recipe,
        services=services,
        steps=[StepRecord.model_validate(_step(s, hosts, job_dir)) for s in others],
        server_metrics=[substitute(u, hosts, job_dir) for u in plan.metrics_urls],
        environment=collect("environment"),
    )


def write(fingerprint: Fingerprint, path: Path) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(fingerprint.model_dump_json(indent=2) + "\n")
    tmp.replace(path)
    return path


def job_fingerprint(job_dir: Path) -> Fingerprint:
    """Inside a job: the plan rendered into ``job_dir/plan`` (from its copy of the recipe), the
    allocated hosts (``job_dir/hosts``), every server asked for its build info."""
    from pd_deploy.recipe.plan import build_plan
    from pd_deploy.recipe.render import parse_recipe
    from pd_deploy.recipe.schema import load_recipe_text

    plan_dir = job_dir / "plan"
    copy = plan_dir / RECIPE_COPY
    plan = build_plan(parse_recipe(load_recipe_text(copy), str(copy)))
    hosts = (job_dir / "hosts").read_text().split()
    source = (plan_dir / RECIPE_SOURCE).read_text().strip()
    job_id = os.environ.get("SLURM_JOB_ID") or _read(job_dir / "job_id")
    return build_fingerprint(plan, recipe_record(plan.recipe.name, source, copy.read_text()), hosts,
                             str(job_dir), job_id=job_id, live=True)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
