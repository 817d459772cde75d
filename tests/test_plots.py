"""``python -m bench.plots`` draws the benchmarks' figures from their data files: from a small
sample written as the benchmarks write theirs, and from the data files in bench/results
that docs/benchmarks.md's figures come from."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.plots import FIGURES, RESULTS, _drafter_ms, render_all, write_result

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def _sample(results: Path) -> None:
    """One small data file per figure, with the row fields each benchmark writes."""
    write_result("router_overhead", "sample", [
        {"endpoint": e, "concurrency": c, "ttft_p50_ms": 0.5 * c, "ttft_p99_ms": c, "itl_p50_ms": 0.01,
         "itl_p99_ms": 0.1 * c, "router_cpu_us_per_token": 60 / c, "throughput_ratio": 1 - c / 1000,
         **({"pd_floor_ttft_p50_ms": 0.4} if c == 1 else {}),
         **({"pd_floor_cpu_us_per_token": 0.7, "byte_relay_cpu_us_per_token": 0.5} if c == 64 else {})}
        for e in ("chat", "completions") for c in (1, 16, 64)], results,
        goals={"ttft_p50_ms": [1, 1.0], "itl_p99_ms": [16, 0.25]})
    write_result("kv_transfer", "sample", [
        {"tokens": t, "MiB": t * 0.0594, "lanes": lanes, "memcpy": 18.0, "memcpy2": 22.0, "done": 6.0 * lanes,
         "ratio": lanes / 3, "sent": 7.0, "ratio2": 0.5, "tail_ms": 1.2} for t in (1024, 8192) for lanes in (1, 2)],
        results)
    write_result("e2e", "sample", [
        {"prompt_tokens": t, "ttft_ms": {"PD": t / 5, "alone": t / 6}, "tpot_ms": {"PD": 5.0, "alone": 4.5},
         "prefill_step_ms": t / 5.5, "profile": {"PD": {"busy": 100.0, "MTP drafter": 30.0}} if t > 1024 else {}}
        for t in (1024, 8192)], results, goals={"ttft": 1.15, "tpot": 1.0})


def test_the_mtp_drafter_estimate_is_the_profiles_share_of_the_prefill_step():
    row = {"prefill_step_ms": 1000.0, "profile": {"PD": {"busy": 200.0, "MTP drafter": 50.0}}}
    assert _drafter_ms(row) == 250.0
    assert _drafter_ms({"prefill_step_ms": 1000.0, "profile": {}}) is None


def _pngs(paths: list[Path]) -> dict[str, int]:
    sizes = {}
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG), path
        sizes[path.name] = len(data)
    return sizes


def test_every_figure_renders_from_a_small_sample(tmp_path: Path):
    _sample(tmp_path / "results")
    drawn, missing = render_all(tmp_path / "results", tmp_path / "img")
    assert missing == []
    sizes = _pngs(drawn)
    assert set(sizes) == {f"{name}.png" for name in FIGURES}
    assert all(size > 20_000 for size in sizes.values()), sizes  # drawn, not an empty canvas


def test_a_missing_data_file_is_named_and_a_broken_one_fails(tmp_path: Path):
    _sample(tmp_path / "results")
    (tmp_path / "results" / "kv_transfer.json").unlink()
    drawn, missing = render_all(tmp_path / "results", tmp_path / "img")
    assert missing == ["kv_transfer"] and len(drawn) == 2
    write_result("e2e", "broken", [{"prompt_tokens": 1}], tmp_path / "results")
    with pytest.raises(KeyError):
        render_all(tmp_path / "results", tmp_path / "img")


def test_one_command_redraws_the_documented_figures_from_bench_results(tmp_path: Path):
    done = subprocess.run([sys.executable, "-m", "bench.plots", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{name}.png" for name in FIGURES), done.stdout
    _pngs(list(tmp_path.iterdir()))
    assert sorted(p.stem for p in RESULTS.glob("*.json")) == sorted(FIGURES)
    embedded = set(re.findall(r"!\[[^]]*\]\(img/([a-z0-9_]+)\.png\)", (REPO / "docs" / "benchmarks.md").read_text()))
    assert embedded >= set(FIGURES), "docs/benchmarks.md embeds every figure"
