"""The benchmark entry: one result file per scenario and concurrency, with the fields and the
arithmetic of InferenceX's ``utils/process_result.py`` (read 2026-12-03), from AIPerf's
per-request export of the run (``bench/<run>/profile_export.jsonl``, warm-ups left out).

Per request, as InferenceX's client counts: TTFT; end-to-end latency (E2EL); output tokens
as the server reported them (``usage``); TPOT = (E2EL - TTFT) / (output tokens - 1), for
requests with more than one; ITL, every gap between two streamed chunks, all requests pooled.
Over the run: mean, median, population std, p90 and p99 (linear interpolation), in seconds
(``<stat>_<ttft|tpot|itl|e2el>``), and interactivity ``<stat>_intvty = 1000 / <stat> TPOT
in ms`` (tokens per second per user). Throughput over the run's duration (first request sent
to last answered): ``tput_per_gpu`` (input + output tokens over every GPU of the deployment),
``output_tput_per_gpu`` (output tokens over the decode GPUs), ``input_tput_per_gpu`` (input
tokens over the prefill GPUs), InferenceX's denominators for a disaggregated deployment.

A value that cannot be computed is ``{"unavailable": "<why>"}``, never a zero (a CPU recipe
has no GPU to divide by; a run whose answers were all one token has no TPOT).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from pd_deploy.recipe.plan import aiperf_run_id
from pd_deploy.recipe.schema import Recipe, ScenarioSpec

RESULTS_DIR = "results"
AIPERF_RECORDS = "profile_export.jsonl"
STATS = ("mean", "median", "std", "p90", "p99")
LATENCIES = ("ttft", "tpot", "itl", "e2el")


class Unavailable(BaseModel):
    model_config = ConfigDict(extra="forbid")
    unavailable: str


Value = float | Unavailable


class EntryFields(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hw: str
    conc: int
    image: str
    model: str
    infmax_model_prefix: str
    framework: str
    precision: str
    spec_decoding: str  # "mtp" or "none"
    disagg: bool
    is_multinode: bool
    isl: int
    osl: int
    num_prefill_gpu: int
    num_decode_gpu: int
    prefill_num_workers: int
    decode_num_workers: int
    prefill_tp: int
    tput_per_gpu: Value
    output_tput_per_gpu: Value
    input_tput_per_gpu: Value
    # ours, beside InferenceX's fields
    scenario: str
    random_range_ratio: float
    requests: int = Field(description="measured requests that answered (warm-ups not counted)")
    failed_requests: int
    duration_s: float


# every <stat>_<latency> in seconds and <stat>_intvty in tokens/s/user
AggResult: type[EntryFields] = create_model(  # type: ignore[call-overload]  # fields built from STATS x LATENCIES
    "AggResult", __base__=EntryFields,
    **{f"{stat}_{what}": (Value, ...) for stat in STATS for what in (*LATENCIES, "intvty")},
)


def result_name(r: Recipe, scenario: ScenarioSpec, concurrency: int) -> str:
    prefix = r.benchmark.entry.model_prefix if r.benchmark else r.model.name
    return f"agg_{prefix}_{scenario.name}_conc{concurrency}.json"


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _stats(values_ms: list[float], why_none: str) -> dict[str, Value]:
    if not values_ms:
        return {stat: Unavailable(unavailable=why_none) for stat in STATS}
    mean = sum(values_ms) / len(values_ms)
    return {"mean": mean, "median": _percentile(values_ms, 50),
            "std": math.sqrt(sum((v - mean) ** 2 for v in values_ms) / len(values_ms)),
            "p90": _percentile(values_ms, 90), "p99": _percentile(values_ms, 99)}


def _metric(record: dict[str, Any], name: str) -> Any:
    value = record.get("metrics", {}).get(name)
    return value.get("value") if isinstance(value, dict) else None


def read_records(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The measured requests that answered, and how many measured requests failed."""
    answered, failed = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("metadata", {}).get("benchmark_phase") != "profiling":
            continue  # warm-up
        if record.get("error") or record.get("metadata", {}).get("was_cancelled"):
            failed += 1
        else:
            answered.append(record)
    return answered, failed


def _per_gpu(tokens: float, seconds: float, gpus: int, which: str) -> Value:
    if gpus <= 0:
        return Unavailable(unavailable=f"the deployment has no {which} GPU (a CPU recipe): per GPU is not defined")
    return tokens / seconds / gpus


def aggregate(r: Recipe, scenario: ScenarioSpec, concurrency: int, records_path: Path) -> EntryFields:
    records, failed = read_records(records_path)
    if not records:
        raise ValueError(f"{records_path}: no measured request answered ({failed} failed)")
    ttft, e2el, tpot, itl = [], [], [], []
    out_tokens = in_tokens = 0
    for rec in records:
        first, latency = float(_metric(rec, "time_to_first_token")), float(_metric(rec, "request_latency"))
        n_out = int(_metric(rec, "usage_completion_tokens") or _metric(rec, "output_sequence_length") or 0)
        n_in = int(_metric(rec, "usage_prompt_tokens") or _metric(rec, "input_sequence_length") or 0)
        ttft.append(first)
        e2el.append(latency)
        if n_out > 1:
            tpot.append((latency - first) / (n_out - 1))
        itl += [float(v) for v in _metric(rec, "inter_chunk_latency") or ()]
        out_tokens, in_tokens = out_tokens + n_out, in_tokens + n_in
    start = min(rec["metadata"]["request_start_ns"] for rec in records)
    end = max(rec["metadata"]["request_end_ns"] for rec in records)
    duration = (end - start) / 1e9
    b = r.benchmark
    assert b is not None
    prefill_gpus = r.prefill.nodes * r.prefill.gpus_per_node
    decode_gpus = r.decode.nodes * r.decode.gpus_per_node
    fields: dict[str, Any] = {
        "hw": b.entry.hw, "conc": concurrency, "image": r.decode.image or "none (plain processes)",
        "model": r.model.name, "infmax_model_prefix": b.entry.model_prefix, "framework": b.entry.framework,
        "precision": b.entry.precision, "spec_decoding": "mtp" if r.mtp.enabled else "none", "disagg": True,
        "is_multinode": r.num_nodes > 1, "isl": scenario.isl, "osl": scenario.osl,
        "num_prefill_gpu": prefill_gpus, "num_decode_gpu": decode_gpus, "prefill_num_workers": r.prefill.nodes,
        "decode_num_workers": r.decode.nodes, "prefill_tp": r.prefill.tensor_parallel,
        "tput_per_gpu": _per_gpu(in_tokens + out_tokens, duration, prefill_gpus + decode_gpus, "prefill or decode"),
        "output_tput_per_gpu": _per_gpu(out_tokens, duration, decode_gpus or prefill_gpus, "decode"),
        "input_tput_per_gpu": _per_gpu(in_tokens, duration, prefill_gpus, "prefill"),
        "scenario": scenario.name, "random_range_ratio": b.random_range_ratio, "requests": len(records),
        "failed_requests": failed, "duration_s": duration,
    }
    whys = {"ttft": "no request answered", "e2el": "no request answered",
            "tpot": "no request produced more than one output token", "itl": "no request streamed two chunks"}
    for what, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        for stat, value in _stats(values, whys[what]).items():
            fields[f"{stat}_{what}"] = value if isinstance(value, Unavailable) else value / 1000.0
            if what == "tpot":
                fields[f"{stat}_intvty"] = value if isinstance(value, Unavailable) else (
                    1000.0 / value if value > 0 else Unavailable(unavailable=f"{stat} TPOT is 0"))
    return AggResult.model_validate(fields)


def write_results(r: Recipe, job_dir: Path) -> dict[str, EntryFields | str]:
    """Every run's result file into ``job_dir/results``; by file name, the result or why there is none."""
    out = job_dir / RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    done: dict[str, EntryFields | str] = {}
    b = r.benchmark
    if b is None or not b.aiperf:
        return done
    for scenario in b.scenarios:
        for c in scenario.concurrency:
            name = result_name(r, scenario, c)
            records = job_dir / "bench" / aiperf_run_id(scenario, c) / AIPERF_RECORDS
            try:
                result = aggregate(r, scenario, c, records)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                done[name] = f"{type(exc).__name__}: {exc}"
                continue
            (out / name).write_text(result.model_dump_json(indent=1) + "\n")
            done[name] = result
    return done
