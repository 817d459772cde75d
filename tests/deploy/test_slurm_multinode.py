"""submit.sh for the GLM-5.1 recipe (prefill node + decode node, containers via pyxis),
with fake Slurm client commands (tests/fakes/fake_slurm) simulating a two-node allocation
whose node names are loopback names, and stand-in servers. Checks what the real
single-node cluster cannot show: the role -> node mapping, the per-role container flags,
the sbatch request, and host names substituted into every command."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pd_deploy.recipe import build_plan, parse_recipe
from pd_deploy.recipe.fingerprint_model import Fingerprint
from pd_settings.servers import read_servers_file
from tests.deploy.conftest import SLURM_DIR, dump_recipe, fake_checkpoint, load_recipe_dict, write_exe
from tests.deploy.jobs import alive
from tests.procs import REPO, free_port

# integration: jobs through a fake Slurm, stand-in servers as processes
pytestmark = [pytest.mark.timeout(180), pytest.mark.integration]

FAKE_SLURM = REPO / "tests" / "fakes" / "fake_slurm"
HOSTS = ["127.0.0.1", "localhost"]  # node 0 (prefill + router), node 1 (decode)


def _nul_file(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


def _opts(argv: list[str]) -> dict[str, str]:
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--") and
            not argv[i + 1].startswith("--")}


def test_two_node_job_with_pyxis_containers(tmp_path: Path, standin_python: Path) -> None:
    data = load_recipe_dict("glm5.1-fp8-b200.yaml")
    data["model"]["source"] = str(fake_checkpoint(tmp_path / "models" / "GLM-5.1-FP8"))
    data["model"]["converted"] = str(tmp_path / "models" / "tilert" / "GLM-5.1-FP8")
    converter = write_exe(tmp_path / "converter", '#!/usr/bin/env bash\nfor i in 0 1 2 3 4 5 6 7; do '
                          'echo w > "$1/rank-$i.safetensors"; done\n')
    data["conversion"]["command"] = [str(converter), "{dst}"]
    for role in ("prefill", "decode", "router"):
        data[role]["python"] = str(standin_python)
    data["prefill"]["port"], data["router"]["port"] = free_port(), free_port()
    data["decode"]["port"], data["decode"]["kv_port"] = free_port(), free_port()
    data["slurm"].update(bind_host="127.0.0.1", gate_timeout_s=60, hold=False)
    data.pop("benchmark")
    recipe = dump_recipe(data, tmp_path / "recipe.yaml")
    state_dir, records, job_dir = tmp_path / "fake-slurm", tmp_path / "records", tmp_path / "job"
    state_dir.mkdir()
    records.mkdir()
    env = {**os.environ, "PATH": f"{FAKE_SLURM}:{os.environ['PATH']}", "PYTHON": sys.executable,
           "FAKE_SLURM_DIR": str(state_dir), "FAKE_SLURM_HOSTS": " ".join(HOSTS), "STANDIN_DIR": str(records)}
    out = subprocess.run([str(SLURM_DIR / "submit.sh"), "--job-dir", str(job_dir), str(recipe)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    batch_pid = int((state_dir / "batch.pid").read_text())
    try:
        deadline = time.monotonic() + 120
        while alive(batch_pid) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:  # the fake job runs in its own session: end whatever is left of it
        try:
            os.killpg(batch_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    log = (job_dir / "logs" / "job-4242.out").read_text()
    assert (job_dir / "state").read_text().strip() == "done", log

    sbatch = _nul_file(state_dir / "sbatch.args")
    assert _opts(sbatch)["--nodes"] == "2" and _opts(sbatch)["--gpus-per-node"] == "8"
    assert _opts(sbatch)["--partition"] == "b200" and "--exclusive" in sbatch
    assert sbatch[-2:] == ["--in-job", str(job_dir)]

    plan = build_plan(parse_recipe(data))
    images = {s.id: s.image for s in plan.steps}
    nodes = {"convert": "localhost", "prefill": "127.0.0.1", "decode0": "localhost", "router": "127.0.0.1"}
    for step, host in nodes.items():
        opts = _opts(_nul_file(state_dir / f"srun.{step}"))
        assert opts["--nodelist"] == host, step
        assert opts["--container-image"] == images[step], step
        assert opts["--container-mounts"] == f"{job_dir}:{job_dir},/shared:/shared", step
    assert images["prefill"] != images["decode0"]
    # the fingerprint and summary steps ran on the router's node, in its image, and name every node
    for step in ("fingerprint", "summary"):
        opts = _opts(_nul_file(state_dir / f"srun.{step}"))
        assert (opts["--nodelist"], opts["--container-image"]) == ("127.0.0.1", images["router"]), step
    fp = Fingerprint.model_validate_json((job_dir / "fingerprint.json").read_text())
    assert fp.hosts == HOSTS and fp.recipe.sha256 == hashlib.sha256(recipe.read_bytes()).hexdigest()
    assert [(s.id, s.host, s.image) for s in fp.services] == [(i, nodes[i], images[i]) for i in ("decode0", "prefill",
                                                                                                  "router")]
    assert (job_dir / "summary.md").exists()

    rec = {r: json.loads((records / f"{r}.json").read_text()) for r in ("prefill", "decode", "router")}
    kv = json.loads(rec["prefill"]["argv"][rec["prefill"]["argv"].index("--kv-transfer-config") + 1])
    # router and connector watch one servers file, written by the job with the real host names
    assert kv["kv_connector_extra_config"]["servers_file"] == f"{job_dir}/servers.yaml"
    decode_argv = rec["decode"]["argv"]
    assert decode_argv[decode_argv.index("--kv-host") + 1] == "localhost"
    router_argv = rec["router"]["argv"]
    assert router_argv[router_argv.index("--servers-file") + 1] == f"{job_dir}/servers.yaml"
    listed = read_servers_file(job_dir / "servers.yaml")
    assert [(d.url, d.kv_endpoint) for d in listed.decode] == [
        (f"http://localhost:{data['decode']['port']}", f"localhost:{data['decode']['kv_port']}")]
    assert listed.prefill == (f"http://127.0.0.1:{data['prefill']['port']}",)
    assert rec["router"]["started"] > rec["decode"]["ready"]
    assert len(list(Path(data["model"]["converted"]).glob("*.safetensors"))) == 8
    # the job stopped every server with SIGTERM (router first) and nothing is left
    stops = (state_dir / "scancel.log").read_text().split()
    assert stops[::2] == ["TERM"] * 3 and stops[1] == str(rec["router"]["pid"])
    for role, r in rec.items():
        assert json.loads((records / f"{role}.json").read_text())["stopped"], role
        assert not alive(r["pid"]), role
