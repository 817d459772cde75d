"""Deployment recipes: schema, topology checks, and the exact processes of every node.

``python -m pd_router.deploy_recipe validate FILE`` checks a recipe;
``python -m pd_router.deploy_recipe dry-run FILE`` prints every process of every node;
``python -m pd_router.deploy_recipe render FILE --job-dir DIR`` writes the plan the Slurm
scripts in ``deploy/slurm`` run. See ``docs/deploy.md``.
"""

from pd_router.deploy_recipe.plan import Plan, Step, build_plan, host_placeholder
from pd_router.deploy_recipe.render import describe, load_recipe, parse_recipe, write_plan
from pd_router.deploy_recipe.schema import Recipe
from pd_router.deploy_recipe.topology import RecipeError, RecipeProblem, conversion_env, topology_problems

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
