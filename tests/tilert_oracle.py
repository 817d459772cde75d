"""TileRT's own PD code as a test oracle: the pure-Python part of the ``tilert`` wheel
(``tilert/pd_vllm``, which imports only torch and its own modules), fetched from PyPI
with pip on first use, cached under ``REPO/.cache/tilert``, and imported without leaving
``tilert`` importable for other tests (no compiled TileRT kernel is ever loaded).

``PD_TILERT_WHEEL=/path/to/tilert-*.whl`` uses a local wheel instead of downloading one.
Nothing of TileRT's is copied into this repository: the tests call its functions.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType

from decode_server.engine.tilert import TILERT_VERSION
from tests.procs import REPO

WHEEL_ENV = "PD_TILERT_WHEEL"
# The members needed to import tilert.pd_vllm.profiles.mla_nsa: the package's own
# __init__ (it imports tilert_init) and the PD code. No shared library.
_MEMBERS = ("tilert/__init__.py", "tilert/tilert_init.py", "tilert/pd_vllm/")


def tilert_wheel(cache: Path) -> Path:
    """The tilert wheel: ``$PD_TILERT_WHEEL``, or downloaded once into ``cache``."""
    local = os.environ.get(WHEEL_ENV)
    if local:
        return Path(local)
    found = sorted(cache.glob(f"tilert-{TILERT_VERSION}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        # cp312 only; any machine can fetch it: only its Python files are used
        cmd = [sys.executable, "-m", "pip", "download", f"tilert=={TILERT_VERSION}", "--no-deps",
               "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--only-binary=:all:",
               "-d", tmp, "--quiet"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"cannot download tilert=={TILERT_VERSION} (set {WHEEL_ENV} to a local wheel): "
                               f"{out.stderr[-2000:]}")
        (wheel,) = Path(tmp).glob("tilert-*.whl")
        return wheel.rename(cache / wheel.name)


def _unpack(wheel: Path, dest: Path) -> Path:
    done = dest / ".complete"
    if done.exists():
        return dest
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith(_MEMBERS) and name.endswith(".py"):
                zf.extract(name, dest)
    done.write_text(wheel.name + "\n")
    return dest


def load_mla_nsa(cache: Path | None = None) -> ModuleType:
    """``tilert.pd_vllm.profiles.mla_nsa`` of the wheel. ``tilert`` is removed from
    ``sys.modules`` and ``sys.path`` again afterwards (the module keeps working: its
    functions hold their globals), and the logging set-up its import does is undone."""
    cache = cache or REPO / ".cache" / "tilert"
    root = _unpack(tilert_wheel(cache), cache / f"pd-{TILERT_VERSION}")
    before = {name for name in sys.modules if name == "tilert" or name.startswith("tilert.")}
    if before:
        raise RuntimeError(f"a tilert module is already imported: {sorted(before)}")
    logger = logging.getLogger()
    handlers, level = list(logger.handlers), logger.level
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("tilert.pd_vllm.profiles.mla_nsa")
    finally:
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if n == "tilert" or n.startswith("tilert.")]:
            del sys.modules[name]
        logger.handlers[:] = handlers
        logger.setLevel(level)
    return module
