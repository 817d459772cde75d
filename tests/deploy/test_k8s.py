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


@pytest.mark.parametrize("kind,name", [("Deployment", "prefill"), ("StatefulSet", "decode"), ("Deployment", "router")])
def test_every_pods_metrics_are_scraped(kind: str, name: str) -> None:
    """Each pod's /metrics (with its *_build_info) is announced to Prometheus, on the port it serves."""
    annotations = _get(kind, name)["spec"]["template"]["metadata"]["annotations"]
    http = next(p for p in _container(kind, name)["ports"] if p["name"] == "http")
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(http["containerPort"]),
                           "prometheus.io/path": "/metrics"}


def test_wiring_between_roles_is_discovered_by_dns() -> None:
    """No hand-edited server lists: two routers and the prefill connector resolve the headless
    Services, and the KV endpoint a decode pod advertises (its pod IP) is the string the
    connector builds from the DNS answer."""
    assert _get("Deployment", "prefill")["spec"]["replicas"] == 1
    assert _get("Deployment", "router")["spec"]["replicas"] == 2
    decode = _get("StatefulSet", "decode")
    assert decode["spec"]["serviceName"] == "decode"
    for name in ("decode", "prefill"):
        assert _get("Service", name)["spec"]["clusterIP"] == "None"  # headless: one address per pod
    prefill_env, decode_env = _env(_container("Deployment", "prefill")), _env(_container("StatefulSet", "decode"))
    router_env = _env(_container("Deployment", "router"))
    for listed in ("PD_ROUTER_PREFILL", "PD_ROUTER_DECODE", "PD_PREFILL_DECODE_KV_ENDPOINTS"):
        assert listed not in router_env and listed not in prefill_env
    port = {name: {p["name"]: p["port"] for p in _get("Service", name)["spec"]["ports"]}
            for name in ("decode", "prefill")}
    assert router_env["PD_ROUTER_DECODE_DNS"] == f"http://decode:{port['decode']['http']}"
    assert router_env["PD_ROUTER_PREFILL_DNS"] == f"http://prefill:{port['prefill']['http']}"
    assert prefill_env["PD_PREFILL_DECODE_KV_DNS"] == f"decode:{port['decode']['kv']}"
    assert int(decode_env["PD_DECODE_PORT"]) == port["decode"]["http"]
    assert int(decode_env["PD_DECODE_KV_PORT"]) == port["decode"]["kv"]
    assert int(prefill_env["PD_PREFILL_PORT"]) == port["prefill"]["http"]
    assert decode_env["PD_DECODE_KV_HOST"] == "$(POD_IP)"
    (pod_ip,) = [e for e in _container("StatefulSet", "decode")["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert prefill_env["PD_PREFILL_SERVED_MODEL_NAME"] == decode_env["PD_DECODE_SERVED_MODEL_NAME"]
    for parser in ("TOOL_CALL_PARSER", "REASONING_PARSER"):  # the first token under the decode side's grammar
        assert prefill_env[f"PD_PREFILL_{parser}"] == decode_env[f"PD_DECODE_{parser}"]
    assert decode_env["PD_DECODE_KV_DEVICE"] == "cuda:0"  # TileRT receives KV into VRAM
    # prefill need not wait for decode: its connector handshakes decode pods as they appear
    assert "initContainers" not in _get("Deployment", "prefill")["spec"]["template"]["spec"]
    (init,) = decode["spec"]["template"]["spec"]["initContainers"]
    assert _env(init)["CONVERT_DST"] == decode_env["PD_DECODE_MODEL"]
    assert _env(init)["CONVERT_SRC"] == prefill_env["PD_PREFILL_MODEL"]


async def test_the_dns_settings_give_matching_router_and_connector_endpoints() -> None:
    """The manifests' settings, read by the router and the connector with a resolver that
    answers two decode pod IPs: the router gets their HTTP URLs, the connector their KV
    endpoints, exactly what each pod advertises (PD_DECODE_KV_HOST = pod IP)."""
    from connector.config import load_settings as connector_settings
    from connector.endpoints import DecodeEndpoints
    from pd_deploy.launch import PrefillLaunchSettings
    from pd_router.fleet.backends import Backends
    from pd_router.fleet.discovery import Discovery
    from pd_router.settings import load_settings as router_settings
    from pd_settings.loader import load
    from tests.fakes.fake_resolver import FakeResolver

    pods = ["10.1.0.7", "10.1.0.8"]
    resolver = FakeResolver({"decode": pods, "prefill": ["10.1.1.1"]})
    router_env = {k: v for k, v in _env(_container("Deployment", "router")).items() if not k.endswith("_FILE")}
    rs = router_settings([], router_env)
    discovery = Discovery(rs, Backends.from_urls((), (), None, True), resolver=resolver)
    await discovery.refresh()
    decode_env = _env(_container("StatefulSet", "decode"))
    assert [d.url for d in discovery.backends.decode] == [f"http://{ip}:{decode_env['PD_DECODE_PORT']}" for ip in pods]
    assert [p.url for p in discovery.backends.prefill] == ["http://10.1.1.1:8100"]
    prefill_env = {k: v for k, v in _env(_container("Deployment", "prefill")).items() if not k.endswith("_FILE")}
    launch = load(PrefillLaunchSettings, None, prefill_env)
    endpoints = DecodeEndpoints(connector_settings({"decode_kv_dns": list(launch.decode_kv_dns)}), resolver)
    advertised = [decode_env["PD_DECODE_KV_HOST"].replace("$(POD_IP)", ip) + ":" + decode_env["PD_DECODE_KV_PORT"]
                  for ip in pods]
    assert list(endpoints.refresh()) == advertised


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


@pytest.mark.parametrize("kind,name,prefix", [("Deployment", "router", "PD_ROUTER_"),
                                              ("StatefulSet", "decode", "PD_DECODE_")])
def test_the_grace_period_covers_the_prestop_and_the_drain(kind: str, name: str, prefix: str) -> None:
    pod = _get(kind, name)["spec"]["template"]["spec"]
    container = _container(kind, name)
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    drain = float(_env(container)[prefix + "DRAIN_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] >= int(sleep[1]) + drain + 5  # + the server's own shutdown


def test_secrets_are_generated_mounted_and_read_from_files(tmp_path: Path) -> None:
    """Issue 12: the decode API key and the KV channel's shared secret reach each role as files
    of the Secret the kustomization generates (never as a value in a manifest or an argument)."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (gen,) = kustomization["secretGenerator"]
    keys = {item.split("=", 1)[0]: item.split("=", 1)[1] for item in gen["files"]}
    assert gen["name"] == "pd-secrets" and set(keys) == {"decode-api-key", "kv-secret"}
    wanted = {("StatefulSet", "decode"): {"PD_DECODE_API_KEY_FILE": "decode-api-key",
                                          "PD_DECODE_KV_SECRET_FILE": "kv-secret"},
              ("Deployment", "prefill"): {"PD_PREFILL_KV_SECRET_FILE": "kv-secret"},
              ("Deployment", "router"): {"PD_ROUTER_DECODE_API_KEY_FILE": "decode-api-key"}}
    for (kind, name), env_keys in wanted.items():
        spec = _get(kind, name)["spec"]["template"]["spec"]
        (volume,) = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "pd-secrets"]
        assert volume["secret"]["defaultMode"] == 0o400
        (mount,) = [m for m in _container(kind, name)["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["readOnly"] is True
        env = _env(_container(kind, name))
        for var, key in env_keys.items():
            assert env[var] == f"{mount['mountPath']}/{key}", (name, var)
        args = " ".join(_container(kind, name).get("args", []) + _container(kind, name).get("command", []))
        assert "secret" not in args and "api-key" not in args
    out = subprocess.run([str(K8S / "make-secrets.sh"), str(tmp_path / "s")], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    values = {}
    for key in keys:
        path = tmp_path / "s" / key
        assert path.stat().st_mode & 0o777 == 0o600
        values[key] = path.read_text().strip()
        assert len(values[key]) == 64
    assert len(set(values.values())) == 2
    subprocess.run([str(K8S / "make-secrets.sh"), str(tmp_path / "s")], check=True, capture_output=True, timeout=30)
    assert {k: (tmp_path / "s" / k).read_text().strip() for k in keys} == values  # kept, not rotated
