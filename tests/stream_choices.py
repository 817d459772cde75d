"""A streamed OpenAI answer's SSE events (parsed ``data:`` payloads), folded per choice: what the
migration tests compare between an interrupted answer and the uninterrupted one."""

from __future__ import annotations

from typing import Any


def choices_of(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per choice: its text (content or text), reasoning, tool calls' names and arguments, logprobs'
    tokens and finish reason; under -1 an error event's ``error`` (or the whole event of a client
    that got no stream: ``client_error``, ``status``)."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        if "error" in e or "client_error" in e or "status" in e:
            out[-1] = e.get("error", e)
        for c in e.get("choices") or ():
            got = out.setdefault(c["index"], {"text": "", "reasoning": "", "calls": "", "lp": [], "finish": None})
            delta = c.get("delta") or {}
            got["text"] += c.get("text") or delta.get("content") or ""
            got["reasoning"] += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or ():
                got["calls"] += (call["function"].get("name") or "") + (call["function"].get("arguments") or "")
            lp = c.get("logprobs") or {}
            got["lp"] += lp.get("tokens") or [t["token"] for t in lp.get("content") or ()]
            got["finish"] = c.get("finish_reason") or got["finish"]
    return out


def each_choice_streams(events: list[dict[str, Any]], n: int, at_least: int = 3) -> bool:
    """Every one of the ``n`` choices has had ``at_least`` events: each is mid-answer on its
    decode server (with n > 1, a choice may still wait for its KV while another streams)."""
    seen = [0] * n
    for e in list(events):  # (appended to by the client's thread)
        for c in e.get("choices") or ():
            if 0 <= c["index"] < n:
                seen[c["index"]] += 1
    return min(seen) >= at_least
