"""Figures of the benchmarks' comparisons against their goals (matplotlib, the bench extra),
written by the benchmarks themselves into docs/img/ and embedded in docs/benchmarks.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.e2e import Row


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax: Any, labels: Sequence[str], series: Mapping[str, Sequence[float]], goal: float | None,
          title: str, ylabel: str) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(labels)), labels)
    if goal is not None:
        ax.axhline(goal, color="red", linestyle="--", linewidth=1, label=f"goal {goal:g}")
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.legend(fontsize=7)


def plot_e2e(rows: Sequence[Row], path: Path, subtitle: str) -> None:
    """TPOT and TTFT, PD over vLLM alone per prompt length; the longest prompt's TTFT split
    into vLLM alone's and what PD adds (MTP drafter, the rest)."""
    from bench.e2e import TPOT_GOAL, TTFT_GOAL

    plt = _pyplot()
    labels = [f"{r.prompt_tokens} tok" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    _bars(axes[0], labels, {"TPOT PD / alone": [r.tpot_ratio for r in rows]}, TPOT_GOAL,
          "decode: time per output token, PD / vLLM alone", "ratio")
    _bars(axes[1], labels, {"TTFT PD / alone": [r.ttft_ratio for r in rows]}, TTFT_GOAL,
          "time to first token, PD / vLLM alone", "ratio")
    last = rows[-1]
    ax = axes[2]
    alone, pd = last.ttft_ms["alone"], last.ttft_ms["PD"]
    ax.bar(["vLLM alone", "PD"], [alone, 0], color="tab:blue", label="vLLM alone's TTFT")
    if last.profile:
        from bench.e2e import drafter_share

        _, mtp = drafter_share(last)
        ax.bar(["PD"], [pd - mtp], color="tab:green", label="PD without the MTP drafter")
        ax.bar(["PD"], [mtp], bottom=[pd - mtp], color="tab:orange", label="MTP drafter (py-spy share of the step)")
    else:
        ax.bar(["PD"], [pd], color="tab:green", label="PD")
    ax.axhline(alone * TTFT_GOAL, color="red", linestyle="--", linewidth=1, label=f"{TTFT_GOAL:g}x vLLM alone")
    ax.set_title(f"TTFT at {last.prompt_tokens} tokens (ms)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"bench/e2e.py: PD stack vs vLLM alone, same model and numerics ({subtitle})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_router(rows: Sequence[Mapping[str, Any]], goals: Mapping[str, float], path: Path, subtitle: str) -> None:
    """The router's added TTFT (C=1), added ITL p99 (C=16) and CPU per token (C=64), per endpoint."""
    plt = _pyplot()
    endpoints = sorted({r["endpoint"] for r in rows})

    def value(endpoint: str, concurrency: int, key: str) -> float:
        return next(r[key] for r in rows if r["endpoint"] == endpoint and r["concurrency"] == concurrency)

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = [("ttft_p50_ms", 1, "added TTFT p50 at C=1 (ms)"), ("itl_p99_ms", 16, "added ITL p99 at C=16 (ms)"),
              ("router_cpu_us_per_token", 64, "router CPU per token at C=64 (us)")]
    for ax, (key, c, title) in zip(axes, panels):
        _bars(ax, endpoints, {"router": [value(e, c, key) for e in endpoints]}, goals[key], title, "")
    fig.suptitle(f"bench/router_overhead.py: what the router adds, per endpoint ({subtitle})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
