"""``entrypoint.sh wait-ready URL...``: block until every URL answers 200.

Kubernetes has no start order across workloads; the prefill pod's init container uses
this to wait for every decode server's ``/ready`` (engine loaded, KV endpoint listening),
because vLLM's connector handshakes with the decode KV endpoints as it starts.
``PD_WAIT_TIMEOUT`` (seconds, default 0: no limit) and ``PD_WAIT_INTERVAL`` (default 5)
(:class:`WaitSettings`).
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from pd_settings.loader import EntrySettings, load
from pd_settings.problems import SettingsError


class WaitSettings(EntrySettings):
    model_config = SettingsConfigDict(env_prefix="PD_WAIT_")

    timeout: float = Field(0.0, ge=0, description="seconds to wait at most (0: no limit)")
    interval: float = Field(5.0, gt=0, description="seconds between two rounds of requests")


def _status(url: str) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - URLs come from the manifest
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError) as exc:
        return type(exc).__name__


def wait_ready(urls: list[str], environ: Mapping[str, str]) -> int:
    if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
        print(f"wait-ready: expected http(s) URLs, got {urls!r}", file=sys.stderr)
        return 2
    try:
        settings = load(WaitSettings, None, environ)
    except SettingsError as exc:
        print(f"wait-ready: {exc}", file=sys.stderr)
        return 2
    timeout, interval = settings.timeout, settings.interval
    deadline = time.monotonic() + timeout if timeout > 0 else None
    pending = list(urls)
    while True:
        pending = [u for u in pending if _status(u) != 200]
        if not pending:
            print(f"wait-ready: all ready: {', '.join(urls)}", file=sys.stderr, flush=True)
            return 0
        if deadline is not None and time.monotonic() >= deadline:
            print(f"wait-ready: not ready after {timeout:g}s: {', '.join(pending)}", file=sys.stderr)
            return 1
        print(f"wait-ready: waiting for {', '.join(f'{u} ({_status(u)})' for u in pending)}",
              file=sys.stderr, flush=True)
        time.sleep(interval)
