"""Judging two greedy outputs the way vLLM's own tests compare implementations.

Two sequences of (token, top-k logprobs) agree when they are identical, or when at the
first position where they differ each side's token is among the other side's top-k
alternatives; nothing after that position is compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    token: str
    logprob: float
    top: dict[str, float]  # token -> logprob, the top-k alternatives at this position


@dataclass(frozen=True)
class Verdict:
    ok: bool
    identical: bool
    first_divergence: int | None
    max_logprob_diff: float  # over positions before the divergence (or all, if identical)
    detail: str


def judge(a: Sequence[Step], b: Sequence[Step], name_a: str = "a", name_b: str = "b") -> Verdict:
    max_diff = 0.0
    for i, (x, y) in enumerate(zip(a, b)):
        if x.token == y.token:
            max_diff = max(max_diff, abs(x.logprob - y.logprob))
            continue
        ok = x.token in y.top and y.token in x.top
        detail = (f"position {i}: {name_a} {x.token!r} ({x.logprob:.4f}) vs {name_b} {y.token!r} ({y.logprob:.4f}); "
                  f"{name_a} top={sorted(x.top, key=x.top.get, reverse=True)} "
                  f"{name_b} top={sorted(y.top, key=y.top.get, reverse=True)}")
        return Verdict(ok, False, i, max_diff, detail)
    if len(a) != len(b):
        return Verdict(False, False, min(len(a), len(b)), max_diff, f"lengths differ: {len(a)} vs {len(b)}")
    return Verdict(True, True, None, max_diff, "identical")


def steps_from_completion_logprobs(logprobs: dict) -> list[Step]:
    """``choices[0].logprobs`` of a /v1/completions response (dict form)."""
    return [Step(tok, lp, dict(top or {}))
            for tok, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"])]


def steps_from_chat_logprobs(logprobs: dict) -> list[Step]:
    """``choices[0].logprobs`` of a /v1/chat/completions response (dict form)."""
    return [Step(c["token"], c["logprob"], {t["token"]: t["logprob"] for t in c["top_logprobs"]})
            for c in logprobs["content"]]
