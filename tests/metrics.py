"""Reading a server's /metrics in tests."""

from __future__ import annotations

import httpx


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of metric ``name`` at ``url``/metrics that carry ``labels``."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if not line.startswith(name):
            continue
        key = line.split(" ", 1)[0]
        if key.split("{", 1)[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
