"""Topology checks: rules that relate several fields of a recipe.

Each problem is reported as a :class:`RecipeProblem` naming the field, its value and
the reason, so ``validate`` can print every problem at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decode_server.model_dir import MODEL_FILES
from pd_deploy.recipe.schema import Recipe

# TileRT shards GLM-5 over exactly 8 devices (its converter writes 8 device shards).
GLM5_DECODE_GPUS = 8
HF_VARS = ("HF_HOME", "HF_TOKEN", "HF_ENDPOINT", "HF_HUB_CACHE")


@dataclass(frozen=True)
class RecipeProblem:
    field: str
    value: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.field} = {self.value!r}: {self.reason}"


class RecipeError(ValueError):
    """A recipe that cannot be deployed; ``problems`` lists every reason."""

    def __init__(self, source: str, problems: list[RecipeProblem]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: invalid recipe:\n" + "\n".join(f"  - {p}" for p in problems))


def _role_checks(r: Recipe) -> list[RecipeProblem]:
    out: list[RecipeProblem] = []
    if r.prefill.nodes != 1:
        out.append(
            RecipeProblem(
                "prefill.nodes",
                r.prefill.nodes,
                "exactly one prefill node is supported (one vLLM instance, TP over its "
                "GPUs); scale out with decode.nodes",
            )
        )
    if r.decode.nodes < 1:
        out.append(RecipeProblem("decode.nodes", r.decode.nodes, "at least one decode node is needed"))
    if r.prefill.gpus_per_node and r.prefill.tensor_parallel > r.prefill.gpus_per_node:
        out.append(
            RecipeProblem(
                "prefill.tensor_parallel",
                r.prefill.tensor_parallel,
                f"larger than prefill.gpus_per_node ({r.prefill.gpus_per_node})",
            )
        )
    if r.decode.engine == "tilert":
        if r.model.profile == "glm5.1" and r.decode.gpus_per_node != GLM5_DECODE_GPUS:
            out.append(
                RecipeProblem(
                    "decode.gpus_per_node",
                    r.decode.gpus_per_node,
                    f"GLM-5 decode with TileRT needs {GLM5_DECODE_GPUS} GPUs per decode node "
                    "(the converted weights are 8 device shards)",
                )
            )
        if r.decode.slots != 1:
            out.append(RecipeProblem("decode.slots", r.decode.slots, "TileRT decodes one sequence at a time"))
        if not r.model.converted:
            out.append(
                RecipeProblem(
                    "model.converted",
                    None,
                    "the tilert engine loads converted weights: set model.converted (and conversion)",
                )
            )
        if r.conversion is None:
            out.append(RecipeProblem("conversion", None, "the tilert engine needs a weight conversion step"))
    if r.conversion is not None:
        lacking = [f for f in MODEL_FILES[r.decode.engine] if f not in r.conversion.model_files]
        if lacking:
            out.append(
                RecipeProblem(
                    "conversion.model_files",
                    r.conversion.model_files,
                    f"the {r.decode.engine} decode server also reads {', '.join(lacking)} from the "
                    "converted directory",
                )
            )
    if r.decode.engine == "reference" and r.decode.kv_device not in (None, "cpu"):
        out.append(RecipeProblem("decode.kv_device", r.decode.kv_device, "the reference engine runs on the CPU"))
    if r.model.profile == "glm5.1" and r.decode.engine != "tilert":
        out.append(
            RecipeProblem(
                "decode.engine",
                r.decode.engine,
                "the glm5.1 profile decodes with tilert (the reference engine is for the tiny CPU model)",
            )
        )
    return out


def _mtp_checks(r: Recipe) -> list[RecipeProblem]:
    out: list[RecipeProblem] = []
    if not r.mtp.enabled:
        out.append(
            RecipeProblem(
                "mtp.enabled",
                False,
                "MTP is required: the decode side expects the MTP layer's KV (N+1 layers) "
                "and a prefill without it fails the KV handshake",
            )
        )
    if r.decode.num_mtp < 1:
        out.append(
            RecipeProblem(
                "decode.num_mtp",
                r.decode.num_mtp,
                "MTP is required: decode needs at least one MTP draft per step",
            )
        )
    return out


def _image_checks(r: Recipe) -> list[RecipeProblem]:
    out: list[RecipeProblem] = []
    if r.slurm.container == "none" and r.model.profile != "glm5.1":
        return out  # plain processes (CPU test stacks): images unused
    for role in ("prefill", "decode", "router"):
        if not getattr(r, role).image:
            out.append(RecipeProblem(f"{role}.image", None, f"the {role} role has no image"))
    if r.decode.engine == "tilert" and r.prefill.image and r.prefill.image == r.decode.image:
        out.append(
            RecipeProblem(
                "decode.image",
                r.decode.image,
                "prefill and decode cannot share one image (vLLM's torch/CUDA vs TileRT's "
                "Python 3.12 + torch 2.11 + CUDA 13); see Dockerfile.decode",
            )
        )
    return out


def _placement_checks(r: Recipe) -> list[RecipeProblem]:
    out: list[RecipeProblem] = []
    if r.slurm.colocate:
        if r.decode.engine == "tilert":
            out.append(
                RecipeProblem(
                    "slurm.colocate",
                    True,
                    "a TileRT decode server needs a node of its own; colocate is for CPU stacks",
                )
            )
        ports = {"prefill.port": r.prefill.port, "router.port": r.router.port}
        for i in range(r.decode.nodes):
            ports[f"decode.port (+{i})"] = r.decode.port + i
            ports[f"decode.kv_port (+{i})"] = r.decode.kv_port + i
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port in seen:
                out.append(RecipeProblem(name, port, f"same port as {seen[port]} on the shared node"))
            seen.setdefault(port, name)
    elif r.router.port == r.prefill.port:
        out.append(
            RecipeProblem(
                "router.port",
                r.router.port,
                "the router runs on the prefill node: its port must differ from prefill.port",
            )
        )
    return out


def _env_checks(r: Recipe) -> list[RecipeProblem]:
    """Conversion sees every role's Hugging Face settings; they must agree."""
    out: list[RecipeProblem] = []
    for var in HF_VARS:
        values = {
            role: getattr(r, role).env[var]
            for role in ("prefill", "decode", "router")
            if var in getattr(r, role).env
        }
        if len(set(values.values())) > 1:
            out.append(
                RecipeProblem(
                    f"*.env.{var}", values, "roles disagree; the weight conversion must see one value"
                )
            )
    return out


def _benchmark_checks(r: Recipe) -> list[RecipeProblem]:
    out: list[RecipeProblem] = []
    b = r.benchmark
    if b and b.gsm8k and not b.gsm8k.data_path.startswith("/"):
        out.append(
            RecipeProblem(
                "benchmark.gsm8k.data_path",
                b.gsm8k.data_path,
                "must be an absolute local path: compute nodes cannot reach a hub",
            )
        )
    if b and b.tokenizer and not b.tokenizer.startswith("/"):
        out.append(RecipeProblem("benchmark.tokenizer", b.tokenizer, "must be an absolute local directory"))
    for i, scenario in enumerate(b.scenarios if b else []):
        if any(c < 1 for c in scenario.concurrency):
            out.append(RecipeProblem(f"benchmark.scenarios.{i}.concurrency", scenario.concurrency,
                                     "every concurrency must be >= 1"))
        limit = min(r.decode.max_seq_len, r.prefill.max_model_len or r.decode.max_seq_len)
        if scenario.isl + scenario.osl > limit:
            out.append(RecipeProblem(f"benchmark.scenarios.{i}", f"isl {scenario.isl} + osl {scenario.osl}",
                                     f"longer than the servers take ({limit} tokens: decode.max_seq_len, "
                                     "prefill.max_model_len)"))
    names = [s.name for s in b.scenarios] if b else []
    if len(set(names)) < len(names):
        out.append(RecipeProblem("benchmark.scenarios", names, "two scenarios with the same isl and osl"))
    return out


def topology_problems(recipe: Recipe) -> list[RecipeProblem]:
    """Every cross-field problem of ``recipe`` (empty when it can be deployed)."""
    checks = (_role_checks, _mtp_checks, _image_checks, _placement_checks, _env_checks, _benchmark_checks)
    return [p for check in checks for p in check(recipe)]


def conversion_env(recipe: Recipe) -> dict[str, str]:
    """Environment of the weight conversion: the Hugging Face settings of every role
    (prefill, decode, router; they agree, see ``_env_checks``), then the conversion's own."""
    env: dict[str, str] = {}
    for role in ("prefill", "decode", "router"):
        env.update({k: v for k, v in getattr(recipe, role).env.items() if k in HF_VARS})
    if recipe.conversion:
        env.update(recipe.conversion.env)
    return env
