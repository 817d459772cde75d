"""Kubernetes manifests: valid against the Kubernetes schemas (offline, strict), GPU
resources, probes, the router Service, and the init container's conversion command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from decode_server.model_dir import MODEL_FILES, missing_files
from tests.deploy.conftest import DEPLOY, SLURM_DIR, fake_checkpoint, write_exe

K8S = DEPLOY / "k8s"
VERSIONS = ["1.30.0", "1.33.0"]


def _resources() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def _get(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in _resources() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _container(kind: str, name: str) -> dict[str, Any]:
    (c,) = _get(kind, name)["spec"]["template"]["spec"]["containers"]
    return c


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_offline_against_kubernetes_schemas(version: str) -> None:
    docs = _resources()
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} >= {
        ("Deployment", "prefill"), ("StatefulSet", "decode"), ("Deployment", "router"), ("Service", "router")}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_validation_does_reject_a_broken_manifest() -> None:
    doc = _get("Deployment", "router")
    doc["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = [8000]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
    doc = _get("Service", "router")
    doc["spec"]["portz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("kind,name,gpus", [("Deployment", "prefill", 8), ("StatefulSet", "decode", 8)])
def test_gpu_workers(kind: str, name: str, gpus: int) -> None:
    c = _container(kind, name)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"


def test_probes_and_router_service() -> None:
    assert _container("StatefulSet", "decode")["readinessProbe"]["httpGet"]["path"] == "/ready"
    router = _container("Deployment", "router")
    assert router["livenessProbe"]["httpGet"]["path"] == "/health"
    assert router["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert router["command"] == ["/usr/local/bin/pd-entrypoint", "router"]
    svc = _get("Service", "router")
    assert svc["spec"]["selector"] == _get("Deployment", "router")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["ports"][0]["port"] == int(_env(router)["PD_ROUTER_PORT"])


def test_exactly_one_prefill_and_wiring_between_roles() -> None:
    assert _get("Deployment", "prefill")["spec"]["replicas"] == 1
    decode = _get("StatefulSet", "decode")
    assert decode["spec"]["serviceName"] == "decode" and _get("Service", "decode")["spec"]["clusterIP"] == "None"
    prefill_env, decode_env = _env(_container("Deployment", "prefill")), _env(_container("StatefulSet", "decode"))
    router_env = _env(_container("Deployment", "router"))
    replicas = decode["spec"]["replicas"]
    # prefill handshakes with exactly the endpoint strings the decode pods advertise
    advertised = [decode_env["PD_DECODE_KV_HOST"].replace("$(POD_NAME)", f"decode-{i}")
                  + f":{decode_env['PD_DECODE_KV_PORT']}" for i in range(replicas)]
    assert prefill_env["PD_PREFILL_DECODE_KV_ENDPOINTS"].split(",") == advertised
    assert router_env["PD_ROUTER_DECODE"].split(",") == [f"http://decode-{i}.decode:{decode_env['PD_DECODE_PORT']}"
                                                         for i in range(replicas)]
    assert router_env["PD_ROUTER_PREFILL"] == f"http://prefill:{prefill_env['PD_PREFILL_PORT']}"
    assert prefill_env["PD_PREFILL_SERVED_MODEL_NAME"] == decode_env["PD_DECODE_SERVED_MODEL_NAME"]
    assert "$(POD_NAME).decode" in decode_env["PD_DECODE_KV_HOST"]
    assert decode_env["PD_DECODE_KV_DEVICE"] == "cuda:0"  # TileRT receives KV into VRAM
    # prefill starts only once every decode server is ready (its KV endpoint listens)
    (wait,) = _get("Deployment", "prefill")["spec"]["template"]["spec"]["initContainers"]
    assert wait["command"][:2] == ["/usr/local/bin/pd-entrypoint", "wait-ready"]
    assert wait["command"][2:] == [u + "/ready" for u in router_env["PD_ROUTER_DECODE"].split(",")]
    (init,) = decode["spec"]["template"]["spec"]["initContainers"]
    assert _env(init)["CONVERT_DST"] == decode_env["PD_DECODE_MODEL"]
    assert _env(init)["CONVERT_SRC"] == prefill_env["PD_PREFILL_MODEL"]


def test_every_pd_variable_is_an_option_of_its_component() -> None:
    """The manifests set the servers' own settings (``PD_<COMPONENT>_<OPTION>``): a misspelt
    or renamed variable would be ignored silently, so each must name a field."""
    from decode_server.settings import DecodeServerSettings
    from pd_deploy.launch import PrefillLaunchSettings
    from pd_router.settings import RouterSettings

    models = {"PD_DECODE_": DecodeServerSettings, "PD_PREFILL_": PrefillLaunchSettings,
              "PD_ROUTER_": RouterSettings}
    seen = 0
    for kind, name in (("Deployment", "prefill"), ("StatefulSet", "decode"), ("Deployment", "router")):
        for var in _env(_container(kind, name)):
            if not var.startswith("PD_"):
                continue
            prefix = next((p for p in models if var.startswith(p)), None)
            assert prefix is not None, f"{name}: {var} is not PD_<COMPONENT>_<OPTION>"
            assert var.removeprefix(prefix).lower() in models[prefix].model_fields, f"{name}: {var} is no option"
            seen += 1
    assert seen >= 15


def test_init_container_conversion_command_runs(tmp_path: Path) -> None:
    """The init container's command, with the converter replaced by a stub, through the
    same setup_deps.sh the decode image carries (as /usr/local/bin/pd-setup-deps)."""
    (init,) = _get("StatefulSet", "decode")["spec"]["template"]["spec"]["initContainers"]
    command = init["command"]
    assert command[:3] == ["/usr/local/bin/pd-setup-deps", "convert-env", "--"]
    stub = write_exe(tmp_path / "converter", '#!/usr/bin/env bash\nset -e\nwhile [ $# -gt 0 ]; do '
                     'case $1 in --model_dir) src=$2; shift;; --save_dir) dst=$2; shift;; esac; shift; done\n'
                     'for i in 1 2 3 4 5 6 7 8; do cp "$src/model-00001-of-00001.safetensors" '
                     '"$dst/model-$i.safetensors"; done\n')
    env = {**os.environ, **_env(init)}
    env.pop("HF_TOKEN", None)
    env["CONVERT_SRC"] = str(fake_checkpoint(tmp_path / "src"))
    env["CONVERT_DST"] = str(tmp_path / "dst")
    env["CONVERT_PYTHON"] = sys.executable  # the decode image's python3 has the package; this one too
    argv = ["bash", str(SLURM_DIR / "setup_deps.sh"), *command[1:3], str(stub), *command[4:]]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert len(list((tmp_path / "dst").glob("*.safetensors"))) == int(env["CONVERT_SHARDS"])
    # a complete model directory for the TileRT decode server, checked as it reads it
    assert env["CONVERT_MODEL_FILES"].split() == list(MODEL_FILES["tilert"]) and env["CONVERT_ENGINE"] == "tilert"
    assert missing_files(tmp_path / "dst", "tilert") == []
    assert "complete for the tilert engine; stop token ids" in out.stderr
    again = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert "reusing complete conversion" in again.stderr
    env.pop("CONVERT_SHARDS")
    bad = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode != 0 and "CONVERT_SHARDS is not set" in bad.stderr


def test_manifests_use_the_recipes_images_and_ports() -> None:
    recipe = yaml.safe_load((DEPLOY / "recipes" / "glm5.1-fp8-b200.yaml").read_text())
    assert _container("Deployment", "prefill")["image"] == recipe["prefill"]["image"]
    assert _container("StatefulSet", "decode")["image"] == recipe["decode"]["image"]
    assert _container("Deployment", "router")["image"] == recipe["router"]["image"]
    assert int(_env(_container("StatefulSet", "decode"))["PD_DECODE_KV_PORT"]) == recipe["decode"]["kv_port"]
    assert _env(_container("Deployment", "prefill"))["PD_PREFILL_MODEL"] == recipe["model"]["source"]
    assert _env(_container("StatefulSet", "decode"))["PD_DECODE_MODEL"] == recipe["model"]["converted"]
