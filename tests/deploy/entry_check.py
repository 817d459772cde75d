"""The benchmark entry's result files checked against AIPerf's own per-request export, with
arithmetic of the test's own (numpy), not the code under test (pd_deploy/report/entry.py):
InferenceX's definitions (utils/process_result.py and its client)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def _value(record: dict[str, Any], name: str) -> Any:
    return record["metrics"][name]["value"] if name in record.get("metrics", {}) else None


def check_against_aiperf(result: dict[str, Any], export: Path, prefill_gpus: int, decode_gpus: int) -> None:
    """Every statistic, count and throughput of ``result`` from ``export`` (profile_export.jsonl)."""
    records = [json.loads(line) for line in export.read_text().splitlines() if line.strip()]
    measured = [r for r in records if r["metadata"]["benchmark_phase"] == "profiling"]
    ok = [r for r in measured if not r.get("error") and not r["metadata"].get("was_cancelled")]
    assert (result["requests"], result["failed_requests"]) == (len(ok), len(measured) - len(ok))
    ttft = np.array([_value(r, "time_to_first_token") for r in ok], dtype=float)
    e2el = np.array([_value(r, "request_latency") for r in ok], dtype=float)
    n_out = np.array([_value(r, "usage_completion_tokens") for r in ok], dtype=float)
    n_in = np.array([_value(r, "usage_prompt_tokens") for r in ok], dtype=float)
    many = n_out > 1
    tpot = (e2el[many] - ttft[many]) / (n_out[many] - 1)
    itl = np.array([gap for r in ok for gap in (_value(r, "inter_chunk_latency") or [])], dtype=float)
    for what, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        want = {"mean": values.mean(), "median": np.median(values), "std": values.std(),
                "p90": np.percentile(values, 90), "p99": np.percentile(values, 99)}
        for stat, ms in want.items():
            assert result[f"{stat}_{what}"] == pytest.approx(ms / 1000, rel=1e-9), (stat, what)
            if what == "tpot":
                assert result[f"{stat}_intvty"] == pytest.approx(1000 / ms, rel=1e-9), stat
    start = min(r["metadata"]["request_start_ns"] for r in ok)
    end = max(r["metadata"]["request_end_ns"] for r in ok)
    duration = (end - start) / 1e9
    assert result["duration_s"] == pytest.approx(duration, rel=1e-9)
    per_gpu = {"tput_per_gpu": ((n_in.sum() + n_out.sum()) / duration, prefill_gpus + decode_gpus),
               "output_tput_per_gpu": (n_out.sum() / duration, decode_gpus or prefill_gpus + decode_gpus),
               "input_tput_per_gpu": (n_in.sum() / duration, prefill_gpus)}
    for field, (rate, gpus) in per_gpu.items():
        if gpus:
            assert result[field] == pytest.approx(rate / gpus, rel=1e-9), field
        else:  # never a zero: why not
            assert "GPU" in result[field]["unavailable"], field
