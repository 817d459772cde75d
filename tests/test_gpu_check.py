"""bench/gpu_check.py in CI: on a machine without CUDA it runs in dry mode (each check's
CPU side for real, the GPU side reported as skipped with the reason) and exits 0 unless
something that ran failed. On a CUDA machine the same test runs the real checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.procs import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SCRIPT = REPO / "bench" / "gpu_check.py"
NAMES = ["gather/cpu-mla", "gather/fp8-ds-mla", "nixl/vram", "tilert-kv", "reference-engine"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=560,
                          cwd=REPO, env=env)


def test_gpu_check_runs_and_reports_what_it_skipped(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = _run("--model", str(tiny_model_dir), "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    results = {r["name"]: r for r in report["results"]}
    assert list(results) == NAMES
    assert all(r["status"] in ("ok", "skipped") for r in results.values()), out.stdout
    if not torch.cuda.is_available():
        assert report["context"]["dry"] and "no CUDA device" in report["context"]["why_dry"]
        assert "dry mode" in out.stdout and "0 ok, 5 skipped, 0 failed" in out.stdout
        for r in results.values():  # why, and what its CPU side did
            assert r["status"] == "skipped" and "no CUDA device" in r["detail"] and "CPU side ran" in r["detail"]
        assert "CPU decode of 3 prompts x 32 tokens" in results["reference-engine"]["detail"]
        # --strict: a skipped check fails the run (for the day a GPU is there)
        assert _run("--model", str(tiny_model_dir), "--strict").returncode == 1


def test_a_failing_check_fails_the_run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))

    def broken(ctx: object) -> str:
        raise AssertionError("bytes differ")

    def skipped(ctx: object) -> str:
        raise gpu_check.Skip("no device")

    monkeypatch.setattr(gpu_check, "CHECKS", [("skips", skipped), ("breaks", broken)])
    assert gpu_check.main(["--dry-run"]) == 1
    out = capsys.readouterr().out
    assert "[SKIP] skips" in out and "[FAIL] breaks" in out and "bytes differ" in out
    monkeypatch.setattr(gpu_check, "CHECKS", [("skips", skipped)])
    assert gpu_check.main(["--dry-run"]) == 0
