"""The import rules (docs/architecture.md, checked by import-linter in `make check`) hold, and
the checker does fail on a forbidden import; importing the KV receiver loads no web stack;
no file cites notes outside the repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.procs import REPO

PACKAGES = tuple(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"])
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
                          capture_output=True, text=True, timeout=120, cwd=root,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})


def test_the_import_rules_hold() -> None:
    out = _lint_imports(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "10 kept, 0 broken" in out.stdout
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert [c["id"] for c in contracts if c.get("ignore_imports")] == []  # no exception to any rule


@pytest.mark.parametrize("module,line,contract", [
    ("connector/receiver.py", "from pd_router.answers import ErrorBody",
     "connector is not allowed to import pd_router"),
    ("connector/protocol.py", "from connector.layout import KVLayout", "the KV channel's messages"),
    ("decode_server/server/routes.py", "import pd_router.answers", "decode_server is not allowed to import pd_router"),
    ("pd_router/request/accept.py", "from decode_server.server import app",
     "router, connector and decode server share only"),
    ("pd_router/answers.py", "from connector.protocol import Hello", "router, connector and decode server share only"),
    ("pd_wire/handoff.py", "import connector.layout", "the wire contract (pd_wire) imports none"),
    ("pd_router/request/fanout.py", "from pd_router.request import accept", "no import circle between the modules"),
    ("pd_router/slots/queue.py", "from pd_router.request import context", "the router's folders import downwards only"),
    ("decode_server/server/state.py", "import vllm", "only the connector's vLLM adapter imports vLLM"),
    ("pd_deploy/launch.py", "from pd_deploy.stack import launcher", "the prefill image's entrypoint imports no router"),
])
def test_the_checker_fails_on_a_forbidden_import(tmp_path: Path, module: str, line: str, contract: str) -> None:
    for name in PACKAGES:
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # a forbidden import\n")
    out = _lint_imports(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert contract in out.stdout.replace("\n", " "), out.stdout


def test_importing_the_kv_receiver_loads_no_web_stack() -> None:
    code = ("import connector.receiver, sys; "
            "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn', 'httpx', 'pd_router', 'decode_server') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert (out.returncode, out.stdout.strip()) == (0, "[]"), out.stderr


def test_no_file_cites_notes_outside_the_repository() -> None:
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO, check=True).stdout.split()
    outside = "FACTS" + ".md"  # the project's notes file that is not in this repository
    citing = [f for f in files if (REPO / f).is_file() and outside in (REPO / f).read_text(errors="replace")]
    assert citing == []


LAZY_PACKAGES = ["pd_router", "decode_server.server", "decode_server.tiny_model", "pd_deploy.recipe"]


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_lazy_exports_are_not_named_like_a_submodule(package: str) -> None:
    """A package exporting on first use (PEP 562 ``__getattr__``) must not export a name that
    one of its submodules has: once that submodule is imported, the package attribute is the
    module and ``from package import name`` returns it instead of the function."""
    import importlib
    import pkgutil

    pkg = importlib.import_module(package)
    exports = set(pkg._EXPORTS)
    submodules = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
    assert exports and not exports & submodules, exports & submodules
