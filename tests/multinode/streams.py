"""A streamed completion read by a client thread while the test breaks something."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class StreamRecord:
    """What the client saw: every ``data:`` event (a transport failure as ``client_error``)
    and the time the stream ended (``time.monotonic``)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    ended: list[float] = field(default_factory=list)


def read_stream(url: str, body: dict[str, Any], headers: dict[str, str], record: StreamRecord) -> None:
    """POST ``body`` to ``url`` and read the stream to its end (run it on the client's node)."""
    try:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=600) as resp:
            if resp.status_code != 200:  # an answer, not a stream: kept whole for the test to show
                record.events.append({"status": resp.status_code, "body": resp.read().decode(errors="replace")})
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    record.events.append(json.loads(line[6:]))
    except httpx.HTTPError as exc:
        record.events.append({"client_error": repr(exc)})
    record.ended.append(time.monotonic())
