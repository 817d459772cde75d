"""Deployment recipes: schema, topology checks, and the exact processes of every node.

``python -m pd_deploy.recipe validate FILE`` checks a recipe;
``python -m pd_deploy.recipe dry-run FILE`` prints every process of every node;
``python -m pd_deploy.recipe render FILE --job-dir DIR`` writes the plan the Slurm
scripts in ``deploy/slurm`` run. See ``docs/deploy.md``. The public names below are
imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pd_deploy.recipe.plan import Plan, Step, build_plan, host_placeholder
    from pd_deploy.recipe.render import describe, load_recipe, parse_recipe, write_plan
    from pd_deploy.recipe.schema import Recipe
    from pd_deploy.recipe.topology import RecipeError, RecipeProblem, conversion_env, topology_problems

_EXPORTS = {
    "Plan": "pd_deploy.recipe.plan",
    "Recipe": "pd_deploy.recipe.schema",
    "RecipeError": "pd_deploy.recipe.topology",
    "RecipeProblem": "pd_deploy.recipe.topology",
    "Step": "pd_deploy.recipe.plan",
    "build_plan": "pd_deploy.recipe.plan",
    "conversion_env": "pd_deploy.recipe.topology",
    "describe": "pd_deploy.recipe.render",
    "host_placeholder": "pd_deploy.recipe.plan",
    "load_recipe": "pd_deploy.recipe.render",
    "parse_recipe": "pd_deploy.recipe.render",
    "topology_problems": "pd_deploy.recipe.topology",
    "write_plan": "pd_deploy.recipe.render",
}
__all__ = [
    "Plan",
    "Recipe",
    "RecipeError",
    "RecipeProblem",
    "Step",
    "build_plan",
    "conversion_env",
    "describe",
    "host_placeholder",
    "load_recipe",
    "parse_recipe",
    "topology_problems",
    "write_plan",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pd_deploy.recipe' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
