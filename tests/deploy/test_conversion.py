"""Weight conversion (deploy/slurm/setup_deps.sh convert) with stand-in converters.

Two concurrent Slurm jobs share one conversion; failures leave nothing behind; a cache
hit runs nothing and makes no network call (checked with strace in a network-less
namespace); the converter sees the Hugging Face settings of every role; a GLM-5.1
conversion (the shipped recipe, a fake GLM-5.1 checkpoint, a fake converter that writes
only shards, as TileRT's does) ends as a complete model directory for the TileRT decode
server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from decode_server.engine.tilert import TileRTEngine
from decode_server.model_dir import MODEL_FILES
from decode_server.server.text import GenerationDefaults, TextTokenizer
from decode_server.settings import load_settings
from pd_deploy.recipe import build_plan, parse_recipe, write_plan
from tests.deploy.conftest import SLURM_DIR, fake_checkpoint, load_recipe_dict, write_exe
from tests.deploy.slurm_cluster import SlurmCluster
from tests.fakes.fake_glm51_checkpoint import token_ids
from tests.fakes.fake_tilert import FakeGLM5Generator

# integration: the conversion scripts as subprocesses, with locks across processes
pytestmark = [pytest.mark.timeout(180), pytest.mark.integration]

SETUP_DEPS = SLURM_DIR / "setup_deps.sh"
SHARDS = 3


def _converter(path: Path, calls: Path, mode: str = "ok", sleep: float = 0.0) -> Path:
    """A stand-in converter: records each call and the HF settings it saw, then (mode) writes
    SHARDS shards ('ok'), writes one shard and fails ('fail'), or writes too few ('short')."""
    shards = {"ok": SHARDS, "fail": 1, "short": SHARDS - 1}[mode]
    return write_exe(path, f"""#!/usr/bin/env bash
set -eu
src=$1 dst=$2
echo "pid=$$ src=$src HF_HOME=${{HF_HOME:-}} HF_TOKEN=${{HF_TOKEN:-}}" >> {calls}
sleep {sleep}
for i in $(seq 1 {shards}); do head -c 1024 /dev/urandom > "$dst/shard-$i.safetensors"; done
[ {mode} != fail ] || exit 3
""")


def _job(tmp: Path, name: str, converter: Path, env: dict[str, dict[str, str]] | None = None) -> Path:
    data: dict[str, Any] = load_recipe_dict("cpu-tiny.yaml")
    data["model"]["source"] = str(tmp / "src") if (tmp / "src").exists() else str(fake_checkpoint(tmp / "src"))
    data["model"]["converted"] = str(tmp / "shared" / "converted")
    data["conversion"]["command"] = [str(converter), "{src}", "{dst}"]
    data["conversion"]["shards"] = SHARDS
    data["decode"]["python"] = sys.executable  # checks the converted directory (decode_server.model_dir)
    for role, role_env in (env or {}).items():
        data[role]["env"] = role_env
    job_dir = tmp / name
    write_plan(build_plan(parse_recipe(data)), job_dir)
    return job_dir


def _convert(job_dir: Path, env: dict[str, str] | None = None, prefix: list[str] | None = None,
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*(prefix or []), "bash", str(SETUP_DEPS), "convert", str(job_dir)], capture_output=True,
                          text=True, timeout=120, env=env if env is not None else dict(os.environ))


def _leftovers(tmp: Path) -> list[str]:
    return sorted(p.name for p in (tmp / "shared").iterdir() if not p.name.endswith(".lock"))


def test_two_concurrent_jobs_convert_once(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    calls = tmp_path / "calls.txt"
    conv = _converter(tmp_path / "convert.sh", calls, sleep=4)
    jobs = [_job(tmp_path, f"job{i}", conv) for i in range(2)]
    ids = []
    for job in jobs:
        out = slurm_cluster.run(["sbatch", "--parsable", "--output", str(job / "out.txt"),
                                 "--wrap", f"bash {SETUP_DEPS} convert {job}"])
        ids.append(out.stdout.strip())
    states = [slurm_cluster.wait_job_end(i, timeout=120) for i in ids]
    logs = [(job / "out.txt").read_text() for job in jobs]
    assert states == ["COMPLETED", "COMPLETED"], logs
    assert len(calls.read_text().splitlines()) == 1, "exactly one job converts"
    converted = [log for log in logs if "converted into" in log]
    reused = [log for log in logs if "converted by another job while this one waited" in log]
    assert len(converted) == 1 and len(reused) == 1, logs
    dst = tmp_path / "shared" / "converted"
    assert sorted(p.name for p in dst.glob("*.safetensors")) == [f"shard-{i}.safetensors" for i in (1, 2, 3)]
    # tokenizer files the converter did not write come from the checkpoint
    assert (dst / "tokenizer.json").read_text() == (tmp_path / "src" / "tokenizer.json").read_text()
    assert "shard-1.safetensors" in (dst / ".tilert-pd-complete").read_text()
    assert _leftovers(tmp_path) == ["converted"]


@pytest.mark.parametrize("mode,reason", [("fail", "converter failed (exit 3)"),
                                         ("short", "2 shards matching '*.safetensors', expected 3")])
def test_failed_conversion_leaves_nothing_behind(tmp_path: Path, mode: str, reason: str) -> None:
    job = _job(tmp_path, "job", _converter(tmp_path / "convert.sh", tmp_path / "calls.txt", mode=mode))
    out = _convert(job)
    assert out.returncode != 0
    assert reason in out.stderr
    assert _leftovers(tmp_path) == []
    # a later, working conversion starts from scratch and succeeds
    job2 = _job(tmp_path, "job2", _converter(tmp_path / "convert-ok.sh", tmp_path / "calls.txt"))
    assert _convert(job2).returncode == 0
    assert _leftovers(tmp_path) == ["converted"]


def test_stale_temp_dir_of_a_killed_job_is_removed(tmp_path: Path) -> None:
    job = _job(tmp_path, "job", _converter(tmp_path / "convert.sh", tmp_path / "calls.txt"))
    (tmp_path / "shared" / "converted.tmp-dead01").mkdir(parents=True)
    assert _convert(job).returncode == 0
    assert _leftovers(tmp_path) == ["converted"]


def test_incomplete_destination_is_refused(tmp_path: Path) -> None:
    job = _job(tmp_path, "job", _converter(tmp_path / "convert.sh", tmp_path / "calls.txt"))
    (tmp_path / "shared" / "converted").mkdir(parents=True)
    out = _convert(job)
    assert out.returncode != 0
    assert "is not a complete conversion" in out.stderr and "remove it" in out.stderr


def test_cache_hit_runs_nothing_and_makes_no_network_call(tmp_path: Path) -> None:
    calls = tmp_path / "calls.txt"
    job = _job(tmp_path, "job", _converter(tmp_path / "convert.sh", calls))
    assert _convert(job).returncode == 0
    # second job: the converter now fails if called; no hub settings, no network at all
    write_exe(tmp_path / "convert.sh", "#!/usr/bin/env bash\necho 'converter called on a cache hit' >&2\nexit 99\n")
    bin_dir = tmp_path / "no-net-bin"
    bin_dir.mkdir()
    for tool in ("curl", "wget", "git", "hf", "huggingface-cli", "python", "python3"):
        write_exe(bin_dir / tool, f"#!/bin/sh\necho '{tool} called on a cache hit' >&2\nexit 98\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    trace = tmp_path / "strace.txt"
    strace = [shutil.which("strace") or "strace", "-f", "-qq", "-e", "trace=connect,sendto,sendmsg",
              "-o", str(trace)]
    out = _convert(job, env=env, prefix=["unshare", "--net", *strace])
    assert out.returncode == 0, out.stderr
    assert "reusing complete conversion" in out.stderr
    assert len(calls.read_text().splitlines()) == 1
    inet = [line for line in trace.read_text().splitlines() if "AF_INET" in line]
    assert inet == [], inet
    # control: the same tracing sees a connection attempt when one is made
    subprocess.run(["unshare", "--net", *strace, "bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9"], timeout=30,
                   capture_output=True)
    assert any("AF_INET" in line for line in trace.read_text().splitlines())


def test_converter_sees_every_roles_hf_settings(tmp_path: Path) -> None:
    calls = tmp_path / "calls.txt"
    env = {"prefill": {"HF_TOKEN": "hf_from_prefill"}, "decode": {"HF_HOME": str(tmp_path / "hf")}}
    job = _job(tmp_path, "job", _converter(tmp_path / "convert.sh", calls), env=env)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    assert _convert(job, env=clean).returncode == 0
    (line,) = calls.read_text().splitlines()
    assert f"HF_HOME={tmp_path / 'hf'} HF_TOKEN=hf_from_prefill" in line
    assert f"src={tmp_path / 'src'}" in line


def _glm_job(tmp: Path, src: Path) -> tuple[Path, Path]:
    """The shipped GLM-5.1 recipe, converting ``src`` with a stand-in for TileRT's converter
    (it writes 8 device shards and their index, nothing else)."""
    tmp.mkdir(parents=True, exist_ok=True)
    converter = write_exe(tmp / "tilert-converter", """#!/usr/bin/env bash
set -eu
while [ $# -gt 0 ]; do case $1 in --model_dir) src=$2; shift;; --save_dir) dst=$2; shift;; esac; shift; done
for i in 0 1 2 3 4 5 6 7; do head -c 256 /dev/urandom > "$dst/model-rank-$i.safetensors"; done
echo '{"shards": 8}' > "$dst/model.safetensors.index.json"
""")
    data: dict[str, Any] = load_recipe_dict("glm5.1-fp8-b200.yaml")
    data["model"]["source"] = str(src)
    data["model"]["converted"] = str(tmp / "shared" / "GLM-5.1-FP8-tilert")
    command = data["conversion"]["command"]  # python3 -m tilert...weight_converter --model_type ... {dst}
    data["conversion"]["command"] = [str(converter), *command[command.index("--model_type"):]]
    data["decode"]["python"] = sys.executable
    job_dir = tmp / "job"
    write_plan(build_plan(parse_recipe(data)), job_dir)
    return job_dir, Path(data["model"]["converted"])


def test_glm51_conversion_is_a_complete_model_directory_for_the_tilert_decode_server(tmp_path: Path) -> None:
    # the checkpoint's generation_config lists only <|endoftext|>: the role tokens are added
    src = fake_checkpoint(tmp_path / "GLM-5.1-FP8", shards=2, eos=("<|endoftext|>",))
    job, dst = _glm_job(tmp_path, src)
    out = _convert(job)
    assert out.returncode == 0, out.stderr
    assert len(list(dst.glob("*.safetensors"))) == 8
    for name in MODEL_FILES["tilert"]:
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
        assert f" ./{name}\n" in (dst / ".tilert-pd-complete").read_text()
    stops = token_ids("<|endoftext|>", "<|user|>", "<|observation|>")
    assert f"stop token ids {sorted(stops)}" in out.stderr
    # what the decode server then reads from it
    settings = load_settings(["--engine", "tilert", "--model", str(dst), "--num-mtp", "3"], env={})
    assert GenerationDefaults.from_model_dir(dst, TextTokenizer.from_model_dir(dst)).eos_token_ids == stops
    engine = TileRTEngine(settings.model, max_seq_len=4096, num_mtp=3, device="cpu", generator=FakeGLM5Generator())
    assert engine.kv_layout.num_layers == 79  # config.json's 78 layers + the MTP layer
    again = _convert(job)
    assert again.returncode == 0 and "reusing complete conversion" in again.stderr


def test_glm51_conversion_without_a_chat_template_fails_and_leaves_nothing(tmp_path: Path) -> None:
    src = fake_checkpoint(tmp_path / "GLM-5.1-FP8", chat_template_file=False)
    job, dst = _glm_job(tmp_path, src)
    out = _convert(job)
    assert out.returncode != 0
    assert "chat_template.jinja: in neither the conversion output nor" in out.stderr
    assert "not a complete tilert model directory" in out.stderr
    assert not dst.exists() and _leftovers(tmp_path) == []
    # a checkpoint that carries the template in tokenizer_config.json only is fine
    src2 = fake_checkpoint(tmp_path / "GLM-5.1-FP8-b", chat_template_file=False, template_in_tokenizer_config=True)
    job2, dst2 = _glm_job(tmp_path / "b", src2)
    assert _convert(job2).returncode == 0
    assert "{% for m in messages %}" in (dst2 / "chat_template.jinja").read_text()
