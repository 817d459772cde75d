"""Sampling controls of the reference engine (issue 15): logit bias, presence / frequency /
repetition penalties and min-p with vLLM's semantics, checked against values computed here
by hand, and the engine's greedy output under them (with MTP drafts and without) against a
from-scratch loop: full prefill of prompt + output, penalties applied here, argmax."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from decode_server.engine.base import SamplingParams
from decode_server.engine.reference import ReferenceEngine
from decode_server.engine.sampling import LogitsAdjuster, choose, target_probs
from decode_server.reference import MlaMoeModel, load_model, prefill
from tests.reference.helpers import handoff_for, received

pytestmark = pytest.mark.timeout(900)

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.5, 1.0])


def test_repetition_penalty_covers_prompt_and_output_and_divides_positive_logits() -> None:
    params = SamplingParams(max_tokens=4, repetition_penalty=2.0, prompt_token_ids=(0, 1))
    adjust = LogitsAdjuster(params, 6, first_token_id=2, device=torch.device("cpu"))
    # prompt: 0 (2.0 -> 1.0), 1 (-1.0 -> -2.0); output: 2 (0.5 -> 0.25); others unchanged
    assert adjust(LOGITS).tolist() == [1.0, -2.0, 0.25, 3.0, -0.5, 1.0]
    adjust.accept(3)
    assert adjust(LOGITS).tolist() == [1.0, -2.0, 0.25, 1.5, -0.5, 1.0]


def test_frequency_and_presence_penalties_count_only_the_output() -> None:
    params = SamplingParams(max_tokens=4, frequency_penalty=0.5, presence_penalty=0.25, prompt_token_ids=(5,))
    adjust = LogitsAdjuster(params, 6, first_token_id=3, device=torch.device("cpu"))
    adjust.accept(3)
    adjust.accept(4)
    # token 3 twice: 3.0 - 2*0.5 - 0.25; token 4 once: -0.5 - 0.5 - 0.25; prompt token 5 untouched
    assert adjust(LOGITS).tolist() == [2.0, -1.0, 0.5, 1.75, -1.25, 1.0]


def test_logit_bias_is_added_before_the_penalties() -> None:
    params = SamplingParams(max_tokens=4, logit_bias=((1, 4.0),), repetition_penalty=2.0, prompt_token_ids=(1,))
    adjust = LogitsAdjuster(params, 6, first_token_id=5, device=torch.device("cpu"))
    # token 1: -1.0 + 4.0 = 3.0, then divided (positive now) by 2 -> 1.5; token 5 (output): 1.0 / 2
    assert adjust(LOGITS).tolist() == [2.0, 1.5, 0.5, 3.0, -0.5, 0.5]
    greedy = SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((4, 10.0),))
    gen = torch.Generator().manual_seed(0)
    assert choose(LogitsAdjuster(greedy, 6, 0, torch.device("cpu"))(LOGITS), greedy, gen) == 4


def test_min_p_drops_tokens_below_its_share_of_the_best_after_temperature() -> None:
    probs = (LOGITS / 0.5).softmax(-1)
    keep = probs >= 0.1 * probs.max()
    got = target_probs(LOGITS, SamplingParams(max_tokens=1, temperature=0.5, min_p=0.1))
    assert torch.equal(got > 0, keep)
    assert torch.allclose(got, torch.where(keep, probs, 0.0) / torch.where(keep, probs, 0.0).sum())
    one = target_probs(LOGITS, SamplingParams(max_tokens=1, temperature=1.0, min_p=1.0))
    assert one.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> MlaMoeModel:
    return load_model(tiny_model_dir)


def _from_scratch(model: MlaMoeModel, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """Greedy under the penalties, recomputing everything each token (no KV reuse, no MTP)."""
    out: list[int] = []
    for _ in range(n):
        logits = prefill(model, prompt + out).logits.float().clone()
        for tok, bias in params.logit_bias:
            logits[tok] += bias
        for tok in set(prompt) | set(out):
            v = float(logits[tok])
            logits[tok] = v / params.repetition_penalty if v > 0 else v * params.repetition_penalty
        for tok in set(out):
            logits[tok] -= params.frequency_penalty * out.count(tok) + params.presence_penalty
        out.append(int(logits.argmax()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("num_mtp", [0, 1, 2])
def test_engine_greedy_under_penalties_equals_recomputing_from_scratch(tiny_model_dir, model, num_mtp) -> None:
    """Logit bias and every penalty at once; each position's logits depend on the tokens
    before it, MTP drafts included (verified against the adjusted argmax)."""
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    prompt = tokenizer.encode("[gMASK]<sop><|user|>\nTell me about heapq.<|assistant|>\n").ids
    n = 20
    params = SamplingParams(max_tokens=n, temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.3,
                            presence_penalty=0.2, logit_bias=((7, 1.5),), prompt_token_ids=tuple(prompt))
    expected = _from_scratch(model, prompt, params, n)
    engine = ReferenceEngine(tiny_model_dir, model=model, num_mtp=num_mtp)
    first = prefill(model, prompt)
    # vLLM prefill (with MTP) refuses logit_bias: the engine chooses the first token itself,
    # from the last prompt position; prefill's (here a wrong one on purpose) is not used
    wrong = (expected[0] + 1) % model.cfg.vocab_size
    session = engine.start(received("h", [t.clone() for t in first.kv]), handoff_for(prompt, wrong), params)
    assert session.first_token is not None
    got = [session.first_token.token_id]
    try:
        while len(got) < n:
            got += [t.token_id for t in session.step()]
    finally:
        session.close()
    plain = _from_scratch(model, prompt, SamplingParams(max_tokens=n, temperature=0.0), n)
    assert got[:n] == expected
    assert expected != plain  # the penalties changed the output
    if num_mtp:
        assert session.stats.drafted > 0


@pytest.mark.slow
def test_engine_keeps_prefills_first_token_without_bias_or_min_p(tiny_model_dir, model) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    prompt = tokenizer.encode("The json module").ids
    first = prefill(model, prompt)
    engine = ReferenceEngine(tiny_model_dir, model=model, num_mtp=1)
    params = SamplingParams(max_tokens=4, temperature=0.0, presence_penalty=1.0)
    session = engine.start(received("h", [t.clone() for t in first.kv]), handoff_for(prompt, 5), params)
    assert session.first_token is None  # penalties: vLLM prefill applies them to the first token
    session.close()
    session = engine.start(received("h", [t.clone() for t in first.kv]), handoff_for(prompt, 5),
                           SamplingParams(max_tokens=4, temperature=1.0, min_p=1.0))
    assert session.first_token is not None and session.first_token.token_id == int(first.logits.argmax())
    session.close()
