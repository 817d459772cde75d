"""From a recipe to the exact processes of a deployment, node by node.

Every server command comes from :mod:`pd_deploy.commands` (the builders the local
launcher and the tests use), so what is tested is what is deployed. Host names are
unknown until Slurm allocates the nodes: a plan refers to node ``i`` as
:func:`host_placeholder` ``(i)`` and the job substitutes the real names.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Literal

from decode_server.settings import DEFAULT_KV_DEVICE
from pd_deploy.commands import (
    DECODE_ENV,
    PREFILL_ENV,
    DecodeSpec,
    PrefillSpec,
    RouterSpec,
    decode_server_argv,
    router_argv,
    vllm_prefill_argv,
)
from pd_deploy.recipe.schema import Recipe
from pd_deploy.recipe.topology import conversion_env

OFFLINE_CLIENT_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def host_placeholder(node: int) -> str:
    return f"@HOST{node}@"


def _host(r: Recipe, node: int) -> str:
    """How the other processes reach node ``node``: loopback when every role shares one node."""
    return "127.0.0.1" if r.slurm.colocate else host_placeholder(node)


def _bind(r: Recipe) -> str:
    return "127.0.0.1" if r.slurm.colocate else r.slurm.bind_host


@dataclass(frozen=True)
class Step:
    """One process of the deployment.

    ``kind`` is ``service`` (runs in the background until the job ends, gated on
    ``ready_url``) or ``task`` (runs in the foreground and must exit 0).
    """

    id: str
    role: Literal["convert", "prefill", "decode", "router", "benchmark"]
    kind: Literal["service", "task"]
    node: int
    image: str | None
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_url: str = ""

    def command_line(self) -> str:
        return shlex.join(self.argv)


@dataclass(frozen=True)
class Plan:
    recipe: Recipe
    convert: Step | None
    workers: list[Step]
    router: Step
    benchmarks: list[Step]

    @property
    def steps(self) -> list[Step]:
        """Every step in start order: conversion, decode servers, prefill, router, benchmarks."""
        head = [self.convert] if self.convert else []
        decodes = [s for s in self.workers if s.role == "decode"]
        prefills = [s for s in self.workers if s.role == "prefill"]
        return [*head, *decodes, *prefills, self.router, *self.benchmarks]

    @property
    def router_url(self) -> str:
        return self.router.ready_url.removesuffix("/ready")


def _nodes(r: Recipe) -> tuple[int, list[int]]:
    """(prefill node, decode node of each decode server)."""
    if r.slurm.colocate:
        return 0, [0] * r.decode.nodes
    return 0, list(range(1, 1 + r.decode.nodes))


def _decode_ports(r: Recipe, i: int) -> tuple[int, int]:
    shift = i if r.slurm.colocate else 0
    return r.decode.port + shift, r.decode.kv_port + shift


def _convert_step(r: Recipe, node: int) -> Step | None:
    if r.conversion is None or not r.model.converted:
        return None
    return Step(
        id="convert",
        role="convert",
        kind="task",
        node=node,
        image=r.conversion.image or r.decode.image,
        argv=[a.replace("{src}", r.model.source) for a in r.conversion.command],
        env=conversion_env(r),
    )


def _workers(r: Recipe) -> list[Step]:
    prefill_node, decode_nodes = _nodes(r)
    decode_urls, kv_endpoints, steps = [], [], []
    kv_dtype = (
        ("--kv-dtype", r.model.dtype) if r.model.dtype != "auto" and r.decode.engine == "reference" else ()
    )
    for i, node in enumerate(decode_nodes):
        port, kv_port = _decode_ports(r, i)
        host = _host(r, node)
        spec = DecodeSpec(
            model=r.decode_weights,
            port=port,
            kv_port=kv_port,
            host=_bind(r),
            engine=r.decode.engine,
            slots=r.decode.slots,
            max_seq_len=r.decode.max_seq_len,
            num_mtp=r.decode.num_mtp,
            served_model_name=r.model.name,
            kv_device=r.decode.kv_device or DEFAULT_KV_DEVICE[r.decode.engine],
            python=r.decode.python,
            extra_args=("--kv-host", host, *kv_dtype, *r.decode.extra_args),
        )
        steps.append(
            Step(
                id=f"decode{i}",
                role="decode",
                kind="service",
                node=node,
                image=r.decode.image,
                argv=decode_server_argv(spec),
                env={**DECODE_ENV, **r.decode.env},
                ready_url=f"http://{host}:{port}/ready",
            )
        )
        decode_urls.append(f"http://{host}:{port}")
        kv_endpoints.append(f"{host}:{kv_port}")
    extra = ["--dtype", r.model.dtype] if r.model.dtype != "auto" else []
    extra += r.prefill.extra_args
    pspec = PrefillSpec(
        model=r.model.source,
        port=r.prefill.port,
        host=_bind(r),
        mtp=r.mtp.enabled,
        num_speculative_tokens=r.mtp.num_speculative_tokens,
        profile=r.model.profile,
        decode_endpoints=tuple(kv_endpoints),
        enforce_eager=r.prefill.enforce_eager,
        tensor_parallel=r.prefill.tensor_parallel,
        max_model_len=r.prefill.max_model_len,
        served_model_name=r.model.name,
        extra_args=tuple(extra),
        python=r.prefill.python,
    )
    argv = vllm_prefill_argv(pspec)
    prefill = Step(
        id="prefill",
        role="prefill",
        kind="service",
        node=prefill_node,
        image=r.prefill.image,
        argv=argv,
        env={**PREFILL_ENV, **r.prefill.env},
        ready_url=f"http://{_host(r, prefill_node)}:{r.prefill.port}/health",
    )
    return [prefill, *steps]


def _router(r: Recipe, workers: list[Step]) -> Step:
    prefill = workers[0]
    decodes = workers[1:]
    spec = RouterSpec(
        prefill_urls=(prefill.ready_url.removesuffix("/health"),),
        decode_urls=tuple(d.ready_url.removesuffix("/ready") for d in decodes),
        port=r.router.port,
        host=_bind(r),
        extra_args=tuple(r.router.extra_args),
        python=r.router.python,
    )
    node = prefill.node
    return Step(
        id="router",
        role="router",
        kind="service",
        node=node,
        image=r.router.image,
        argv=router_argv(spec),
        env=dict(r.router.env),
        ready_url=f"http://{_host(r, node)}:{r.router.port}/ready",
    )


def _benchmarks(r: Recipe, router: Step) -> list[Step]:
    b = r.benchmark
    if b is None:
        return []
    base = f"{_host(r, router.node)}:{r.router.port}"
    tokenizer = b.tokenizer or r.model.source
    steps: list[Step] = []
    if b.aiperf:
        for c in b.concurrency:
            count = b.requests_per_concurrency or max(20, 10 * c)
            argv = [
                "aiperf",
                "profile",
                "--model",
                r.model.name,
                "--url",
                base,
                "--endpoint-type",
                "chat",
                "--streaming",
                "--tokenizer",
                tokenizer,
                "--synthetic-input-tokens-mean",
                str(b.isl),
                "--synthetic-input-tokens-stddev",
                "0",
                "--output-tokens-mean",
                str(b.osl),
                "--output-tokens-stddev",
                "0",
                "--extra-inputs",
                f"max_tokens:{b.osl}",
                "--extra-inputs",
                "ignore_eos:true",
                "--concurrency",
                str(c),
                "--request-count",
                str(count),
                "--artifact-dir",
                f"@JOBDIR@/bench/aiperf-c{c}",
            ]
            steps.append(
                Step(
                    id=f"aiperf-c{c}",
                    role="benchmark",
                    kind="task",
                    node=router.node,
                    image=r.router.image,
                    argv=argv,
                    env=dict(OFFLINE_CLIENT_ENV),
                )
            )
    if b.gsm8k:
        g = b.gsm8k
        model_args = (
            f"model={r.model.name},base_url=http://{base}/v1/chat/completions,"
            f"tokenizer={tokenizer},tokenizer_backend=huggingface,num_concurrent={g.concurrency},"
            "max_retries=3,tokenized_requests=False"
        )
        argv = [
            "lm_eval",
            "--model",
            "local-chat-completions",
            "--model_args",
            model_args,
            "--tasks",
            "gsm8k_local",
            "--include_path",
            "@JOBDIR@/plan/lm_eval_tasks",
            "--num_fewshot",
            str(g.num_fewshot),
            "--apply_chat_template",
            "--fewshot_as_multiturn",
            "--output_path",
            "@JOBDIR@/bench/gsm8k",
        ]
        if g.limit:
            argv += ["--limit", str(g.limit)]
        steps.append(
            Step(
                id="gsm8k",
                role="benchmark",
                kind="task",
                node=router.node,
                image=r.router.image,
                argv=argv,
                env=dict(OFFLINE_CLIENT_ENV),
            )
        )
    return steps


def build_plan(recipe: Recipe) -> Plan:
    prefill_node, decode_nodes = _nodes(recipe)
    workers = _workers(recipe)
    router = _router(recipe, workers)
    convert_node = decode_nodes[0] if decode_nodes else prefill_node
    return Plan(
        recipe=recipe,
        convert=_convert_step(recipe, convert_node),
        workers=workers,
        router=router,
        benchmarks=_benchmarks(recipe, router),
    )


def gsm8k_task_yaml(data_path: str) -> str:
    """An lm-eval task reading gsm8k from a local directory (jsonl or parquet files of the
    'main' config: question/answer), scored on the final '#### N' answer."""
    return "\n".join(
        [
            "task: gsm8k_local",
            "output_type: generate_until",
            "dataset_path: " + data_path,
            "test_split: test",
            "fewshot_split: train",
            'doc_to_text: "Question: {{question}}\\nAnswer:"',
            'doc_to_target: "{{answer}}"',
            "generation_kwargs:",
            '  until: ["Question:", "</s>", "<|im_end|>"]',
            "  do_sample: false",
            "  temperature: 0.0",
            "filter_list:",
            "  - name: strict-match",
            "    filter:",
            "      - function: regex",
            '        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"',
            "      - function: take_first",
            "metric_list:",
            "  - metric: exact_match",
            "    aggregation: mean",
            "    higher_is_better: true",
            "    ignore_case: true",
            "    ignore_punctuation: false",
            '    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]',
            "",
        ]
    )
