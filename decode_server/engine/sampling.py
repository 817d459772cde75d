"""Token choice for the reference engine: greedy, or temperature/min-p/top-k/top-p sampling.

A sampled token is drawn from the target distribution with the randomness of its position in
the sequence alone (:func:`position_seed`: the request's seed and the token's position), so
the tokens of a seeded request do not depend on how the steps fell: MTP drafts (a greedy
proposal ``d`` is accepted iff the token drawn there is ``d``, which happens with
probability ``p(d)``: the rejection sampling of a one-hot draft, the output distribution is
``p``), nor a sequence resumed elsewhere from its tokens so far.

Before the choice, in vLLM's order (its sampler): logit bias, then the repetition penalty
(tokens of the prompt or the output: a positive logit divided by it, a negative one
multiplied), then the frequency (times the token's count in the output) and presence
(once if in the output) penalties; greedy is the argmax of the result; sampling then
divides by the temperature, drops tokens below ``min_p`` times the best one's probability,
then applies top-k and top-p. Logprobs are of the raw logits, as vLLM reports them by
default (``raw_logprobs``)."""

from __future__ import annotations

import torch

from decode_server.engine.base import SamplingParams, TokenOut


class LogitsAdjuster:
    """One sequence's logit bias and penalties: the output counts so far (``accept`` each
    emitted token, the first one prefill sampled and those before a cut included) and the
    prompt's token set."""

    def __init__(self, params: SamplingParams, vocab_size: int, first_token_id: int | None,
                 device: torch.device) -> None:
        self._params = params
        self._bias: torch.Tensor | None = None
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=device)
            values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
            self._bias = torch.zeros(vocab_size, dtype=torch.float32, device=device).index_put_((ids,), values)
        self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self._seen: torch.Tensor | None = None  # prompt or output tokens (repetition penalty)
        if params.repetition_penalty != 1.0:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if params.prompt_token_ids:
                self._seen[torch.tensor(params.prompt_token_ids, dtype=torch.long, device=device)] = True
        for token in params.resumed_from:  # the output before a cut
            self.accept(token)
        if first_token_id is not None:  # prefill's, else the first token is yet to be chosen
            self.accept(first_token_id)

    def accept(self, token: int) -> None:
        self._counts[token] += 1
        if self._seen is not None:
            self._seen[token] = True

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        p = self._params
        out = logits.float().clone()
        if self._bias is not None:
            out += self._bias
        if self._seen is not None:
            penalized = torch.where(out > 0, out / p.repetition_penalty, out * p.repetition_penalty)
            out = torch.where(self._seen, penalized, out)
        if p.frequency_penalty:
            out -= p.frequency_penalty * self._counts
        if p.presence_penalty:
            out -= p.presence_penalty * (self._counts > 0).float()
        # a penalty past float32's range (repetition_penalty 1e308 times a negative logit) would
        # make every logit -inf, and the distribution nothing: the overflow stops at float32's ends
        return out.nan_to_num_(nan=_LOWEST, posinf=-_LOWEST, neginf=_LOWEST)


_LOWEST = torch.finfo(torch.float32).min


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution over the vocabulary after temperature, min-p, top-k and top-p."""
    scaled = logits.float() / params.temperature
    if params.min_p > 0.0:
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k and params.top_k > 0 and params.top_k < scaled.numel():
        kth = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < params.top_p
        keep_sorted[0] = True  # the best token, also for a top_p below float32's smallest number
        keep = torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum()
    return probs


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def position_seed(seed: int, position: int) -> int:
    """The seed of the draw at ``position`` (0-based, in the whole sequence: prompt and output)
    of a sequence seeded ``seed``: SplitMix64's finaliser over the two, so neighbouring
    positions and seeds give unrelated streams."""
    z = (seed * _GOLDEN + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """The token at this position: the argmax (greedy), else one draw from the target
    distribution with ``gen`` (seeded for the position by the caller)."""
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(target_probs(logits, params), 1, generator=gen))


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
