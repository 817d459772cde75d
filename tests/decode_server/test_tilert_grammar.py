"""Structured output through the TileRT adapter's bitmask interface, against the fake
generator (tests/fakes/fake_tilert.py) and a toy grammar (tests/fakes/fake_grammar.py):
the first token checked, one mask row per position of each verify call, the drafts'
rows filled after accepting them and rolled back, one verify step per call while the
grammar holds, the matcher advanced with exactly the emitted tokens, the mask reset
once the grammar is done and before the sequence ends."""

from __future__ import annotations

import pytest
import torch

from decode_server.engine.base import EngineError, SamplingParams
from decode_server.engine.grammar import Constraint
from tests.decode_server.test_tilert_engine import _engine, _handoff, _received
from tests.fakes.fake_grammar import FakeMatcher
from tests.fakes.fake_tilert import VOCAB, FakeDecodeLayer, chain

pytestmark = pytest.mark.timeout(60)


def _decoded(session, steps: int) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        out += [t.token_id for t in session.step()]
    return out


@pytest.mark.parametrize("num_mtp", [3, 0])
def test_masks_constrain_every_step_and_advance_the_matcher(tmp_path, num_mtp):
    engine, gen = _engine(tmp_path, num_mtp=num_mtp, ar_steps=8)
    assert engine.capabilities.features.structured_output
    matcher = FakeMatcher(VOCAB, length=9)
    session = engine.start(_received(8, 4 if num_mtp else 3), _handoff(8, first=10),
                           SamplingParams(max_tokens=40, temperature=0.0, grammar=matcher))
    assert matcher.accepted == [10]  # prefill's first token went through the grammar
    tokens = _decoded(session, 6 if num_mtp else 12)
    assert chain(10, 3) != [t for t in chain(10, 3) if t % 2 == 0], "the unconstrained chain must break the grammar"
    # 9 tokens of the language (the first token and 8 decoded), then the stop token
    assert all(t % 2 == 0 for t in tokens[:8]) and tokens[8] == 1, tokens
    assert matcher.accepted == [10, *tokens[:9]] and matcher.terminated
    dl = gen.decode_layer
    rows = (4 if num_mtp else 1)
    assert all(tuple(m.shape) == (1, rows, (VOCAB + 31) // 32) for m in dl.mask_history)
    verify = "show_hands" if num_mtp else "show_hands_no_mtp"
    calls = [c for c in gen.calls if c[0] == verify]
    assert all(c[2] == 1 for c in calls[: len(dl.mask_history)])  # one step per call under a mask
    assert ("reset_grammar_bitmask",) in gen.calls  # once the grammar completed
    session.close()
    assert gen.calls[-1] == ("reset_sequence",) and dl.masks is None


def test_draft_rows_follow_the_drafts_then_roll_back(tmp_path):
    engine, gen = _engine(tmp_path, num_mtp=3)
    matcher = FakeMatcher(VOCAB, length=50)
    session = engine.start(_received(8, 4), _handoff(8, first=10),
                           SamplingParams(max_tokens=40, temperature=0.0, grammar=matcher))
    _decoded(session, 3)
    dl = gen.decode_layer
    # the second verify call carries the drafts the fake handed out: rows after an odd draft repeat the last row
    drafts = [c[1] for c in gen.calls if c[0] == "show_hands"][2][1:]
    masks = dl.mask_history[1][0]
    constraint = Constraint(FakeMatcher(VOCAB, length=50), VOCAB, 4)
    for i, draft in enumerate(drafts, start=1):
        if any(d % 2 for d in drafts[:i]):
            assert torch.equal(masks[i], masks[i - 1])
        assert bool(constraint.allowed(masks[i - 1])[draft]) == (draft % 2 == 0)
    assert matcher.rollbacks and all(n <= 3 for n in matcher.rollbacks)
    session.close()


def test_a_first_token_the_grammar_rejects_fails_clearly(tmp_path):
    engine, gen = _engine(tmp_path, num_mtp=3)
    with pytest.raises(EngineError, match="first token 11 .*does not follow the request's grammar"):
        engine.start(_received(8, 4), _handoff(8, first=11),
                     SamplingParams(max_tokens=40, temperature=0.0, grammar=FakeMatcher(VOCAB, length=5)))
    engine.start(_received(8, 4), _handoff(8, first=10), SamplingParams(max_tokens=4)).close()  # slot free again


def test_no_bitmask_interface_means_no_structured_output(tmp_path, monkeypatch):
    monkeypatch.delattr(FakeDecodeLayer, "update_grammar_bitmask")
    engine, _ = _engine(tmp_path)
    assert not engine.capabilities.features.structured_output
