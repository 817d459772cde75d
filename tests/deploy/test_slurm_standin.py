"""submit.sh on a real single-node Slurm cluster, with stand-in servers.

The job is the real one (render, sbatch, srun steps, conversion, gates, router, smoke
test, benchmarks, hold, stop); only the server processes are stand-ins
(tests/fakes/deploy_standin.py) that record their argv and timing, so the order and the
gates are checked exactly. tests/deploy/test_slurm_multinode_cpu.py runs the real CPU stack
(on three nodes).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from pd_deploy.recipe import build_plan, parse_recipe
from pd_deploy.recipe.fingerprint_model import Fingerprint
from tests.deploy.conftest import (
    dump_recipe,
    fake_checkpoint,
    load_recipe_dict,
    read_records,
    recording_stub,
)
from tests.deploy.jobs import alive, submit_job, wait_state
from tests.deploy.slurm_cluster import SlurmCluster
from tests.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DECODE_DELAY = 3.0


def _recipe(tmp: Path, python: Path, gate_timeout: int = 60) -> dict[str, Any]:
    data = load_recipe_dict("cpu-tiny.yaml")
    data["model"]["source"] = str(fake_checkpoint(tmp / "models" / "tiny-glm"))
    data["model"]["converted"] = str(tmp / "models" / "decode" / "tiny-glm")
    for role in ("prefill", "decode", "router"):
        data[role]["python"] = str(python)
    data["prefill"]["port"] = free_port()
    data["router"]["port"] = free_port()
    data["decode"]["port"] = free_port()
    data["decode"]["kv_port"] = free_port()
    data["slurm"]["gate_timeout_s"] = gate_timeout
    data["benchmark"] = {"entry": {"hw": "cpu", "framework": "standin", "precision": "bf16", "model_prefix": "tiny"},
                         "scenarios": [{"isl": 16, "osl": 8, "concurrency": [1, 2]}],
                         "tokenizer": data["model"]["source"],
                         "gsm8k": {"data_path": str(tmp / "gsm8k"), "limit": 4, "concurrency": 2}}
    return data


# lm_eval's stand-in: a results file in --output_path, every question answered and right
LM_EVAL_PASSES = """out=; prev=; for a in "$@"; do [[ $prev == --output_path ]] && out=$a; prev=$a; done
mkdir -p "$out/stub"
echo '{"results": {"gsm8k_local": {"exact_match,strict-match": 1.0, "exact_match,flexible-extract": 1.0}},' \\
     '"n-samples": {"gsm8k_local": {"original": 4, "effective": 4}}}' > "$out/stub/results_stub.json"
"""


def test_job_orders_gates_serves_and_stops(slurm_cluster: SlurmCluster, tmp_path: Path,
                                           standin_python: Path) -> None:
    records, stubs = tmp_path / "records", tmp_path / "bin"
    records.mkdir()
    recording_stub(stubs, "aiperf", records)
    recording_stub(stubs, "lm_eval", records, then=LM_EVAL_PASSES)
    data = _recipe(tmp_path, standin_python)
    recipe = dump_recipe(data, tmp_path / "recipe.yaml")
    job_dir = tmp_path / "job"
    env = {"STANDIN_DIR": str(records), "STANDIN_DECODE_DELAY": str(DECODE_DELAY),
           "PATH": f"{stubs}:{os.environ['PATH']}"}
    job_id = submit_job(slurm_cluster, recipe, job_dir, env)
    wait_state(job_dir, "serving", slurm_cluster, job_id, timeout=120)

    rec = {r: json.loads((records / f"{r}.json").read_text()) for r in ("prefill", "decode", "router")}
    plan = build_plan(parse_recipe(data))
    # every server got exactly the command the plan (pd_deploy.commands) built
    # (with @JOBDIR@ replaced: the job's secrets are files in the job directory)
    for step in plan.workers + [plan.router]:
        want = [a.replace("@JOBDIR@", str(job_dir.resolve())) for a in step.argv[1:]]
        assert rec[step.role]["argv"] == want, step.id
    # the conversion ran once, before the servers, into a validated directory
    converted = Path(data["model"]["converted"])
    assert (converted / ".tilert-pd-complete").exists()
    assert converted.stat().st_mtime <= rec["prefill"]["started"]
    # gates: prefill started only once the (delayed) decode was ready, the router only
    # once both were
    assert rec["decode"]["ready"] >= rec["decode"]["started"] + DECODE_DELAY - 0.5
    assert rec["prefill"]["started"] > rec["decode"]["ready"]
    assert rec["router"]["started"] > rec["decode"]["ready"]
    assert rec["router"]["started"] > rec["prefill"]["ready"]
    # smoke test, then the benchmarks through the router, offline with the local tokenizer
    assert json.loads((job_dir / "smoke.json").read_text())["choices"][0]["message"]["content"]
    aiperf = read_records(records, "aiperf")
    assert sorted(a[a.index("--concurrency") + 1] for a in aiperf) == ["1", "2"]
    assert all(a[a.index("--tokenizer") + 1] == data["model"]["source"] for a in aiperf)
    port = data["router"]["port"]
    assert all(a[a.index("--url") + 1] == f"127.0.0.1:{port}" for a in aiperf)
    servers = [f"http://127.0.0.1:{data[role]['port']}/metrics" for role in ("router", "prefill", "decode")]
    assert all(a[a.index("--server-metrics") + 1:] == servers for a in aiperf)
    # fingerprint.json before the benchmarks: the stand-ins report no build info, and it says so
    fp = Fingerprint.model_validate_json((job_dir / "fingerprint.json").read_text())
    assert [(s.role, s.build) for s in fp.services] == [("decode", []), ("prefill", []), ("router", [])]
    assert all(s.absent and s.metrics_url in s.absent for s in fp.services)
    assert (job_dir / "fingerprint.json").stat().st_mtime <= min(p.stat().st_mtime for p in records.glob("aiperf.*"))
    summary = (job_dir / "summary.md").read_text()
    assert fp.recipe.sha256 in summary and "| 1 | no result: FileNotFoundError" in summary
    assert "**PASS**: both at or above 0.9" in summary  # the stub's results file, graded
    (lm_eval,) = read_records(records, "lm_eval")
    assert lm_eval[lm_eval.index("--include_path") + 1] == f"{job_dir}/plan/lm_eval_tasks"
    assert str(tmp_path / "gsm8k") in (job_dir / "plan" / "lm_eval_tasks" / "gsm8k_local.yaml").read_text()

    # a client through the router while the job serves (the official SDK)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=10)
    reply = client.chat.completions.create(model="tiny-glm", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content

    (job_dir / "STOP").touch()
    assert slurm_cluster.wait_job_end(job_id, timeout=90) == "COMPLETED"
    assert (job_dir / "state").read_text().strip() == "done"
    for role, r in rec.items():
        final = json.loads((records / f"{role}.json").read_text())
        assert final["stopped"], f"{role} was not stopped by SIGTERM"
        assert not alive(r["pid"]), f"{role} (pid {r['pid']}) still running"
    assert slurm_cluster.run(["squeue", "-h"]).stdout.strip() == ""


def test_gate_timeout_fails_the_job_and_stops_everything(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                         standin_python: Path) -> None:
    records = tmp_path / "records"
    records.mkdir()
    data = _recipe(tmp_path, standin_python, gate_timeout=4)
    data.pop("benchmark")
    recipe = dump_recipe(data, tmp_path / "recipe.yaml")
    job_dir = tmp_path / "job"
    job_id = submit_job(slurm_cluster, recipe, job_dir, {"STANDIN_DIR": str(records), "STANDIN_DECODE_DELAY": "600"})
    assert slurm_cluster.wait_job_end(job_id, timeout=120) == "FAILED"
    assert (job_dir / "state").read_text().strip() == "failed"
    for role in ("prefill", "router"):
        assert not (records / f"{role}.json").exists(), f"{role} must not start before the decode gate passes"
    job_log = next((job_dir / "logs").glob("job-*.out")).read_text()
    assert "/ready not ready after 4s" in job_log
    r = json.loads((records / "decode.json").read_text())
    assert r["stopped"] and not alive(r["pid"])


def test_scancel_stops_every_server(slurm_cluster: SlurmCluster, tmp_path: Path, standin_python: Path) -> None:
    records = tmp_path / "records"
    records.mkdir()
    data = _recipe(tmp_path, standin_python)
    data.pop("benchmark")
    job_dir = tmp_path / "job"
    job_id = submit_job(slurm_cluster, dump_recipe(data, tmp_path / "recipe.yaml"), job_dir,
                        {"STANDIN_DIR": str(records)})
    wait_state(job_dir, "serving", slurm_cluster, job_id, timeout=120)
    pids = {r: json.loads((records / f"{r}.json").read_text())["pid"] for r in ("prefill", "decode", "router")}
    slurm_cluster.run(["scancel", job_id])
    assert slurm_cluster.wait_job_end(job_id, timeout=90) == "CANCELLED"
    deadline = time.monotonic() + 30  # the batch script may still be stopping the steps
    while (job_dir / "state").read_text().strip() not in ("done", "failed", "cancelled") \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (job_dir / "state").read_text().strip() == "cancelled"
    for role, pid in pids.items():
        assert json.loads((records / f"{role}.json").read_text())["stopped"], f"{role} got no SIGTERM"
        assert not alive(pid), role


def test_gsm8k_below_its_threshold_fails_the_job(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                 standin_python: Path) -> None:
    """lm-eval's scores under the threshold (0.9, InferenceX's default for a model without
    one): summary.md says FAIL with both scores, and the job ends failed."""
    records, stubs = tmp_path / "records", tmp_path / "bin"
    records.mkdir()
    recording_stub(stubs, "lm_eval", records, then=LM_EVAL_PASSES.replace('"exact_match,flexible-extract": 1.0',
                                                                          '"exact_match,flexible-extract": 0.5'))
    data = _recipe(tmp_path, standin_python)
    data["benchmark"]["aiperf"] = False
    job_dir = tmp_path / "job"
    job_id = submit_job(slurm_cluster, dump_recipe(data, tmp_path / "recipe.yaml"), job_dir,
                        {"STANDIN_DIR": str(records), "PATH": f"{stubs}:{os.environ['PATH']}"})
    assert slurm_cluster.wait_job_end(job_id, timeout=120) == "FAILED"
    assert (job_dir / "state").read_text().strip() == "failed"
    summary = (job_dir / "summary.md").read_text()
    assert "**FAIL**: flexible-extract below 0.9" in summary
    assert "| strict-match | 1.0000 |" in summary and "| flexible-extract | 0.5000 |" in summary
    job_log = next((job_dir / "logs").glob("job-*.out")).read_text()
    assert "step summary failed" in job_log
