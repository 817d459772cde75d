"""Token choice for the reference engine: greedy, or temperature/top-k/top-p sampling with
speculative verification (drafts are greedy MTP proposals, i.e. one-hot draft
distributions, so rejection sampling reduces to: accept draft ``d`` with probability
``p(d)``, else sample from ``p`` with ``d`` removed; the output distribution is ``p``)."""

from __future__ import annotations

import torch

from decode_server.engine.base import SamplingParams, TokenOut


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution over the vocabulary after temperature, top-k and top-p."""
    scaled = logits.float() / params.temperature
    if params.top_k and params.top_k > 0 and params.top_k < scaled.numel():
        kth = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < params.top_p  # always keeps the best token
        keep = torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum()
    return probs


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator, draft: int | None = None) -> int:
    """The token at this position; equals ``draft`` iff the draft is accepted."""
    if params.greedy:
        return int(logits.argmax())
    probs = target_probs(logits, params)
    if draft is not None:
        if torch.rand((), generator=gen, device=gen.device) < probs[draft]:
            return draft
        probs = probs.clone()
        probs[draft] = 0.0
        if float(probs.sum()) <= 0.0:  # p was one-hot on the draft (cannot happen after the accept test)
            return draft
    return int(torch.multinomial(probs, 1, generator=gen))


def token_out(logits: torch.Tensor, token: int, params: SamplingParams) -> TokenOut:
    """The token with its log-probability and top-k alternatives (raw logits, as vLLM reports)."""
    if params.logprobs is None:
        return TokenOut(token)
    logp = logits.float().log_softmax(-1)
    top: tuple[tuple[int, float], ...] = ()
    if params.logprobs > 0:
        values, ids = logp.topk(params.logprobs)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenOut(token, float(logp[token]), top)
