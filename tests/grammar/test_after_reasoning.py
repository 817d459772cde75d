"""A grammar after the reasoning (decode_server/engine/grammar.AfterReasoning), as vLLM holds a
request's grammar with a reasoning parser: free until ``</think>`` (the grammar starts after it)
or a ``<tool_call>`` (which ends the reasoning and is the grammar's first token); rollbacks
across the start undo it; MTP rows past a draft that ends the reasoning are the grammar's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from decode_server.engine.grammar import AfterReasoning, Constraint
from decode_server.engine.structured import GrammarCompiler
from pd_grammar.spec import SchemaLimits, grammar_spec

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
EOS = 0


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path):
    compiler = GrammarCompiler(tiny_model_dir, whitespace="compact")
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    spec = grammar_spec({"tools": TOOLS, "tool_choice": "required"}, SchemaLimits(), chat=True)
    assert spec is not None
    ids = {t: tok.token_to_id(t) for t in ("</think>", "<tool_call>", "<think>")}
    return compiler, tok, spec.model_copy(update={"after_reasoning": True}), ids, tok.get_vocab_size()


def _allowed(constraint: Constraint, row) -> set[int]:
    return set(torch.nonzero(constraint.allowed(row)).flatten().tolist())


def test_free_until_the_reasoning_ends(setup):
    compiler, tok, spec, ids, vocab = setup
    matcher = compiler.matcher(spec, [EOS])
    assert isinstance(matcher, AfterReasoning)
    constraint = Constraint(matcher, vocab, 3)
    words = tok.encode("Let me think").ids
    for t in words:
        constraint.accept_first(t) if t == words[0] else constraint.accept(t)
        assert len(_allowed(constraint, constraint.step_masks([])[0])) == vocab  # reasoning: nothing masked
    constraint.accept(ids["</think>"])
    after = _allowed(constraint, constraint.step_masks([])[0])
    assert ids["<tool_call>"] in after and len(after) < vocab // 2  # required: a call, nothing else
    with pytest.raises(Exception, match="against the request's grammar"):
        constraint.accept(words[0])


def test_a_tool_call_ends_the_reasoning_and_begins_the_grammar(setup):
    compiler, tok, spec, ids, vocab = setup
    matcher = compiler.matcher(spec, [EOS])
    constraint = Constraint(matcher, vocab, 3)
    constraint.accept_first(tok.encode("Hmm").ids[0])
    constraint.accept(ids["<tool_call>"])
    assert not matcher.waiting
    after = _allowed(constraint, constraint.step_masks([])[0])
    name = tok.encode("get_weather").ids[0]
    assert name in after and ids["</think>"] not in after
    matcher.rollback(1)  # the <tool_call> undone: reasoning again
    assert matcher.waiting and len(_allowed(constraint, constraint.step_masks([])[0])) == vocab


def test_mtp_rows_follow_a_draft_that_ends_the_reasoning(setup):
    compiler, tok, spec, ids, vocab = setup
    matcher = compiler.matcher(spec, [EOS])
    constraint = Constraint(matcher, vocab, 3)
    constraint.accept_first(tok.encode("So").ids[0])
    word = tok.encode(" yes").ids[0]
    rows = constraint.step_masks([word, ids["</think>"]])
    assert len(_allowed(constraint, rows[0])) == vocab and len(_allowed(constraint, rows[1])) == vocab
    assert ids["<tool_call>"] in _allowed(constraint, rows[2]) and len(_allowed(constraint, rows[2])) < vocab // 2
    assert matcher.waiting  # the drafts were rolled back
    rows = constraint.step_masks([ids["<tool_call>"], word])
    assert len(_allowed(constraint, rows[0])) == vocab  # the <tool_call> itself is chosen freely, as vLLM
    assert word not in _allowed(constraint, rows[1])  # after it, the tool's name
    assert matcher.waiting
    constraint.accept(ids["</think>"])
    matcher.rollback(1)
    assert matcher.waiting
    with pytest.raises(Exception, match="past the grammar's start"):
        matcher.rollback(3)
