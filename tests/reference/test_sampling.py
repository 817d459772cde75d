"""Token choice: greedy, the sampling filters, speculative acceptance preserving the target
distribution (statistically, with a seeded generator), and the draws seeded by position."""

from __future__ import annotations

import pytest
import torch

from decode_server.engine.base import SamplingParams
from decode_server.engine.sampling import choose, position_seed, target_probs, token_out

pytestmark = pytest.mark.timeout(120)

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def test_greedy_takes_the_argmax() -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    gen = torch.Generator().manual_seed(0)
    assert [choose(LOGITS, params, gen) for _ in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (9.99e-6, True), (1e-5, False),
                                                 (0.7, False)])
def test_temperatures_below_1e_5_are_greedy_as_in_vllm(temperature: float, greedy: bool) -> None:
    params = SamplingParams(max_tokens=1, temperature=temperature)
    assert params.greedy is greedy
    if greedy:  # the argmax, whatever the generator
        assert {choose(LOGITS, params, torch.Generator().manual_seed(s)) for s in range(20)} == {0}


def test_filters() -> None:
    p = target_probs(LOGITS, SamplingParams(max_tokens=1, temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = target_probs(LOGITS, SamplingParams(max_tokens=1, temperature=1.0, top_p=0.5))
    assert p[0] == 1.0  # the best token alone already covers half the mass
    hot = target_probs(LOGITS, SamplingParams(max_tokens=1, temperature=2.0))
    cold = target_probs(LOGITS, SamplingParams(max_tokens=1, temperature=0.5))
    assert cold[0] > hot[0]


def test_speculative_acceptance_keeps_the_target_distribution() -> None:
    """A greedy draft is accepted iff the token drawn at its position is the draft: at the rate
    ``p(draft)``, and the tokens emitted keep the target distribution."""
    params = SamplingParams(max_tokens=1, temperature=0.9, top_k=4)
    target = target_probs(LOGITS, params)
    gen = torch.Generator()
    n = 20000
    counts = torch.zeros(LOGITS.numel())
    for i in range(n):
        counts[choose(LOGITS, params, gen.manual_seed(position_seed(3, i)))] += 1
    assert ((counts / n) - target).abs().max() < 0.015, (counts / n, target)
    for draft in (0, 2, 4):  # 4 is outside top-k: never accepted
        assert abs(float(counts[draft]) / n - float(target[draft])) < 0.015


def test_a_draw_depends_only_on_the_seed_and_the_position() -> None:
    params = SamplingParams(max_tokens=1, temperature=1.0)
    wide = torch.linspace(0.0, 1.0, 64)  # near-uniform: two unrelated draws rarely agree

    def draw(seed: int, position: int) -> int:
        return choose(wide, params, torch.Generator().manual_seed(position_seed(seed, position)))

    assert [draw(7, p) for p in range(50)] == [draw(7, p) for p in range(50)]
    assert [draw(7, p) for p in range(50)] != [draw(8, p) for p in range(50)]
    assert [draw(7, p) for p in range(50)] != [draw(7, p + 1) for p in range(50)]
    assert len({position_seed(s, p) for s in range(30) for p in range(30)}) == 900
    assert all(0 <= position_seed(s, p) < 1 << 63 for s in (0, 1, (1 << 63) - 1, -5) for p in (0, 10**6))


def test_logprobs_are_raw_and_best_first() -> None:
    params = SamplingParams(max_tokens=1, temperature=0.5, logprobs=3)
    out = token_out(LOGITS, 1, params)
    raw = LOGITS.log_softmax(-1)
    assert abs(out.logprob - float(raw[1])) < 1e-6
    assert [t for t, _ in out.top_logprobs] == [0, 1, 2]
    assert token_out(LOGITS, 1, SamplingParams(max_tokens=1)).logprob is None
    assert token_out(LOGITS, 1, SamplingParams(max_tokens=1, logprobs=0)).top_logprobs == ()
