"""The whole PD stack (vLLM prefill + TileRTConnector + reference decode + router) on
loopback, once per session (vLLM alone, to compare with: tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from pd_deploy.stack.launcher import Stack, StackConfig
from tests.procs import free_port, port_is_free


def _ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


MODEL_NAME = "tiny-glm"  # as `make run` serves it, so the README's commands work as written


def _port_run(n: int, taken: set[int]) -> int:
    """The first of ``n`` consecutive free ports, none in ``taken`` (decode server i listens
    on base + i)."""
    while True:
        base = free_port()
        run = range(base, base + n)
        if base + n <= 65535 and not taken.intersection(run) and all(port_is_free(p) for p in run[1:]):
            taken.update(run)
            return base


def make_stack_config(model_dir: Path, log_dir: Path, **overrides) -> StackConfig:
    n = overrides.get("num_decode", 1)
    taken: set[int] = set()
    router, prefill = (_port_run(1, taken) for _ in range(2))
    decode, kv = (_port_run(n, taken) for _ in range(2))
    return StackConfig(model_dir=model_dir, log_dir=log_dir, router_port=router, prefill_port=prefill,
                       decode_port=decode, kv_port=kv, served_model_name=MODEL_NAME, **overrides)


@contextmanager
def running_stack(cfg: StackConfig) -> Iterator[Stack]:
    stack = Stack(cfg)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def pd_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(make_stack_config(tiny_model_dir, tmp_path_factory.mktemp("pd-stack-logs"))) as stack:
        yield stack


DECODE_CONTEXT_TWO = 1024  # the 2-decode stack's decode servers take shorter prompts than its prefill (4096)


@pytest.fixture(scope="package")
def pd_stack_two(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two decode servers (each ``DECODE_CONTEXT_TWO`` tokens long) behind one router that reads
    the tenant from ``X-Tenant``; shared by the modules of this package that need two (one start)."""
    cfg = make_stack_config(tiny_model_dir, tmp_path_factory.mktemp("pd-stack-two"), num_decode=2,
                            decode_args=("--max-seq-len", str(DECODE_CONTEXT_TWO)),
                            router_args=("--tenant-header", "X-Tenant"))
    with running_stack(cfg) as stack:
        yield stack


@pytest.fixture(scope="session")
def model_name() -> str:
    return MODEL_NAME


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def vllm_kv_usage(prefill_url: str) -> float:
    for line in httpx.get(f"{prefill_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:kv_cache_usage_perc not in vLLM's /metrics")
