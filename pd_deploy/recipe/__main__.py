"""``python -m pd_deploy.recipe {validate,dry-run,render} ...``"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pd_deploy.recipe.plan import build_plan
from pd_deploy.recipe.render import describe, load_recipe, write_plan
from pd_deploy.recipe.topology import RecipeError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pd_deploy.recipe",
        description="Validate deployment recipes and show or write their plans.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="check recipes (schema and topology); exit 2 if any is invalid")
    v.add_argument("recipes", nargs="+", type=Path)
    d = sub.add_parser("dry-run", help="print the exact command of every process on every node")
    d.add_argument("recipe", type=Path)
    d.add_argument("--hosts", default="", help="comma-separated node names (default node0,node1,...)")
    d.add_argument("--job-dir", default="<job-dir>", help="job directory shown in commands")
    r = sub.add_parser("render", help="write the plan the Slurm scripts run into JOB_DIR/plan")
    r.add_argument("recipe", type=Path)
    r.add_argument("--job-dir", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "validate":
            failed = 0
            for path in args.recipes:
                try:
                    recipe = load_recipe(path)
                    print(f"{path}: ok ({recipe.name}, {recipe.num_nodes} nodes)")
                except RecipeError as exc:
                    failed += 1
                    print(exc, file=sys.stderr)
            return 2 if failed else 0
        plan = build_plan(load_recipe(args.recipe))
        if args.cmd == "dry-run":
            hosts = [h for h in args.hosts.split(",") if h]
            if hosts and len(hosts) != plan.recipe.num_nodes:
                print(
                    f"--hosts: {len(hosts)} names given, the recipe needs {plan.recipe.num_nodes}",
                    file=sys.stderr,
                )
                return 2
            sys.stdout.write(describe(plan, hosts or None, args.job_dir))
            return 0
        out = write_plan(plan, args.job_dir)
        print(out)
        return 0
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
