"""Where each version comes from, without importing the packages measured (the router must
not load torch to say which torch is installed). Each function returns the version, or
``None`` when it is absent; :data:`pd_build.info.ABSENT_REASONS` says why. The two that run a
child process (git, the UCX probe) are asked once per process."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

PROJECT_DIST = "tilert-pd"
GIT_REVISION_ENV = "PD_GIT_REVISION"  # baked into the images (docker build --build-arg PD_GIT_REVISION=...)
_PROJECT_ROOT = Path(__file__).resolve().parent.parent


def dist_version(*names: str) -> str | None:
    """The installed version of the first of ``names`` that is installed (what ``pip show`` says)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def git_revision() -> str | None:
    """``git describe --always --dirty --abbrev=12`` of the checkout this code runs from; else
    the revision baked into the image (``PD_GIT_REVISION``); else ``None``."""
    if (_PROJECT_ROOT / ".git").exists():
        try:
            out = subprocess.run(
                ["git", "-C", str(_PROJECT_ROOT), "describe", "--always", "--dirty", "--abbrev=12",
                 "--exclude", "*"],
                capture_output=True, text=True, timeout=10, check=True,
            )
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    baked = os.environ.get(GIT_REVISION_ENV, "").strip()
    return baked or None


def torch_cuda() -> str | None:
    """The CUDA version torch was built with (``torch.version.cuda``): read from a torch already
    imported, else from torch's ``version.py`` (not importing torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "version", None) is not None:
        cuda = getattr(torch.version, "cuda", None)
        return str(cuda) if cuda else None
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_py = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = version_py.read_text()
    except OSError:
        return None
    found = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found else None


def _ucx_library() -> str | None:
    for dist in ("nixl-cu13", "nixl-cu12", "nixl"):
        try:
            files = importlib.metadata.distribution(dist).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in files:
            if f.name.startswith("libucp") and ".so" in f.name:
                return str(f.locate())
    return None


_UCX_PROBE = (
    "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
    "lib.ucp_get_version_string.restype = ctypes.c_char_p; print(lib.ucp_get_version_string().decode())"
)


@functools.cache
def ucx_version() -> str | None:
    """The UCX NIXL loads (the library bundled in the NIXL wheel, else the system's
    ``libucp.so.0``): ``ucp_get_version_string()``, asked in a child process so that loading
    UCX (its constructors, signal handlers) never touches this one."""
    library = _ucx_library() or "libucp.so.0"
    try:
        out = subprocess.run([sys.executable, "-c", _UCX_PROBE, library], capture_output=True, text=True,
                             timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


NVIDIA_PROC = Path("/proc/driver/nvidia")


def gpu(root: Path = NVIDIA_PROC) -> tuple[str | None, str | None]:
    """(GPU models, driver version) of this node from the NVIDIA driver's ``/proc`` files
    (``version``, ``gpus/*/information``); several different models are joined with ``,``."""
    try:
        version = (root / "version").read_text()
    except OSError:
        return None, None
    driver = re.search(r"Kernel Module(?: for \S+)?\s+([0-9][0-9.]*)", version)
    models: list[str] = []
    for info in sorted(root.glob("gpus/*/information")):
        found = re.search(r"^Model:\s*(.+)$", info.read_text(), re.MULTILINE)
        if found and found.group(1).strip() not in models:
            models.append(found.group(1).strip())
    return (",".join(models) or None), (driver.group(1) if driver else None)


def hostname() -> str:
    return socket.gethostname()
