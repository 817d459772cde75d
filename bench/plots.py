"""The benchmarks' figures, drawn from the data files the benchmarks write
(``bench/results/<name>.json``) into ``docs/img/<name>.png``, which docs/benchmarks.md
embeds. One command redraws them all from the data files there are:

    .venv/bin/python -m bench.plots [--results DIR] [--out DIR]      (or: make plots)

* ``router_overhead`` (bench/router_overhead.py): what the router adds against calling the
  decode server directly, by concurrency: TTFT, ITL, CPU per token, throughput;
* ``kv_transfer`` (bench/kv_transfer.py): KV push bandwidth by handoff size against a
  memcpy of the same bytes in the same run;
* ``e2e`` (bench/e2e.py): TTFT and TPOT of the PD stack against vLLM alone by prompt length.

A data file is ``{"run": "<what ran, when, on what>", "rows": [...], ...}``; the rows are
what the benchmark measured (its table), one dict per row. matplotlib comes with the
``bench`` and ``test`` extras.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
IMG = REPO / "docs" / "img"
Data = Mapping[str, Any]


def write_result(name: str, run: str, rows: Sequence[Mapping[str, Any]], results: Path = RESULTS,
                 **extra: Any) -> Path:
    """Write a benchmark's data file (``results/<name>.json``); returns its path."""
    path = results / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": run, "rows": list(rows), **extra}, indent=1) + "\n")
    return path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, plt: Any, path: Path, title: str, run: str) -> None:
    fig.suptitle(f"{title}\n{run}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


_FLOORS = {  # a panel's first key: the floors drawn on it (row key, marker, legend)
    "ttft_p50_ms": (("pd_floor_ttft_p50_ms", "x", "minimal PD relay p50"),),
    "router_cpu_us_per_token": (("pd_floor_cpu_us_per_token", "x", "minimal PD relay"),
                                ("byte_relay_cpu_us_per_token", "+", "byte relay")),
}


def plot_router(data: Data, path: Path) -> None:
    """Added TTFT, added ITL, router CPU per token and throughput ratio against concurrency,
    one line per endpoint (p50 solid, p99 dashed); each goal at the concurrency it is judged,
    and the floors measured beside it (x: the minimal PD relay, +: the byte relay)."""
    plt = _pyplot()
    rows, goals = data["rows"], data.get("goals", {})
    endpoints = sorted({r["endpoint"] for r in rows})
    panels = [(("ttft_p50_ms", "ttft_p99_ms"), "added TTFT (ms)"), (("itl_p50_ms", "itl_p99_ms"), "added ITL (ms)"),
              (("router_cpu_us_per_token",), "router CPU per output token (us)"),
              (("throughput_ratio",), "throughput through the router / direct")]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4))
    for ax, (keys, title) in zip(axes, panels, strict=True):
        for i, endpoint in enumerate(endpoints):
            mine = sorted((r for r in rows if r["endpoint"] == endpoint), key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in mine]
            for key, style in zip(keys, ("-o", "--s"), strict=False):
                label = endpoint + (f" {key.split('_')[1]}" if len(keys) > 1 else "")
                ax.plot(xs, [r[key] for r in mine], style, color=f"C{i}", label=label)
            for floor, marker, what in _FLOORS.get(keys[0], ()):
                at = [r for r in mine if floor in r]
                ax.plot([r["concurrency"] for r in at], [r[floor] for r in at], marker, color=f"C{i}",
                        markersize=9, label=f"{endpoint}: {what}" if at else None)
        for key in keys:
            if key in goals:
                c, limit = goals[key]
                ax.plot([c], [limit], "rv", markersize=8, label=f"goal at C={c}: {limit:g}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["concurrency"] for r in rows}), [str(c) for c in sorted({r["concurrency"]
                                                                                           for r in rows})])
        ax.axhline(1.0 if keys == ("throughput_ratio",) else 0.0, color="grey", linewidth=0.5)
        ax.set_xlabel("concurrent streams", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    _save(fig, plt, path, "bench/router_overhead.py: what the router adds over calling decode directly",
          data["run"])


def plot_kv(data: Data, path: Path) -> None:
    """KV push bandwidth (post to KV complete at decode) by handoff size against memcpy of the
    same bytes, per sender lane count; and push / memcpy with the 0.8 goal."""
    plt = _pyplot()
    rows = data["rows"]
    fig, (bw, ratio) = plt.subplots(1, 2, figsize=(12, 4))

    def series(select: Callable[[Mapping[str, Any]], bool], key: str) -> tuple[list[float], list[float]]:
        sizes = sorted({r["MiB"] for r in rows if select(r)})
        means = []
        for size in sizes:
            values = [r[key] for r in rows if select(r) and r["MiB"] == size]
            means.append(sum(values) / len(values))
        return sizes, means

    def every(r: Mapping[str, Any]) -> bool:
        return True

    bw.plot(*series(every, "memcpy"), "k-o", label="memcpy, 1 thread")
    bw.plot(*series(every, "memcpy2"), "k--s", label="memcpy, 2 threads")
    for i, lanes in enumerate(sorted({r["lanes"] for r in rows})):
        def mine(r: Mapping[str, Any], n: int = lanes) -> bool:
            return bool(r["lanes"] == n)

        bw.plot(*series(mine, "done"), "-o", color=f"C{i}", label=f"push, {lanes} lane(s): post to KV complete")
        bw.scatter([r["MiB"] for r in rows if mine(r)], [r["done"] for r in rows if mine(r)], color=f"C{i}", s=10)
        ratio.plot(*series(mine, "ratio"), "-o", color=f"C{i}", label=f"{lanes} lane(s)")
        ratio.scatter([r["MiB"] for r in rows if mine(r)], [r["ratio"] for r in rows if mine(r)], color=f"C{i}",
                      s=10)
    ratio.axhline(0.8, color="red", linestyle="--", linewidth=1, label="goal 0.8 (>= 64 MiB)")
    sizes = sorted({r["MiB"] for r in rows})
    for ax, title, ylabel in ((bw, "bandwidth by handoff size", "GB/s"),
                              (ratio, "push / memcpy (paired, median)", "ratio")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{s:.0f}" for s in sizes])
        ax.set_xlabel("KV per handoff (MiB)", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    _save(fig, plt, path, "bench/kv_transfer.py: KV push over NIXL against memcpy", data["run"])


def plot_e2e(data: Data, path: Path) -> None:
    """TTFT of PD and of vLLM alone (with and without MTP) by prompt length, and the PD / vLLM
    alone ratios of TTFT and TPOT against their goals."""
    plt = _pyplot()
    rows = sorted(data["rows"], key=lambda r: r["prompt_tokens"])
    goals = data.get("goals", {})
    labels = [f"{r['prompt_tokens']} tok" for r in rows]
    ttfts = [dict(r["ttft_ms"]) for r in rows]
    for r, values in zip(rows, ttfts, strict=True):
        drafter = _drafter_ms(r)
        if drafter is not None:  # bench/e2e.py's py-spy profile: the MTP drafter's part of PD's prefill step
            values["PD without the MTP drafter (estimate)"] = r["ttft_ms"]["PD"] - drafter
    targets = list(dict.fromkeys(t for values in ttfts for t in values))
    fig, (ttft, ratios) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(targets)
    for i, target in enumerate(targets):
        xs = [x + (i - (len(targets) - 1) / 2) * width for x in range(len(rows))]
        bars = ttft.bar(xs, [values.get(target, 0.0) for values in ttfts], width, label=target)
        ttft.bar_label(bars, fmt="%.0f", fontsize=7)
    ttft.set_xticks(range(len(rows)), labels)
    ttft.set_yscale("log")
    ttft.set_ylabel("ms (log)", fontsize=8)
    ttft.set_title("time to first token by prompt length", fontsize=9)
    ttft.legend(fontsize=7)
    for j, (key, name) in enumerate((("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"))):
        xs = [x + (j - 0.5) * 0.4 for x in range(len(rows))]
        bars = ratios.bar(xs, [r[key]["PD"] / r[key]["alone"] for r in rows], 0.4, label=f"{name} PD / alone")
        ratios.bar_label(bars, fmt="%.2f", fontsize=7)
        goal = goals.get(name.lower())
        if goal is not None:
            ratios.axhline(goal, color=f"C{j}", linestyle="--", linewidth=1, label=f"{name} goal {goal:g}")
    ratios.set_xticks(range(len(rows)), labels)
    ratios.set_ylabel("ratio", fontsize=8)
    ratios.set_title("PD / vLLM alone (same model and numerics)", fontsize=9)
    ratios.legend(fontsize=7)
    _save(fig, plt, path, "bench/e2e.py: PD stack vs vLLM alone", data["run"])


def _drafter_ms(row: Mapping[str, Any]) -> float | None:
    """The MTP drafter's share of the PD prefill worker's busy samples times the PD prefill
    step (bench/e2e.py's ``drafter_share``), when the row has a profile."""
    prof = (row.get("profile") or {}).get("PD")
    if not prof or not prof.get("busy"):
        return None
    return float(prof["MTP drafter"] / prof["busy"] * row["prefill_step_ms"])


FIGURES: dict[str, Callable[[Data, Path], None]] = {
    "router_overhead": plot_router, "kv_transfer": plot_kv, "e2e": plot_e2e}


def render(name: str, results: Path = RESULTS, out: Path = IMG) -> Path:
    """Draw ``out/<name>.png`` from ``results/<name>.json``."""
    data = json.loads((results / f"{name}.json").read_text())
    path = out / f"{name}.png"
    FIGURES[name](data, path)
    return path


def render_all(results: Path = RESULTS, out: Path = IMG) -> tuple[list[Path], list[str]]:
    """Every figure whose data file is in ``results``: (the figures drawn, the names without data)."""
    drawn, missing = [], []
    for name in FIGURES:
        if (results / f"{name}.json").exists():
            drawn.append(render(name, results, out))
        else:
            missing.append(name)
    return drawn, missing


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="the data files (bench/results)")
    ap.add_argument("--out", type=Path, default=IMG, help="where the figures go (docs/img)")
    args = ap.parse_args(argv)
    drawn, missing = render_all(args.results, args.out)
    for path in drawn:
        print(f"figure: {path}")
    for name in missing:
        print(f"no data: {args.results / name}.json (run bench/{name}.py)")
    return 0 if drawn else 1


if __name__ == "__main__":
    raise SystemExit(main())
