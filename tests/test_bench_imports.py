"""Every benchmark under bench/ imports against the code as it is: a module or name the
product moved fails here, not at the start of a bench run (mypy does not check bench/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_bench_module_imports():
    names = sorted(p.stem for p in (REPO / "bench").glob("*.py") if p.stem != "__init__")
    assert "router_cpu_split" in names and "router_overhead" in names
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module('bench.' + name)\nprint('ok')"
    done = subprocess.run([sys.executable, "-c", code, *names], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
