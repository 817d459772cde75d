"""The reference engine decoding a conversation's next turn from the KV its slot kept (the
last turn's prompt and answer) plus the received rows past it: the same tokens, and the same
KV to decode from, as a session given the whole prompt's KV."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from connector.prefix import PREFIX_BLOCK_TOKENS, first_written
from decode_server.engine.base import EngineError, SamplingParams
from decode_server.engine.reference import ReferenceEngine
from decode_server.reference import MlaMoeModel, load_model, prefill
from tests.reference.helpers import handoff_for, received


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> MlaMoeModel:
    return load_model(tiny_model_dir)


def _greedy(engine: ReferenceEngine, kv, prompt: list[int], first: int, n: int) -> tuple[list[int], torch.Tensor, int]:
    """``n`` greedy tokens (prefill's first, then the engine's), the slot's KV rows of the prompt
    as the session started from them, and the rows the session leaves valid."""
    session = engine.start(kv, handoff_for(prompt, first), SamplingParams(max_tokens=n, temperature=0.0))
    rows = torch.stack([c[:len(prompt)].clone() for c in session._caches])
    out = [first]
    try:
        while len(out) < n:
            out += [t.token_id for t in session.step()]
    finally:
        kept = session.kept_tokens
        session.close()
    return out[:n], rows, kept


@pytest.mark.parametrize("num_mtp", [0, 1])
def test_the_next_turn_from_kept_kv_decodes_as_from_a_full_push(tiny_model_dir, model, num_mtp):
    reusing = ReferenceEngine(tiny_model_dir, model=model, num_mtp=num_mtp, slots=2)
    whole = ReferenceEngine(tiny_model_dir, model=model, num_mtp=num_mtp)
    turn = list(range(40, 190))  # 150 tokens
    out = prefill(model, turn)
    first = int(out.logits.argmax())
    answer, _, kept = _greedy(reusing, replace(received("a", out.kv), slot=1), turn, first, 40)
    assert kept >= len(turn) + len(answer) - 1 - num_mtp  # the prompt and the answer's run tokens

    nxt = turn + answer + list(range(300, 330))  # the next turn: the answer, then a tool result
    out2 = prefill(model, nxt)
    first2 = int(out2.logits.argmax())
    reused = min(kept, len(nxt) - 1) // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS
    assert reused == 128
    # the rows before ``reused`` do not come (an MTP layer's: one block fewer): the engine must
    # not read them from the receive buffer
    partial = [t.clone() for t in out2.kv]
    for i, t in enumerate(partial):
        t[:first_written(reused, i >= model.cfg.num_hidden_layers)] = float("nan")
    got, rows, _ = _greedy(reusing, replace(received("b", partial), slot=1, reused=reused), nxt, first2, 30)
    want, full_rows, _ = _greedy(whole, received("b", out2.kv), nxt, first2, 30)
    assert got == want
    assert not rows.isnan().any()
    # block by block: the pushed rows are the same bytes; the kept ones are the last turn's
    # prefill's (its prompt) and the engine's own (its answer), equal to a full push's to
    # float32 rounding
    assert torch.equal(rows[:, reused:], full_rows[:, reused:])
    for block in range(reused // PREFIX_BLOCK_TOKENS):
        span = slice(block * PREFIX_BLOCK_TOKENS, (block + 1) * PREFIX_BLOCK_TOKENS)
        assert torch.allclose(rows[:, span], full_rows[:, span], rtol=1e-4, atol=1e-4), block


def test_reuse_beyond_what_the_slot_keeps_is_refused(tiny_model_dir, model):
    engine = ReferenceEngine(tiny_model_dir, model=model, num_mtp=0)
    prompt = list(range(1, 100))
    out = prefill(model, prompt)
    with pytest.raises(EngineError, match="keeps KV for 0 tokens"):
        engine.start(replace(received("x", out.kv), reused=64), handoff_for(prompt, 5),
                     SamplingParams(max_tokens=4, temperature=0.0))
    assert engine.busy_slots == 0
