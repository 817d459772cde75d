"""The reference engine on the tiny model: decoding from injected KV, MTP, sampling, slots,
cancellation and bad input. No vLLM here (see test_vllm_equivalence.py)."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from decode_server.engine.base import Cancelled, EngineError, SamplingParams
from decode_server.engine.reference import ReferenceEngine
from decode_server.reference import MlaMoeModel, load_model, prefill
from tests.equivalence import judge
from tests.reference.helpers import as_steps, generate_greedy, handoff_for, prefilled, received

PROMPTS = [
    "The json module",
    "Return a new list containing",
    "[gMASK]<sop><|user|>\nWhat does shutil.copy do?<|assistant|>\n",
    "Create and return a temporary directory",
    "[gMASK]<sop><|user|>\nTell me about heapq.<|assistant|>\n",
    "If the optional argument is given,",
    "[gMASK]<sop><|user|>\nExplain argparse.<|assistant|>\n",
    "This module provides",
]

MTP_FAR_ABOVE_CHANCE = 0.1  # 400x a uniform draft over the 4096-token vocabulary

# bounded, generously: the first use of tiny_model_dir on a host trains the model (~2 min idle)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> MlaMoeModel:
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def _engine(tiny_model_dir: Path, model: MlaMoeModel, **kw) -> ReferenceEngine:
    return ReferenceEngine(tiny_model_dir, model=model, **kw)


def test_incremental_decode_matches_full_recompute(tiny_model_dir, model, tokenizer) -> None:
    """Decoding over the injected KV gives the logits of a from-scratch pass over the same text."""
    ids = tokenizer.encode(PROMPTS[0]).ids
    tokens, _ = generate_greedy(_engine(tiny_model_dir, model, num_mtp=0), model, ids, 12)
    full = ids + [t.token_id for t in tokens]
    for k in (3, 7, 11):
        ref = prefill(model, full[:len(ids) + k]).logits.log_softmax(-1)
        assert int(ref.argmax()) == tokens[k].token_id
        assert abs(float(ref[tokens[k].token_id]) - tokens[k].logprob) < 1e-4


def test_mtp_greedy_matches_plain_greedy(tiny_model_dir, model, tokenizer) -> None:
    plain = _engine(tiny_model_dir, model, num_mtp=0)
    spec = _engine(tiny_model_dir, model, num_mtp=1)
    identical, drafted, accepted = 0, 0, 0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        a, _ = generate_greedy(plain, model, ids, 32)
        b, stats = generate_greedy(spec, model, ids, 32)
        verdict = judge(as_steps(a), as_steps(b), "no-mtp", "mtp")
        assert verdict.ok, verdict.detail
        identical += verdict.identical
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    rate = accepted / drafted
    print(f"\nMTP vs no MTP: {identical}/{len(PROMPTS)} identical; acceptance {accepted}/{drafted} = {rate:.2f}")
    assert identical >= len(PROMPTS) - 1
    # MTP drafts are far above chance (a draft independent of the context matches 1/vocab
    # of the time). How far depends on how well the machine that generated the model trained
    # it (0.39-0.62 seen); test_vllm_equivalence checks the count against vLLM's own MTP.
    assert rate >= MTP_FAR_ABOVE_CHANCE


def test_two_drafts_per_step_still_exact(tiny_model_dir, model, tokenizer) -> None:
    ids = tokenizer.encode(PROMPTS[2]).ids
    a, _ = generate_greedy(_engine(tiny_model_dir, model, num_mtp=0), model, ids, 24)
    b, stats = generate_greedy(_engine(tiny_model_dir, model, num_mtp=2), model, ids, 24)
    assert judge(as_steps(a), as_steps(b)).ok
    assert stats.drafted >= 2 * (stats.steps - 1) and stats.accepted > 0


def test_seeded_sampling_is_reproducible_and_uses_drafts(tiny_model_dir, model, tokenizer) -> None:
    engine = _engine(tiny_model_dir, model, num_mtp=1)
    kv, handoff, _ = prefilled(model, tokenizer.encode(PROMPTS[1]).ids)

    def run(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, top_k=50, seed=seed)
        s = engine.start(kv, handoff, params)
        toks: list[int] = []
        while len(toks) < 40:
            toks += [t.token_id for t in s.step()]
        s.close()
        assert s.stats.drafted > 0
        return toks[:40]

    assert run(7) == run(7)
    assert run(7) != run(8)


def _sampled(engine: ReferenceEngine, model: MlaMoeModel, ids: list[int], params: SamplingParams,
             n: int) -> list[int]:
    """``n`` tokens of the engine after the prefill of ``ids``, the first chosen by the engine
    too (``params.first_token_here``: with min_p, or resumed)."""
    assert params.first_token_here
    kv, handoff, _ = prefilled(model, ids)
    session = engine.start(kv, handoff, params)
    toks = [session.first_token.token_id]
    try:
        while len(toks) < n:
            toks += [t.token_id for t in session.step()]
    finally:
        session.close()
    return toks[:n]


def test_seeded_sampling_does_not_depend_on_the_drafts(tiny_model_dir, model, tokenizer) -> None:
    """Each token is drawn with its position's randomness: MTP on or off, the same tokens."""
    ids = tokenizer.encode(PROMPTS[3]).ids
    params = SamplingParams(max_tokens=40, temperature=0.8, min_p=0.01, seed=5)
    with_mtp = _sampled(_engine(tiny_model_dir, model, num_mtp=1), model, ids, params, 40)
    assert with_mtp == _sampled(_engine(tiny_model_dir, model, num_mtp=0), model, ids, params, 40)


RESUMED = {  # sampling controls whose state a resumed sequence must carry over the cut
    "seeded": {"temperature": 1.0, "top_k": 40, "min_p": 0.01, "seed": 1234},
    "penalties": {"temperature": 0.9, "seed": 77, "presence_penalty": 0.8, "frequency_penalty": 0.6,
                  "repetition_penalty": 1.3},
    "greedy_penalties": {"temperature": 0.0, "frequency_penalty": 1.5, "repetition_penalty": 1.2},
}


@pytest.mark.parametrize("cut", [1, 9, 23])
@pytest.mark.parametrize("controls", sorted(RESUMED))
def test_a_sequence_resumed_from_its_tokens_so_far_goes_on_as_uninterrupted(
        tiny_model_dir, model, tokenizer, controls, cut) -> None:
    """A sequence cut after ``cut`` tokens and prefilled again with them (as a migration to
    another decode server does), resumed with those tokens (``resumed_from``: penalties, the
    token at the cut chosen here), gives the tokens of the one never cut."""
    engine = _engine(tiny_model_dir, model, num_mtp=1)
    ids = tokenizer.encode(PROMPTS[5]).ids
    params = SamplingParams(max_tokens=32, prompt_token_ids=tuple(ids), **RESUMED[controls])
    if not params.first_token_here:  # the uninterrupted one chooses its first token here too
        params = replace(params, logit_bias=((0, 0.0),))
    whole = _sampled(engine, model, ids, params, 32)
    assert len(set(whole)) > 8  # not a loop: the penalties and the draws at work
    resumed = replace(params, max_tokens=32 - cut, resumed_from=tuple(whole[:cut]))
    assert _sampled(engine, model, ids + whole[:cut], resumed, 32 - cut) == whole[cut:]


def test_slots_busy_and_close_frees(tiny_model_dir, model, tokenizer) -> None:
    engine = _engine(tiny_model_dir, model, slots=2)
    kv, h, _ = prefilled(model, tokenizer.encode(PROMPTS[0]).ids)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    s1, s2 = engine.start(kv, h, params), engine.start(kv, h, params)
    with pytest.raises(EngineError, match="busy"):
        engine.start(kv, h, params)
    s1.step()
    s1.close()
    s1.close()  # idempotent
    assert engine.busy_slots == 1
    engine.start(kv, h, params).close()
    s2.close()
    assert engine.busy_slots == 0


def test_cancel_from_another_thread(tiny_model_dir, model, tokenizer) -> None:
    engine = _engine(tiny_model_dir, model)
    kv, handoff, _ = prefilled(model, tokenizer.encode(PROMPTS[3]).ids)
    session = engine.start(kv, handoff, SamplingParams(max_tokens=10_000, temperature=0.0))
    session.step()
    t = threading.Thread(target=session.cancel)
    t.start()
    t.join(5)
    with pytest.raises(Cancelled):
        session.step()
    session.close()
    assert engine.busy_slots == 0


def test_bad_kv_is_refused_without_leaking_a_slot(tiny_model_dir, model, tokenizer) -> None:
    engine = _engine(tiny_model_dir, model)
    ids = tokenizer.encode(PROMPTS[0]).ids
    kv, good, layers = prefilled(model, ids)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(EngineError, match="layers"):
        engine.start(received("h", layers[:1]), good, params)
    with pytest.raises(EngineError, match="shape"):
        engine.start(received("h", [t[:, :512] for t in layers]), good, params)
    with pytest.raises(EngineError, match="tokens"):
        engine.start(kv, handoff_for(ids + [5], 1), params)
    with pytest.raises(EngineError, match="vocabulary"):
        engine.start(kv, handoff_for(ids, 10**7), params)
    assert engine.busy_slots == 0
    with pytest.raises(ValueError, match="slots=0"):
        ReferenceEngine(tiny_model_dir, model=model, slots=0)


def test_sequence_capacity_is_an_engine_error(tiny_model_dir, model, tokenizer) -> None:
    ids = tokenizer.encode(PROMPTS[0]).ids
    engine = _engine(tiny_model_dir, model, max_seq_len=len(ids) + 6, num_mtp=0)
    kv, handoff, _ = prefilled(model, ids)
    s = engine.start(kv, handoff, SamplingParams(max_tokens=100, temperature=0.0))
    with pytest.raises(EngineError, match="too long"):
        for _ in range(10):
            s.step()
    s.close()


def test_bfloat16_kv_is_accepted(tiny_model_dir, model, tokenizer) -> None:
    """KV from a bf16 prefill (vLLM's default for float32 checkpoints) decodes, upcast."""
    engine = _engine(tiny_model_dir, model, kv_dtype="bfloat16")
    assert engine.kv_layout.planes[0].dtype == "bfloat16"
    _, handoff, layers = prefilled(model, tokenizer.encode(PROMPTS[0]).ids)
    s = engine.start(received("h", [t.to(torch.bfloat16) for t in layers]), handoff,
                     SamplingParams(max_tokens=4, temperature=0.0))
    assert len(s.step()) == 1
    s.close()
