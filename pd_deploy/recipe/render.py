"""Loading a recipe (schema + topology), printing a plan, and writing it for the Slurm job.

The job directory's ``plan/`` holds what ``deploy/slurm/*.sh`` read, in formats bash reads
without Python on the compute nodes:

* ``steps.tsv``: one line per step: id, role, kind, node, image (``-`` if none), ready URL (``-``);
* ``<id>.argv`` / ``<id>.env``: the step's argv and environment (``KEY=VALUE``), NUL-separated;
* ``job.env``: shell assignments (quoted) of the job-wide settings;
* ``dry-run.txt``: what ``dry-run`` prints;
* ``servers.yaml``: the servers file (:func:`pd_deploy.recipe.plan.servers_file`) the job copies,
  host names filled in, to ``JOB_DIR/servers.yaml``, which the router and prefill's connector
  watch: rewrite that copy (write, then rename over) to add or remove servers while the job runs;
* ``recipe.yaml``, ``recipe.source``: the recipe's bytes and the path it was rendered from
  (what ``fingerprint.json`` hashes and rebuilds the plan from);
* ``aiperf/<run>.jsonl``: each benchmark run's requests (their prompt and answer lengths), as
  AIPerf's mooncake trace (:func:`pd_deploy.recipe.plan.trace_lines`);
* ``lm_eval_tasks/gsm8k_local.yaml``: the gsm8k task lm-eval runs.

``@HOSTi@`` and ``@JOBDIR@`` in any of them are replaced by the job at run time.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pd_deploy.recipe.plan import (
    GSM8K_TASK,
    Plan,
    Step,
    aiperf_run_id,
    build_plan,
    gsm8k_task_yaml,
    host_placeholder,
    requests_at,
    servers_file,
    trace_lines,
)
from pd_deploy.recipe.schema import Recipe, load_recipe_text
from pd_deploy.recipe.thresholds import gsm8k_threshold
from pd_deploy.recipe.topology import RecipeError, RecipeProblem, topology_problems
from pd_deploy.secrets import generate as generate_secrets


def parse_recipe(data: dict[str, Any], source: str = "<recipe>") -> Recipe:
    """Validate ``data`` (schema, then topology); raise :class:`RecipeError` listing every problem."""
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        problems = [
            RecipeProblem(".".join(str(p) for p in e["loc"]) or "<root>", e.get("input"), e["msg"])
            for e in exc.errors()
        ]
        raise RecipeError(source, problems) from None
    problems = topology_problems(recipe)
    if problems:
        raise RecipeError(source, problems)
    return recipe


def load_recipe(path: Path) -> Recipe:
    import yaml

    try:
        data = load_recipe_text(path)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise RecipeError(
            str(path), [RecipeProblem("<file>", str(path), f"cannot read recipe: {exc}")]
        ) from None
    return parse_recipe(data, str(path))


def masked(key: str, value: str) -> str:
    """An environment value as shown (dry run, fingerprint.json): tokens hidden."""
    return "***" if "TOKEN" in key else value


def substitute(text: str, hosts: list[str], job_dir: str) -> str:
    """``text`` with the plan's placeholders (``@HOSTi@``, ``@JOBDIR@``) filled in."""
    for i, host in enumerate(hosts):
        text = text.replace(host_placeholder(i), host)
    return text.replace("@JOBDIR@", job_dir)


def _benchmark_lines(r: Recipe) -> list[str]:
    b = r.benchmark
    if b is None:
        return ["benchmark: none"]
    e = b.entry
    lines = [f"benchmark ({e.hw}, {e.framework}, {e.precision}, {e.model_prefix}): one after the other on the "
             f"same servers; lengths uniform in [{b.random_range_ratio:g} x, 1 x] isl|osl, ignore_eos, "
             "warm-ups not measured"]
    for s in b.scenarios:
        for c in s.concurrency:
            warmups, measured = requests_at(b, c)
            lines.append(f"  scenario {s.name}: isl {s.isl}, osl {s.osl}, concurrency {c}: {measured} requests "
                         f"(+{warmups} warm-up)" + ("" if b.aiperf else " [aiperf off]"))
    if b.gsm8k:
        g = b.gsm8k
        threshold, source = gsm8k_threshold(b)
        asked = f"{g.limit} question(s)" if g.limit else "every question"
        lines.append(f"  gsm8k: {asked} of {g.data_path} (test split), {g.num_fewshot}-shot, "
                     f"concurrency {g.concurrency}, greedy, chat completions, max_tokens {g.max_tokens}; "
                     f"passes when strict-match and flexible-extract are both >= {threshold:g} ({source}); "
                     "below it the job fails")
    return lines


def describe(plan: Plan, hosts: list[str] | None = None, job_dir: str = "<job-dir>") -> str:
    """Human-readable plan: every process of every node with its exact command, in start order."""
    r = plan.recipe
    names = hosts or [f"node{i}" for i in range(r.num_nodes)]
    lines = [
        f"recipe {r.name}: {r.num_nodes} node(s), model {r.model.name} ({r.model.profile}), "
        f"decode engine {r.decode.engine}, MTP {'on' if r.mtp.enabled else 'off'}",
        "start order: convert (once) -> decode -> gates -> prefill -> gate -> router -> gate -> fingerprint "
        "-> benchmarks -> summary",
        f"KV network: expects {r.kv_network.expect} (summary.md flags handoffs carried otherwise)",
        *_benchmark_lines(r),
    ]
    for node in range(r.num_nodes):
        lines.append(f"\n== node {node} ({names[node]}) ==")
        for step in plan.steps:
            if step.node != node:
                continue
            lines.append(f"[{step.id}] role={step.role} kind={step.kind} image={step.image or '-'}")
            if step.ready_url:
                lines.append(f"  gate: {substitute(step.ready_url, names, job_dir)}")
            if step.role == "convert" and r.conversion is not None:
                lines.append(f"  into: {r.model.converted} (once, under {r.model.converted}.lock; "
                             "skipped when already complete)")
                lines.append(f"  then: copies {' '.join(r.conversion.model_files)} from {r.model.source} "
                             f"when the converter did not write them, and checks the directory for the "
                             f"{r.decode.engine} engine ({r.decode.python} -m decode_server.model_dir)")
            for key, value in sorted(step.env.items()):
                lines.append(f"  env {key}={substitute(masked(key, value), names, job_dir)}")
            lines.append("  $ " + substitute(step.command_line(), names, job_dir))
    lines.append(f"\n== servers file {substitute('@JOBDIR@/servers.yaml', names, job_dir)} "
                 "(router and prefill's connector watch it: rewrite it to add or remove servers) ==")
    lines.append(substitute(servers_yaml(plan), names, job_dir).rstrip())
    return "\n".join(lines) + "\n"


def servers_yaml(plan: Plan) -> str:
    import yaml

    return yaml.safe_dump(servers_file(plan).model_dump(mode="json", exclude_none=True), sort_keys=False)


def _nul(items: list[str]) -> bytes:
    return b"".join(i.encode() + b"\0" for i in items)


def _job_env(plan: Plan) -> dict[str, str]:
    r = plan.recipe
    conv = r.conversion
    gpus = max(r.prefill.gpus_per_node, r.decode.gpus_per_node)
    env = {
        "RECIPE_NAME": r.name,
        "NUM_NODES": str(r.num_nodes),
        "MODEL_NAME": r.model.name,
        "ROUTER_URL": plan.router_url,
        "GATE_TIMEOUT": str(r.slurm.gate_timeout_s),
        "CONTAINER_MODE": r.slurm.container,
        "CONTAINER_MOUNTS": ",".join(r.slurm.mounts),
        "SMOKE_TEST": "1" if r.slurm.smoke_test else "0",
        "HOLD": "1" if r.slurm.hold else "0",
        "SLURM_PARTITION": r.slurm.partition or "",
        "SLURM_ACCOUNT": r.slurm.account or "",
        "SLURM_TIME": r.slurm.time,
        "GPUS_PER_NODE": str(gpus),
        "CPUS_PER_NODE": str(r.slurm.cpus_per_node or ""),
    }
    if conv and r.model.converted:
        env.update(
            {
                "CONVERT_SRC": r.model.source,
                "CONVERT_DST": r.model.converted,
                "CONVERT_SHARDS": str(conv.shards),
                "CONVERT_SHARD_GLOB": conv.shard_glob,
                "CONVERT_MODEL_FILES": " ".join(conv.model_files),
                "CONVERT_ENGINE": r.decode.engine,
                "CONVERT_PYTHON": r.decode.python,
                "CONVERT_LOCK_TIMEOUT": str(conv.lock_timeout_s),
            }
        )
    return env


def _step_row(step: Step) -> str:
    return "\t".join(
        [step.id, step.role, step.kind, str(step.node), step.image or "-", step.ready_url or "-"]
    )


def write_plan(plan: Plan, job_dir: Path, recipe_text: str = "", recipe_source: str = "") -> Path:
    """Write ``job_dir/plan`` (see the module docstring) and the job's secrets (created once,
    0600, :mod:`pd_deploy.secrets`); returns the plan directory."""
    out = job_dir / "plan"
    out.mkdir(parents=True, exist_ok=True)
    generate_secrets(job_dir)
    (out / "recipe.yaml").write_text(recipe_text)
    (out / "recipe.source").write_text(recipe_source + "\n")
    for step in plan.steps:
        (out / f"{step.id}.argv").write_bytes(_nul(step.argv))
        (out / f"{step.id}.env").write_bytes(_nul([f"{k}={v}" for k, v in step.env.items()]))
    (out / "steps.tsv").write_text("".join(_step_row(s) + "\n" for s in plan.steps))
    (out / "job.env").write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in _job_env(plan).items()))
    (out / "dry-run.txt").write_text(describe(plan))
    (out / "servers.yaml").write_text(servers_yaml(plan))
    bench = plan.recipe.benchmark
    if bench and bench.aiperf:
        traces = out / "aiperf"
        traces.mkdir(exist_ok=True)
        for scenario in bench.scenarios:
            for c in scenario.concurrency:
                lines = trace_lines(bench, scenario, c)
                (traces / f"{aiperf_run_id(scenario, c)}.jsonl").write_text("\n".join(lines) + "\n")
    if bench and bench.gsm8k:
        tasks = out / "lm_eval_tasks"
        tasks.mkdir(exist_ok=True)
        (tasks / f"{GSM8K_TASK}.yaml").write_text(gsm8k_task_yaml(bench.gsm8k.data_path))
    return out


def plan_for(path: Path) -> Plan:
    return build_plan(load_recipe(path))
