"""Token choice: greedy, the sampling filters, and speculative acceptance preserving the
target distribution (statistically, with a seeded generator)."""

from __future__ import annotations

import pytest
import torch

from decode_server.engine.base import SamplingParams
from decode_server.engine.sampling import choose, target_probs, token_out

pytestmark = pytest.mark.timeout(120)

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def _freqs(params: SamplingParams, draft: int | None, n: int = 20000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(LOGITS.numel())
    for _ in range(n):
        counts[choose(LOGITS, params, gen, draft)] += 1
    return counts / n


def test_greedy_takes_the_argmax_and_accepts_only_an_equal_draft() -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    gen = torch.Generator().manual_seed(0)
    assert choose(LOGITS, params, gen) == 0
    assert choose(LOGITS, params, gen, draft=0) == 0
    assert choose(LOGITS, params, gen, draft=3) == 0


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (9.99e-6, True), (1e-5, False),
                                                 (0.7, False)])
def test_temperatures_below_1e_5_are_greedy_as_in_vllm(temperature: float, greedy: bool) -> None:
    params = SamplingParams(max_tokens=1, temperature=temperature)
    assert params.greedy is greedy
    if greedy:  # the argmax, and a draft other than the argmax is never accepted
        gen = torch.Generator().manual_seed(0)
        assert [choose(LOGITS, params, gen, draft=d) for d in (None, 0, 1, 3)] == [0, 0, 0, 0]


def test_filters() -> None:
    p = target_probs(LOGITS, SamplingParams(max_tokens=1, temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = target_probs(LOGITS, SamplingParams(max_tokens=1, temperature=1.0, top_p=0.5))
    assert p[0] == 1.0  # the best token alone already covers half the mass
    hot = target_probs(LOGITS, SamplingParams(max_tokens=1, temperature=2.0))
    cold = target_probs(LOGITS, SamplingParams(max_tokens=1, temperature=0.5))
    assert cold[0] > hot[0]


def test_speculative_acceptance_keeps_the_target_distribution() -> None:
    params = SamplingParams(max_tokens=1, temperature=0.9, top_k=4)
    target = target_probs(LOGITS, params)
    for draft in (None, 0, 2, 4):  # 4 is outside top-k: never accepted
        freqs = _freqs(params, draft)
        assert (freqs - target).abs().max() < 0.015, (draft, freqs, target)


def test_logprobs_are_raw_and_best_first() -> None:
    params = SamplingParams(max_tokens=1, temperature=0.5, logprobs=3)
    out = token_out(LOGITS, 1, params)
    raw = LOGITS.log_softmax(-1)
    assert abs(out.logprob - float(raw[1])) < 1e-6
    assert [t for t, _ in out.top_logprobs] == [0, 1, 2]
    assert token_out(LOGITS, 1, SamplingParams(max_tokens=1)).logprob is None
    assert token_out(LOGITS, 1, SamplingParams(max_tokens=1, logprobs=0)).top_logprobs == ()
