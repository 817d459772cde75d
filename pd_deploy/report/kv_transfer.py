"""The KV transfer of a job, for ``summary.md``: what carried the handoffs and how fast.

The summary step saves every prefill and decode server's ``/metrics`` into
``JOB_DIR/metrics/<step id>.prom`` (:func:`save_metrics`); this module reads them back:

* prefill (the connector, per rank): ``vllm:tilert_kv_transport_bytes_total{transport}`` and
  ``vllm:tilert_kv_write_seconds{transport}`` (a handoff's first WRITE posted to its last
  landed): bytes, handoffs and bandwidth per transport UCX chose;
* decode: ``decode_server_kv_received_bytes_total`` and ``decode_server_kv_handoff_seconds``
  (admission to every layer landed, prefill's compute of the layers included).

The recipe's ``kv_network.expect`` is compared with the transports' kinds
(:func:`connector.transport.ucx_proto.transport_class`): bytes carried otherwise are
flagged, a TCP fallback where RDMA was expected first of all.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from connector.transport.ucx_proto import transport_class
from pd_deploy.recipe.fingerprint_model import Fingerprint

METRICS_DIR = "metrics"
TRANSPORT_BYTES = "vllm:tilert_kv_transport_bytes_total"
WRITE_SECONDS = "vllm:tilert_kv_write_seconds"
DECODE_BYTES = "decode_server_kv_received_bytes_total"
DECODE_SECONDS = "decode_server_kv_handoff_seconds"


def save_metrics(fp: Fingerprint, job_dir: Path, timeout: float = 30.0) -> dict[str, str]:
    """Every prefill and decode server's ``/metrics`` into ``job_dir/metrics/<id>.prom``; the
    ones that could not be read, with why (also written, as ``<id>.error``)."""
    out = job_dir / METRICS_DIR
    out.mkdir(parents=True, exist_ok=True)
    failed = {}
    for s in fp.services:
        if s.role not in ("prefill", "decode"):
            continue
        try:
            with urllib.request.urlopen(s.metrics_url, timeout=timeout) as resp:
                (out / f"{s.id}.prom").write_bytes(resp.read())
        except (OSError, urllib.error.URLError) as exc:
            failed[s.id] = f"GET {s.metrics_url} failed: {exc}"
            (out / f"{s.id}.error").write_text(failed[s.id] + "\n")
    return failed


@dataclass
class Tally:
    """Handoffs summed: by transport (prefill's connector, its ranks and servers together) or
    by decode server."""

    name: str
    nbytes: float = 0.0
    handoffs: float = 0.0
    seconds: float = 0.0  # prefill: the WRITE times; decode: admission to complete


def _tally(fp: Fingerprint, job_dir: Path, role: str, nbytes: str, seconds: str,
           label: str | None) -> dict[str, Tally]:
    """``role``'s saved /metrics summed by the value of ``label`` (None: by server)."""
    fields = {nbytes: "nbytes", f"{seconds}_count": "handoffs", f"{seconds}_sum": "seconds"}
    by: dict[str, Tally] = {}
    for s in fp.services:
        path = job_dir / METRICS_DIR / f"{s.id}.prom"
        if s.role != role or not path.exists():
            continue
        for family in text_string_to_metric_families(path.read_text()):
            for sample in family.samples:
                field = fields.get(sample.name)
                if field is None or (label is not None and label not in sample.labels):
                    continue
                key = s.id if label is None else sample.labels[label]
                tally = by.setdefault(key, Tally(key))
                setattr(tally, field, getattr(tally, field) + sample.value)
    return by


def carried(fp: Fingerprint, job_dir: Path) -> dict[str, Tally]:
    """What each transport carried (prefill's connector metrics), of the handoffs that landed."""
    by = _tally(fp, job_dir, "prefill", TRANSPORT_BYTES, WRITE_SECONDS, "transport")
    return {t: c for t, c in by.items() if c.handoffs}


def received(fp: Fingerprint, job_dir: Path) -> list[Tally]:
    """Each decode server's completed handoffs."""
    return list(_tally(fp, job_dir, "decode", DECODE_BYTES, DECODE_SECONDS, None).values())


def _rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.3g}" if seconds > 0 else "-"


def _mean_ms(seconds: float, count: float) -> str:
    return f"{seconds / count * 1e3:.4g}" if count else "-"


def kv_section(fp: Fingerprint, job_dir: Path, expect: str) -> list[str]:
    lines = ["## KV transfer", ""]
    missing = [s.id for s in fp.services if s.role in ("prefill", "decode")
               and not (job_dir / METRICS_DIR / f"{s.id}.prom").exists()]
    if missing:
        lines += [f"no /metrics saved from {', '.join(missing)} (see {METRICS_DIR}/*.error)", ""]
    by = carried(fp, job_dir)
    if by:
        lines += ["Prefill's KV WRITEs, by the transport UCX chose (first WRITE posted to last landed):", "",
                  "| transport | kind | handoffs | MiB | WRITE time avg (ms) | GB/s |", "|---|---|---|---|---|---|"]
        for c in sorted(by.values(), key=lambda c: -c.nbytes):
            lines.append(f"| {c.name} | {transport_class(c.name)} | {c.handoffs:.0f} | "
                         f"{c.nbytes / 2**20:.4g} | {_mean_ms(c.seconds, c.handoffs)} | {_rate(c.nbytes, c.seconds)} |")
    else:
        lines.append("no KV handoff landed according to the prefill servers' metrics")
    rows = [r for r in received(fp, job_dir) if r.handoffs]
    if rows:
        lines += ["", "Decode's handoffs (admission to every layer landed, prefill's compute included):", "",
                  "| decode server | handoffs | MiB | handoff time avg (ms) | GB/s |", "|---|---|---|---|---|"]
        lines += [f"| {r.name} | {r.handoffs:.0f} | {r.nbytes / 2**20:.4g} | {_mean_ms(r.seconds, r.handoffs)} | "
                  f"{_rate(r.nbytes, r.seconds)} |" for r in rows]
    lines += ["", _verdict(by, expect)]
    return lines


def _verdict(by: dict[str, Tally], expect: str) -> str:
    if expect == "any":
        return "Expected transport: any (recipe `kv_network.expect`)."
    other = {t: c for t, c in by.items() if transport_class(t) != expect}
    if not by:
        return f"Expected transport: {expect}; not checked: no handoff landed."
    if not other:
        return f"Expected transport: {expect}; every handoff went over it."
    what = ", ".join(f"{c.nbytes / 2**30:.3g} GiB over {t} ({transport_class(t)})" for t, c in sorted(other.items()))
    fallback = " (a TCP fallback)" if expect == "rdma" and any(transport_class(t) == "tcp" for t in other) else ""
    return (f"**FLAG: KV expected over {expect}, but {what}{fallback}.** Check the roles' UCX settings and "
            "devices (docs/deploy.md, \"KV network\").")
