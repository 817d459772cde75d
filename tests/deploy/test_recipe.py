"""Recipe schema, topology checks and dry-run output."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from pd_deploy.recipe import RecipeError, build_plan, conversion_env, parse_recipe, write_plan
from pd_deploy.recipe.fingerprint_model import Fingerprint
from pd_deploy.recipe.plan import servers_file
from tests.deploy.conftest import DEPLOY, dump_recipe, load_recipe_dict
from tests.procs import REPO

pytestmark = pytest.mark.integration  # the recipe command and submit.sh as subprocesses

GLM = "glm5.1-fp8-b200.yaml"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pd_deploy.recipe", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


@pytest.mark.parametrize("name", sorted(p.name for p in (DEPLOY / "recipes").glob("*.yaml")))
def test_shipped_recipes_validate(name: str) -> None:
    out = _cli("validate", str(DEPLOY / "recipes" / name))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{DEPLOY / 'recipes' / name}: ok")


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        d[last] = value
    return edit


def _pop(path: str) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        d.pop(last)
    return edit


BAD_TOPOLOGIES = [
    ("two prefill nodes", _set("prefill.nodes", 2), "prefill.nodes = 2: exactly one prefill node"),
    ("no prefill node", _set("prefill.nodes", 0), "prefill.nodes = 0: exactly one prefill node"),
    ("no decode node", _set("decode.nodes", 0), "decode.nodes = 0: at least one decode node"),
    ("decode on 4 GPUs", _set("decode.gpus_per_node", 4), "decode.gpus_per_node = 4: GLM-5 decode with TileRT "
                                                          "needs 8 GPUs"),
    ("MTP off", _set("mtp.enabled", False), "mtp.enabled = False: MTP is required"),
    ("decode without MTP drafts", _set("decode.num_mtp", 0), "decode.num_mtp = 0: MTP is required"),
    ("prefill without image", _pop("prefill.image"), "prefill.image = None: the prefill role has no image"),
    ("decode without image", _pop("decode.image"), "decode.image = None: the decode role has no image"),
    ("router without image", _pop("router.image"), "router.image = None: the router role has no image"),
    ("one image for both", _set("decode.image", "tilert-pd-prefill:0.1.0"),
     "prefill and decode cannot share one image"),
    ("TP beyond the node", _set("prefill.tensor_parallel", 16), "prefill.tensor_parallel = 16: larger than"),
    ("TileRT with 2 slots", _set("decode.slots", 2), "decode.slots = 2: TileRT decodes one sequence"),
    ("TileRT without conversion", _pop("conversion"), "conversion = None: the tilert engine needs"),
    ("GLM on the reference engine", _set("decode.engine", "reference"), "decode.engine = 'reference'"),
    ("colocated TileRT", _set("slurm.colocate", True), "slurm.colocate = True: a TileRT decode server needs"),
    ("gsm8k from the hub", _set("benchmark.gsm8k.data_path", "openai/gsm8k"),
     "benchmark.gsm8k.data_path = 'openai/gsm8k': must be an absolute local path"),
    ("HF_HOME disagreement", _set("decode.env", {"HF_HOME": "/other"}), "*.env.HF_HOME"),
    ("unknown field", _set("decode.gpus", 8), "decode.gpus = 8: Extra inputs are not permitted"),
    ("bad port", _set("router.port", 70000), "router.port = 70000: Input should be less than or equal to 65535"),
    ("router on the prefill port", _set("router.port", 8100), "router.port = 8100: the router runs on the "
                                                             "prefill node"),
    ("conversion without the chat template", _set("conversion.model_files", ["tokenizer.json", "config.json"]),
     "conversion.model_files = ['tokenizer.json', 'config.json']: the tilert decode server also reads "
     "tokenizer_config.json, chat_template.jinja, generation_config.json from the converted directory"),
]


@pytest.mark.parametrize("edit,message", [b[1:] for b in BAD_TOPOLOGIES], ids=[b[0] for b in BAD_TOPOLOGIES])
def test_bad_topology_is_rejected_with_a_clear_message(edit: Callable[[dict], None], message: str,
                                                       tmp_path: Path) -> None:
    data = load_recipe_dict(GLM)
    edit(data)
    with pytest.raises(RecipeError) as exc:
        parse_recipe(copy.deepcopy(data), "r.yaml")
    assert message in str(exc.value)
    # the command line says the same and exits 2
    out = _cli("validate", str(dump_recipe(data, tmp_path / "bad.yaml")))
    assert out.returncode == 2
    assert message in out.stderr


def test_every_problem_is_reported_at_once() -> None:
    data = load_recipe_dict(GLM)
    data["prefill"]["nodes"] = 2
    data["mtp"]["enabled"] = False
    data["decode"]["gpus_per_node"] = 4
    with pytest.raises(RecipeError) as exc:
        parse_recipe(data)
    fields = [p.field for p in exc.value.problems]
    assert fields == ["prefill.nodes", "decode.gpus_per_node", "mtp.enabled"]


def test_unreadable_recipe(tmp_path: Path) -> None:
    (tmp_path / "x.yaml").write_text("name: [unclosed\n")
    out = _cli("validate", str(tmp_path / "x.yaml"), str(tmp_path / "missing.yaml"))
    assert out.returncode == 2
    assert "x.yaml: invalid recipe" in out.stderr and "missing.yaml: invalid recipe" in out.stderr


def test_dry_run_prints_every_process_of_every_node() -> None:
    out = _cli("dry-run", str(DEPLOY / "recipes" / GLM), "--hosts", "pf0,dc0", "--job-dir", "/shared/run1")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    node0, node1 = text.split("== node 1 (dc0) ==")
    assert "== node 0 (pf0) ==" in node0
    cmds = {line.split("] ")[0][1:]: None for line in text.splitlines() if line.startswith("[")}
    assert list(cmds) == ["prefill", "router", "fingerprint", "aiperf-1k1k-c1", "aiperf-8k1k-c1",
                          "gsm8k", "summary", "convert", "decode0"]
    # the benchmark entry: 1k/1k and 8k/1k at concurrency 1 (InferenceX's client settings), gsm8k graded
    assert "  scenario 1k1k: isl 1024, osl 1024, concurrency 1: 10 requests (+2 warm-up)" in text
    assert "  scenario 8k1k: isl 8192, osl 1024, concurrency 1: 10 requests (+2 warm-up)" in text
    assert "lengths uniform in [0.8 x, 1 x] isl|osl, ignore_eos, warm-ups not measured" in text
    assert ("passes when strict-match and flexible-extract are both >= 0.93 (InferenceX's threshold for glm5.1); "
            "below it the job fails") in text and "  gsm8k: every question of /shared/datasets/gsm8k/main" in text
    commands = [shlex.split(line[4:]) for line in text.splitlines() if line.startswith("  $ ")]
    prefill, router, fingerprint, *bench, summary, convert, decode = commands
    assert fingerprint == ["python3", "-m", "pd_deploy.report", "fingerprint", "--job-dir", "/shared/run1"]
    assert summary == ["python3", "-m", "pd_deploy.report", "summary", "--job-dir", "/shared/run1"]
    assert prefill[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert prefill[prefill.index("--tensor-parallel-size") + 1] == "8"
    assert json.loads(prefill[prefill.index("--speculative-config") + 1])["method"] == "mtp"
    # vLLM 0.32 on SM100 allocates the 656-byte fp8_ds_mla rows (64-token blocks) only when told to
    assert prefill[prefill.index("--kv-cache-dtype") + 1] == "fp8_ds_mla"
    assert prefill[prefill.index("--block-size") + 1] == "64"
    # the decode side's output parsers: the first token under the grammar the tools and reasoning make
    assert "--enable-auto-tool-choice" in prefill and prefill[prefill.index("--tool-call-parser") + 1] == "glm47"
    assert prefill[prefill.index("--reasoning-parser") + 1] == "glm45"
    kv = json.loads(prefill[prefill.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "TileRTConnector" and kv["kv_role"] == "kv_producer"
    # the job's secrets by file (generated 0600 into the job dir by render), never on a command line
    # the servers come from the job's servers file, which router and connector both watch
    assert kv["kv_connector_extra_config"] == {"profile": "glm5.1", "servers_file": "/shared/run1/servers.yaml",
                                               "kv_secret_file": "/shared/run1/secrets/kv-secret"}
    assert router == ["python3", "-m", "pd_router", "--host", "0.0.0.0", "--port", "8000",
                      "--decode-api-key-file", "/shared/run1/secrets/decode-api-key",
                      "--servers-file", "/shared/run1/servers.yaml"]
    servers = yaml.safe_load(text[text.index("== servers file /shared/run1/servers.yaml"):].split("==\n", 1)[1])
    assert servers == {"prefill": ["http://pf0:8100"],
                       "decode": [{"url": "http://dc0:8200", "kv_endpoint": "dc0:8300"}]}
    # written out from the recipe by hand: TileRT, one slot, 3 MTP drafts, KV lands in VRAM, GLM-5.1's
    # output parsers as vLLM's GLM-5.1 recipe runs them (tool calls glm47, reasoning glm45)
    assert decode == ["python3", "-m", "decode_server", "--engine", "tilert", "--model",
                      "/shared/models/GLM-5.1-FP8-tilert", "--host", "0.0.0.0", "--port", "8200", "--kv-port", "8300",
                      "--slots", "1", "--max-seq-len", "16384", "--num-mtp", "3", "--kv-device", "cuda:0",
                      "--api-key-file", "/shared/run1/secrets/decode-api-key",
                      "--kv-secret-file", "/shared/run1/secrets/kv-secret",
                      "--tool-call-parser", "glm47", "--reasoning-parser", "glm45",
                      "--served-model-name", "GLM-5.1-FP8", "--kv-host", "dc0"]
    assert convert[-4:] == ["--model_dir", "/shared/models/GLM-5.1-FP8", "--save_dir", "{dst}"]
    assert "into: /shared/models/GLM-5.1-FP8-tilert (once, under /shared/models/GLM-5.1-FP8-tilert.lock" in node1
    # the converted directory is a complete model directory for the decode server
    assert ("then: copies tokenizer.json tokenizer_config.json chat_template.jinja config.json generation_config.json"
            " from /shared/models/GLM-5.1-FP8 when the converter did not write them, and checks the directory for "
            "the tilert engine") in node1
    assert all("/shared/run1/bench/" in " ".join(b) for b in bench)
    # aiperf reads every real /metrics: the router's, prefill's (vLLM) and each decode server's
    for aiperf, run in zip(bench[:-1], ("aiperf-1k1k-c1", "aiperf-8k1k-c1")):
        assert aiperf[aiperf.index("--server-metrics") + 1:] == [
            "http://pf0:8000/metrics", "http://pf0:8100/metrics", "http://dc0:8200/metrics"]
        assert aiperf[aiperf.index("--input-file") + 1] == f"/shared/run1/plan/aiperf/{run}.jsonl"
        assert [aiperf[aiperf.index(f) + 1] for f in ("--concurrency", "--request-count", "--warmup-request-count",
                                                     "--custom-dataset-type", "--endpoint-type")] == [
            "1", "10", "2", "mooncake_trace", "completions"]
    gsm8k = bench[-1]
    assert "--apply_chat_template" in gsm8k and gsm8k[gsm8k.index("--gen_kwargs") + 1] == (
        "max_tokens=12288,temperature=0.0,top_p=1.0")
    assert "--limit" not in gsm8k  # the whole test split
    assert "gate: http://pf0:8100/health" in node0 and "gate: http://pf0:8000/ready" in node0
    assert "gate: http://dc0:8200/ready" in node1
    assert "HF_TOKEN" not in text  # the shipped recipe sets none (see the next test for one that does)
    # UCX and the InfiniBand devices per role, for the operator to adjust (docs/deploy.md, "KV network")
    prefill_block = node0[node0.index("[prefill]"):node0.index("[router]")]
    decode_block = node1[node1.index("[decode0]"):]
    for block in (prefill_block, decode_block):
        assert {"env MELLANOX_VISIBLE_DEVICES=all", "env UCX_NET_DEVICES=all", "env UCX_TLS=all"} <= {
            line.strip() for line in block.splitlines()}


def test_dry_run_masks_tokens_in_the_environment_it_prints(tmp_path: Path) -> None:
    data = load_recipe_dict(GLM)
    data["prefill"]["env"]["HF_TOKEN"] = "hf_do_not_print_me"
    out = _cli("dry-run", str(dump_recipe(data, tmp_path / "with-token.yaml")), "--hosts", "pf0,dc0")
    assert out.returncode == 0, out.stderr
    assert "hf_do_not_print_me" not in out.stdout
    assert "HF_TOKEN=***" in out.stdout  # the variable is still shown: the process gets it


def test_dry_run_host_count_must_match() -> None:
    out = _cli("dry-run", str(DEPLOY / "recipes" / GLM), "--hosts", "only-one")
    assert out.returncode == 2 and "the recipe needs 2" in out.stderr


def test_decode_nodes_scale_out() -> None:
    data = load_recipe_dict(GLM)
    data["decode"]["nodes"] = 3
    plan = build_plan(parse_recipe(data))
    decodes = [s for s in plan.workers if s.role == "decode"]
    assert [s.node for s in decodes] == [1, 2, 3]
    listed = servers_file(plan)
    assert [d.url for d in listed.decode] == ["http://@HOST1@:8200", "http://@HOST2@:8200", "http://@HOST3@:8200"]
    assert listed.kv_endpoints() == ("@HOST1@:8300", "@HOST2@:8300", "@HOST3@:8300")
    assert listed.prefill == ("http://@HOST0@:8100",)


@pytest.mark.parametrize("bind", ["node", "0.0.0.0"])
def test_servers_listen_on_their_nodes_name_or_the_bind_address(bind: str) -> None:
    data = load_recipe_dict("cpu-tiny-3node.yaml")
    data["slurm"]["bind_host"] = bind
    plan = build_plan(parse_recipe(data))
    hosts = {s.id: s.argv[s.argv.index("--host") + 1] for s in plan.services}
    expect = {"decode0": "@HOST1@", "decode1": "@HOST2@", "prefill": "@HOST0@", "router": "@HOST0@"}
    assert hosts == (expect if bind == "node" else dict.fromkeys(expect, bind))


def test_conversion_sees_hf_settings_of_every_role() -> None:
    data = load_recipe_dict(GLM)
    data["prefill"]["env"]["HF_TOKEN"] = "hf_prefill_only"
    data["decode"]["env"] = {"HF_HOME": "/shared/hf"}
    data["router"]["env"] = {"HF_ENDPOINT": "http://mirror.local"}
    env = conversion_env(parse_recipe(data))
    assert env == {"HF_HOME": "/shared/hf", "HF_TOKEN": "hf_prefill_only", "HF_ENDPOINT": "http://mirror.local"}


def test_render_writes_what_the_slurm_scripts_read(tmp_path: Path) -> None:
    plan = build_plan(parse_recipe(load_recipe_dict(GLM)))
    out = write_plan(plan, tmp_path)
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    assert [r[0] for r in rows] == ["convert", "decode0", "prefill", "router", "fingerprint", "aiperf-1k1k-c1",
                                    "aiperf-8k1k-c1", "gsm8k", "summary"]
    # each run's requests: 2 warm-ups + 10 measured, lengths uniform in [0.8 x, 1 x] (seeded: the same every time)
    for run, isl in (("aiperf-1k1k-c1", 1024), ("aiperf-8k1k-c1", 8192)):
        trace = [json.loads(line) for line in (out / "aiperf" / f"{run}.jsonl").read_text().splitlines()]
        assert len(trace) == 12
        assert all(int(0.8 * isl) <= t["input_length"] <= isl and 819 <= t["output_length"] <= 1024 for t in trace)
        assert len({t["input_length"] for t in trace}) > 1
    first = (out / "aiperf" / "aiperf-1k1k-c1.jsonl").read_text()
    again = write_plan(plan, tmp_path / "again")
    assert (again / "aiperf" / "aiperf-1k1k-c1.jsonl").read_text() == first
    assert all(len(r) == 6 for r in rows)
    for step in plan.steps:
        assert (out / f"{step.id}.argv").read_bytes().split(b"\0")[:-1] == [a.encode() for a in step.argv]
    # aiperf 0.13 cannot load a local tokenizer in HF offline mode (it looks in the hub cache only)
    aiperf = next(s for s in plan.benchmarks if s.id.startswith("aiperf"))
    assert aiperf.env["HF_HUB_OFFLINE"] == aiperf.env["TRANSFORMERS_OFFLINE"] == ""
    assert plan.benchmarks[-1].id == "gsm8k" and plan.benchmarks[-1].env["HF_HUB_OFFLINE"] == "1"
    job_env = (out / "job.env").read_text()
    assert "CONVERT_DST=/shared/models/GLM-5.1-FP8-tilert\n" in job_env and "NUM_NODES=2\n" in job_env
    assert ("CONVERT_MODEL_FILES='tokenizer.json tokenizer_config.json chat_template.jinja config.json "
            "generation_config.json'\n") in job_env
    assert "CONVERT_ENGINE=tilert\n" in job_env and "CONVERT_PYTHON=python3\n" in job_env
    task = yaml.safe_load((out / "lm_eval_tasks" / "gsm8k_local.yaml").read_text())
    assert task["task"] == "gsm8k_local" and task["dataset_path"] == "/shared/datasets/gsm8k/main"
    # InferenceX's task (utils/evals/gsm8k.yaml): both filters, the last match of each
    assert [(f["name"], f["filter"][0]["regex_pattern"], f["filter"][0]["group_select"]) for f in task["filter_list"]] \
        == [("strict-match", r"#### (\-?[0-9\.\,]+)", -1), ("flexible-extract", r"(-?[$0-9.,]{2,})|(-?[0-9]+)", -1)]
    assert task["doc_to_text"].endswith("formatted as: #### [number]\nAnswer:")
    assert task["generation_kwargs"]["until"] == ["</s>", "<|im_end|>"]
    # the job's secrets: a private folder, one random value per file, kept when rendered again
    secrets_dir = tmp_path / "secrets"
    assert secrets_dir.stat().st_mode & 0o777 == 0o700
    values = {}
    for name in ("decode-api-key", "kv-secret"):
        assert (secrets_dir / name).stat().st_mode & 0o777 == 0o600
        values[name] = (secrets_dir / name).read_text().strip()
        assert len(values[name]) == 64 and all(not a.endswith(values[name]) for s in plan.steps for a in s.argv)
    assert values["decode-api-key"] != values["kv-secret"]
    write_plan(plan, tmp_path)
    assert {n: (secrets_dir / n).read_text().strip() for n in values} == values


def test_dry_run_writes_the_plans_fingerprint(tmp_path: Path) -> None:
    recipe = DEPLOY / "recipes" / GLM
    out = _cli("dry-run", str(recipe), "--hosts", "pf0,dc0", "--job-dir", "/shared/run1",
               "--fingerprint", str(tmp_path / "fingerprint.json"))
    assert out.returncode == 0, out.stderr
    fp = Fingerprint.model_validate_json((tmp_path / "fingerprint.json").read_text())
    assert fp.kind == "dry-run" and fp.hosts == ["pf0", "dc0"] and fp.job_dir == "/shared/run1"
    assert fp.recipe.text == recipe.read_text()
    assert fp.recipe.sha256 == hashlib.sha256(recipe.read_bytes()).hexdigest()
    assert f"recipe sha256 {fp.recipe.sha256}" in out.stdout
    plan = build_plan(parse_recipe(load_recipe_dict(GLM)))
    # the exact commands, host names and job directory filled in, as the dry run prints them
    shown = [shlex.split(line[4:]) for line in out.stdout.splitlines() if line.startswith("  $ ")]
    recorded = {s.id: s.command for s in [*fp.services, *fp.steps]}
    assert set(recorded) == {s.id for s in plan.steps}
    assert sorted(shown) == sorted(recorded.values())
    assert [(s.role, s.host, s.metrics_url) for s in fp.services] == [
        ("decode", "dc0", "http://dc0:8200/metrics"), ("prefill", "pf0", "http://pf0:8100/metrics"),
        ("router", "pf0", "http://pf0:8000/metrics")]
    assert fp.server_metrics == ["http://pf0:8000/metrics", "http://pf0:8100/metrics", "http://dc0:8200/metrics"]
    # nothing ran: no server's build info, and the file says why; this environment's is there
    assert all(s.build == [] and s.absent and "dry run" in s.absent for s in fp.services)
    assert fp.environment.version != "absent"


def test_submit_dry_run_prints_the_plan_without_submitting(tmp_path: Path) -> None:
    recipe = str(DEPLOY / "recipes" / GLM)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,  # no sbatch on PATH: nothing can be submitted
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}  # the python under test imports this checkout
    out = subprocess.run([str(DEPLOY / "slurm" / "submit.sh"), "--dry-run", recipe], capture_output=True,
                         text=True, timeout=60, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == _cli("dry-run", recipe).stdout
    assert list(tmp_path.iterdir()) == []


def test_model_dtype_pins_prefill_and_the_kv_decode_receives() -> None:
    data = load_recipe_dict("cpu-tiny.yaml")
    prefill, decode = build_plan(parse_recipe(data)).workers
    assert prefill.argv[prefill.argv.index("--dtype") + 1] == "bfloat16"
    assert decode.argv[decode.argv.index("--kv-dtype") + 1] == "bfloat16"
    data["model"]["dtype"] = "auto"
    prefill, decode = build_plan(parse_recipe(data)).workers
    assert "--dtype" not in prefill.argv and "--kv-dtype" not in decode.argv
    glm_decode = build_plan(parse_recipe(load_recipe_dict(GLM))).workers[1]
    assert "--kv-dtype" not in glm_decode.argv  # TileRT receives fp8_ds_mla, not a model dtype


@pytest.mark.parametrize("name", ["cpu-tiny.yaml", GLM])
def test_prefill_and_decode_serve_the_recipes_model_name(name: str) -> None:
    data = load_recipe_dict(name)
    for step in build_plan(parse_recipe(data)).workers:
        assert step.argv.count("--served-model-name") == 1, step.id
        assert step.argv[step.argv.index("--served-model-name") + 1] == data["model"]["name"], step.id


def test_glm51_prefill_states_vllms_scheduling_on_b200() -> None:
    """Chunked prefill, prefix caching and the token budget per step reach vLLM's command line
    as the recipe states them; a recipe that states none leaves vLLM's defaults."""
    data = load_recipe_dict(GLM)
    prefill = build_plan(parse_recipe(data)).workers[0]
    assert prefill.argv[prefill.argv.index("--max-num-batched-tokens") + 1] == "16384"
    assert "--enable-prefix-caching" in prefill.argv and "--enable-chunked-prefill" in prefill.argv
    data["prefill"].update(prefix_caching=False, max_num_batched_tokens=2048)
    prefill = build_plan(parse_recipe(data)).workers[0]
    assert "--no-enable-prefix-caching" in prefill.argv and "--enable-prefix-caching" not in prefill.argv
    assert prefill.argv[prefill.argv.index("--max-num-batched-tokens") + 1] == "2048"
    cpu = build_plan(parse_recipe(load_recipe_dict("cpu-tiny.yaml"))).workers[0]
    assert not {"--max-num-batched-tokens", "--enable-prefix-caching", "--enable-chunked-prefill"} & set(cpu.argv)
