"""``python -m pd_deploy.recipe {validate,dry-run,render} ...`` (console script ``pd-deploy``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, Field
from pydantic_settings import CliPositionalArg, CliSubCommand, SettingsConfigDict

from pd_deploy.recipe.plan import build_plan
from pd_deploy.recipe.render import describe, load_recipe, write_plan
from pd_deploy.recipe.topology import RecipeError
from pd_settings.loader import EntrySettings, load, subcommand
from pd_settings.problems import SettingsError


class Validate(BaseModel):
    """check recipes (schema and topology); exit 2 if any is invalid"""

    recipes: CliPositionalArg[list[Path]]


class DryRun(BaseModel):
    """print the exact command of every process on every node"""

    recipe: CliPositionalArg[Path]
    hosts: str = Field("", description="comma-separated node names (default node0,node1,...)")
    job_dir: str = Field("<job-dir>", description="job directory shown in commands")
    fingerprint: Path | None = Field(
        None, description="also write the plan's fingerprint.json here (servers' build info marked absent: "
        "nothing runs; the versions of this environment under 'environment')"
    )


class Render(BaseModel):
    """write the plan the Slurm scripts run into JOB_DIR/plan"""

    recipe: CliPositionalArg[Path]
    job_dir: Path = Field(description="the job's directory (on a filesystem every node sees)")


class RecipeCommand(EntrySettings):
    """Validate deployment recipes and show or write their plans."""

    model_config = SettingsConfigDict(env_prefix="PD_RECIPE_", cli_prog_name="python -m pd_deploy.recipe")

    validate_: CliSubCommand[Validate] = Field(alias="validate")
    dry_run: CliSubCommand[DryRun]
    render: CliSubCommand[Render]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cmd = subcommand(load(RecipeCommand, sys.argv[1:] if argv is None else argv))
    except SettingsError as exc:
        print(f"pd-deploy: {exc}", file=sys.stderr)
        return 2
    try:
        if isinstance(cmd, Validate):
            failed = 0
            for path in cmd.recipes:
                try:
                    recipe = load_recipe(path)
                    print(f"{path}: ok ({recipe.name}, {recipe.num_nodes} nodes)")
                except RecipeError as exc:
                    failed += 1
                    print(exc, file=sys.stderr)
            return 2 if failed else 0
        plan = build_plan(load_recipe(cmd.recipe))
        if isinstance(cmd, DryRun):
            hosts = [h for h in cmd.hosts.split(",") if h]
            if hosts and len(hosts) != plan.recipe.num_nodes:
                print(f"--hosts: {len(hosts)} names given, the recipe needs {plan.recipe.num_nodes}", file=sys.stderr)
                return 2
            sys.stdout.write(describe(plan, hosts or None, cmd.job_dir))
            if cmd.fingerprint is not None:
                from pd_deploy.recipe.fingerprint import build_fingerprint, recipe_record, write

                names = hosts or [f"node{i}" for i in range(plan.recipe.num_nodes)]
                record = recipe_record(plan.recipe.name, str(cmd.recipe.resolve()), cmd.recipe.read_text())
                fp = build_fingerprint(plan, record, names, cmd.job_dir, job_id=None, live=False)
                print(f"fingerprint: {write(fp, cmd.fingerprint)} (recipe sha256 {record.sha256})")
            return 0
        print(write_plan(plan, cmd.job_dir, cmd.recipe.read_text(), str(cmd.recipe.resolve())))
        return 0
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
