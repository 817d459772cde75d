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
from pd_deploy.recipe.schema import BIND_NODE, BenchmarkSpec, Recipe, ScenarioSpec
from pd_deploy.recipe.topology import conversion_env
from pd_deploy.secrets import DECODE_API_KEY, KV_SECRET, SECRETS_DIR
from pd_settings.servers import DecodeEntry, ServersFile

OFFLINE_CLIENT_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# aiperf 0.13.0 in HF offline mode looks a tokenizer up only in the hub cache (snapshot_download),
# which fails for a local directory ("Repo id must be in the form ..."); out of offline mode it
# loads an absolute local path directly, with no hub lookup. The recipe's tokenizer is always a
# local absolute path (topology check), so aiperf runs with offline mode explicitly off.
AIPERF_ENV = {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "", "HF_DATASETS_OFFLINE": "1",
              "HF_HUB_DISABLE_TELEMETRY": "1"}


def host_placeholder(node: int) -> str:
    return f"@HOST{node}@"


def _host(r: Recipe, node: int) -> str:
    """How the other processes reach node ``node``: loopback when every role shares one node."""
    return "127.0.0.1" if r.slurm.colocate else host_placeholder(node)


# Generated into the job directory by `render` (pd_deploy.secrets, mode 0600), read by the
# servers from there: never on a command line.
DECODE_API_KEY_FILE = f"@JOBDIR@/{SECRETS_DIR}/{DECODE_API_KEY}"
KV_SECRET_FILE = f"@JOBDIR@/{SECRETS_DIR}/{KV_SECRET}"
# The servers file (pd_settings.servers): the router and prefill's connector both watch it, so
# servers are added to or removed from a running job by rewriting it (write, then rename over).
# `render` writes plan/servers.yaml with the host placeholders; the job fills them in at start.
SERVERS_FILE = "@JOBDIR@/servers.yaml"


def _bind(r: Recipe, node: int) -> str:
    """The address the servers of node ``node`` listen on."""
    if r.slurm.colocate:
        return "127.0.0.1"
    return host_placeholder(node) if r.slurm.bind_host == BIND_NODE else r.slurm.bind_host


@dataclass(frozen=True)
class Step:
    """One process of the deployment.

    ``kind`` is ``service`` (runs in the background until the job ends, gated on
    ``ready_url``) or ``task`` (runs in the foreground and must exit 0).
    """

    id: str
    role: Literal["convert", "prefill", "decode", "router", "fingerprint", "benchmark", "summary"]
    kind: Literal["service", "task"]
    node: int
    image: str | None
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_url: str = ""

    def command_line(self) -> str:
        return shlex.join(self.argv)

    @property
    def base_url(self) -> str:
        """A service's base URL (its gate without the probe path)."""
        return self.ready_url.rsplit("/", 1)[0]


@dataclass(frozen=True)
class Plan:
    recipe: Recipe
    convert: Step | None
    workers: list[Step]
    router: Step
    fingerprint: Step
    benchmarks: list[Step]
    summary: Step

    @property
    def steps(self) -> list[Step]:
        """Every step in start order: conversion, decode servers, prefill, router, fingerprint,
        benchmarks, summary."""
        head = [self.convert] if self.convert else []
        return [*head, *self.services, self.fingerprint, *self.benchmarks, self.summary]

    @property
    def services(self) -> list[Step]:
        """The servers in start order: decode servers, prefill, router."""
        decodes = [s for s in self.workers if s.role == "decode"]
        prefills = [s for s in self.workers if s.role == "prefill"]
        return [*decodes, *prefills, self.router]

    @property
    def metrics_urls(self) -> list[str]:
        """Every real Prometheus endpoint of the deployment: router, prefill, each decode server."""
        return _metrics_urls(self.router, self.workers)

    @property
    def router_url(self) -> str:
        return self.router.ready_url.removesuffix("/ready")


def _metrics_urls(router: Step, workers: list[Step]) -> list[str]:
    return [f"{s.base_url}/metrics" for s in (router, *workers)]


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
    steps = []
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
            host=_bind(r, node),
            engine=r.decode.engine,
            slots=r.decode.slots,
            max_seq_len=r.decode.max_seq_len,
            num_mtp=r.decode.num_mtp,
            tool_call_parser=r.decode.tool_call_parser,
            reasoning_parser=r.decode.reasoning_parser,
            served_model_name=r.model.name,
            kv_device=r.decode.kv_device or DEFAULT_KV_DEVICE[r.decode.engine],
            api_key_file=DECODE_API_KEY_FILE,
            kv_secret_file=KV_SECRET_FILE,
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
    extra = ["--dtype", r.model.dtype] if r.model.dtype != "auto" else []
    extra += r.prefill.extra_args
    pspec = PrefillSpec(
        model=r.model.source,
        port=r.prefill.port,
        host=_bind(r, prefill_node),
        mtp=r.mtp.enabled,
        num_speculative_tokens=r.mtp.num_speculative_tokens,
        profile=r.model.profile,
        servers_file=SERVERS_FILE,  # the decode servers' kv_endpoints, followed at runtime
        enforce_eager=r.prefill.enforce_eager,
        tensor_parallel=r.prefill.tensor_parallel,
        max_model_len=r.prefill.max_model_len,
        max_num_batched_tokens=r.prefill.max_num_batched_tokens,
        prefix_caching=r.prefill.prefix_caching,
        chunked_prefill=r.prefill.chunked_prefill,
        served_model_name=r.model.name,
        kv_secret_file=KV_SECRET_FILE,
        tool_call_parser=r.decode.tool_call_parser,
        reasoning_parser=r.decode.reasoning_parser,
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


def servers_file(plan: Plan) -> ServersFile:
    """What the job writes to :data:`SERVERS_FILE`. Not validated here: the host placeholders
    are no host names until the job fills them in (the router and the connector validate it)."""
    decodes = [s for s in plan.workers if s.role == "decode"]
    return ServersFile.model_construct(
        prefill=tuple(s.base_url for s in plan.workers if s.role == "prefill"),
        decode=tuple(DecodeEntry.model_construct(url=s.base_url, kv_endpoint=_kv_endpoint(s)) for s in decodes),
    )


def _kv_endpoint(decode: Step) -> str:
    """The KV endpoint a decode step advertises: its --kv-host and --kv-port."""
    argv = decode.argv
    return f"{argv[argv.index('--kv-host') + 1]}:{argv[argv.index('--kv-port') + 1]}"


def _router(r: Recipe, workers: list[Step]) -> Step:
    prefill = workers[0]
    spec = RouterSpec(
        prefill_urls=(),
        decode_urls=(),  # both from the servers file, which the job may rewrite while it runs
        port=r.router.port,
        host=_bind(r, prefill.node),
        decode_api_key_file=DECODE_API_KEY_FILE,
        extra_args=("--servers-file", SERVERS_FILE, *r.router.extra_args),
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


def _report_step(r: Recipe, router: Step, kind: Literal["fingerprint", "summary"]) -> Step:
    """``python -m pd_deploy.report {fingerprint,summary}`` in the router's environment, on its node:
    fingerprint.json before the benchmarks (every role's build info read from its /metrics), then
    summary.md after them."""
    return Step(
        id=kind,
        role=kind,
        kind="task",
        node=router.node,
        image=r.router.image,
        argv=[r.router.python, "-m", "pd_deploy.report", kind, "--job-dir", "@JOBDIR@"],
    )


def aiperf_run_id(scenario: ScenarioSpec, concurrency: int) -> str:
    """A benchmark run's step id, also its artifact directory under ``bench/``."""
    return f"aiperf-{scenario.name}-c{concurrency}"


def requests_at(b: BenchmarkSpec, concurrency: int) -> tuple[int, int]:
    """(warm-up, measured) requests of a run at ``concurrency`` (InferenceX: 2 x and 10 x it)."""
    return b.warmups_per_concurrency * concurrency, b.requests_per_concurrency or 10 * concurrency


def trace_lines(b: BenchmarkSpec, scenario: ScenarioSpec, concurrency: int) -> list[str]:
    """The run's requests as AIPerf's mooncake-trace JSONL, warm-ups first: each prompt's and
    answer's length drawn uniformly from [ratio x isl, isl] and [ratio x osl, osl] as
    InferenceX's random dataset draws them (seeded: the same lengths in every job)."""
    import json
    import random

    rng = random.Random(f"{b.seed}/{scenario.name}/{concurrency}")
    warmups, measured = requests_at(b, concurrency)

    def draw(length: int) -> int:
        return rng.randint(max(1, int(length * b.random_range_ratio)), length)

    return [json.dumps({"input_length": draw(scenario.isl), "output_length": draw(scenario.osl)})
            for _ in range(warmups + measured)]


def _aiperf_step(r: Recipe, router: Step, metrics_urls: list[str], scenario: ScenarioSpec, c: int) -> Step:
    b = r.benchmark
    assert b is not None
    run = aiperf_run_id(scenario, c)
    warmups, measured = requests_at(b, c)
    argv = [
        "aiperf", "profile",
        "--model", r.model.name,
        "--url", f"{_host(r, router.node)}:{r.router.port}",
        "--endpoint-type", "completions",
        "--streaming",
        "--tokenizer", b.tokenizer or r.model.source,
        # the lengths of plan/aiperf/<run>.jsonl (trace_lines), in order: warm-ups, then the measured
        "--input-file", f"@JOBDIR@/plan/aiperf/{run}.jsonl",
        "--custom-dataset-type", "mooncake_trace",
        "--dataset-sampling-strategy", "sequential",
        "--extra-inputs", "ignore_eos:true",
        "--extra-inputs", "temperature:0.0",
        "--concurrency", str(c),
        "--request-count", str(measured),
        *(["--warmup-request-count", str(warmups)] if warmups else []),
        "--artifact-dir", f"@JOBDIR@/bench/{run}",
        # every real /metrics (aiperf adds the router's own /metrics too)
        "--server-metrics", *metrics_urls,
    ]
    return Step(id=run, role="benchmark", kind="task", node=router.node, image=r.router.image, argv=argv,
                env=dict(AIPERF_ENV))


def _benchmarks(r: Recipe, router: Step, metrics_urls: list[str]) -> list[Step]:
    b = r.benchmark
    if b is None:
        return []
    base = f"{_host(r, router.node)}:{r.router.port}"
    tokenizer = b.tokenizer or r.model.source
    steps: list[Step] = []
    if b.aiperf:
        steps += [_aiperf_step(r, router, metrics_urls, scenario, c) for scenario in b.scenarios
                  for c in scenario.concurrency]
    if b.gsm8k:
        g = b.gsm8k
        # as InferenceX runs it (benchmarks/benchmark_lib.sh run_lm_eval), the tokenizer local
        model_args = (
            f"model={r.model.name},base_url=http://{base}/v1/chat/completions,"
            f"tokenizer={tokenizer},tokenizer_backend=huggingface,num_concurrent={g.concurrency},"
            f"eos_string=</s>,max_retries=5,timeout=1800,tokenized_requests=False,max_length={g.max_length}"
        )
        argv = [
            "lm_eval",
            "--model", "local-chat-completions",
            "--model_args", model_args,
            "--tasks", GSM8K_TASK,
            "--include_path", "@JOBDIR@/plan/lm_eval_tasks",
            "--num_fewshot", str(g.num_fewshot),
            "--apply_chat_template",
            "--gen_kwargs", f"max_tokens={g.max_tokens},temperature=0.0,top_p=1.0",
            "--log_samples",
            "--output_path", "@JOBDIR@/bench/gsm8k",
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
    metrics_urls = _metrics_urls(router, workers)
    return Plan(
        recipe=recipe,
        convert=_convert_step(recipe, convert_node),
        workers=workers,
        router=router,
        fingerprint=_report_step(recipe, router, "fingerprint"),
        benchmarks=_benchmarks(recipe, router, metrics_urls),
        summary=_report_step(recipe, router, "summary"),
    )


GSM8K_TASK = "gsm8k_local"


def gsm8k_task_yaml(data_path: str) -> str:
    """InferenceX's gsm8k task (its ``utils/evals/gsm8k.yaml``: the prompt asking for the answer
    as ``#### N`` on the last line, strict-match and flexible-extract, greedy) on gsm8k's 'main'
    config read from a local directory (jsonl or parquet files: question/answer)."""
    return "\n".join(
        [
            f"task: {GSM8K_TASK}",
            "dataset_path: " + data_path,
            "output_type: generate_until",
            "test_split: test",
            "fewshot_split: train",
            "num_fewshot: 5",
            "repeats: 1",
            'doc_to_text: "Question: {{question}}\\nEnd your response with the answer on the last line, '
            'formatted as: #### [number]\\nAnswer:"',
            'doc_to_target: "{{answer}}"',
            "metric_list:",
            "  - metric: exact_match",
            "    aggregation: mean",
            "    higher_is_better: true",
            "    ignore_case: true",
            "    ignore_punctuation: false",
            '    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]',
            "generation_kwargs:",
            '  until: ["</s>", "<|im_end|>"]',
            "  do_sample: false",
            "  temperature: 0.0",
            "filter_list:",
            "  - name: strict-match",
            "    filter:",
            "      - function: regex",
            '        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"',
            "        group_select: -1",
            "      - function: take_first",
            "  - name: flexible-extract",
            "    filter:",
            "      - function: regex",
            '        regex_pattern: "(-?[$0-9.,]{2,})|(-?[0-9]+)"',
            "        group_select: -1",
            "      - function: take_first",
            "metadata:",
            "  version: 3.0",
            "",
        ]
    )
