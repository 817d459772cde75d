"""vLLM's ``thinking_token_budget`` on the decode server (decode_server/engine/grammar.ThinkingBudget):
once the reasoning holds the budget's tokens, ``</think>`` is the only token allowed; the
reasoning opens at a ``<think>`` the model emits or from the start when the prompt ended with
one; the mask rows of MTP drafts and rollbacks follow it; with a grammar it wraps the grammar's
matcher. The real stack against vLLM alone: tests/e2e/agents/test_tools.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from decode_server.engine.grammar import Constraint, ThinkingBudget, ThinkingBudgetSpec
from decode_server.engine.structured import GrammarCompiler
from pd_grammar.spec import SchemaLimits, grammar_spec

EOS = 0


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path):
    compiler = GrammarCompiler(tiny_model_dir, whitespace="compact")
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in ("</think>", "<think>", "<tool_call>")}
    return compiler, tok, ids, tok.get_vocab_size()


def _allowed(constraint: Constraint, row) -> set[int]:
    return set(torch.nonzero(constraint.allowed(row)).flatten().tolist())


def test_the_end_is_forced_after_the_budgets_tokens(setup):
    compiler, tok, ids, vocab = setup
    matcher = compiler.matcher(None, [EOS], ThinkingBudgetSpec(3, last_prompt_token_id=5))
    assert isinstance(matcher, ThinkingBudget) and matcher.inner is None
    constraint = Constraint(matcher, vocab, 1)
    words = tok.encode("a b c d e").ids
    constraint.accept_first(words[0])  # before any <think>: nothing counted, nothing masked
    assert len(_allowed(constraint, constraint.step_masks([])[0])) == vocab
    constraint.accept(ids["<think>"])
    for t in words[:3]:
        assert len(_allowed(constraint, constraint.step_masks([])[0])) == vocab
        constraint.accept(t)
    assert _allowed(constraint, constraint.step_masks([])[0]) == {ids["</think>"]}  # 3 reasoning tokens: the end
    with pytest.raises(Exception, match="against the request's grammar"):
        constraint.accept(words[3])
    constraint.accept(ids["</think>"])
    assert len(_allowed(constraint, constraint.step_masks([])[0])) == vocab  # the reasoning ended
    constraint.accept(ids["<think>"])  # a second reasoning block gets the budget again, as in vLLM
    for t in words[:3]:
        constraint.accept(t)
    assert _allowed(constraint, constraint.step_masks([])[0]) == {ids["</think>"]}


def test_a_prompt_ending_with_think_opens_the_reasoning(setup):
    compiler, tok, ids, vocab = setup
    matcher = compiler.matcher(None, [EOS], ThinkingBudgetSpec(1, last_prompt_token_id=ids["<think>"]))
    constraint = Constraint(matcher, vocab, 1)
    constraint.accept_first(tok.encode("a").ids[0])
    assert _allowed(constraint, constraint.step_masks([])[0]) == {ids["</think>"]}
    zero = Constraint(compiler.matcher(None, [EOS], ThinkingBudgetSpec(0, ids["<think>"])), vocab, 1)
    with pytest.raises(Exception, match="does not follow"):
        zero.accept_first(tok.encode("a").ids[0])  # budget 0: the first token is the end (prefill forced it)


def test_mtp_rows_and_rollbacks_follow_the_budget(setup):
    compiler, tok, ids, vocab = setup
    matcher = compiler.matcher(None, [EOS], ThinkingBudgetSpec(2, ids["<think>"]))
    constraint = Constraint(matcher, vocab, 4)
    a, b, c = tok.encode("a b c").ids[:3]
    constraint.accept_first(a)
    rows = constraint.step_masks([b, c, ids["</think>"]])  # b is the 2nd reasoning token: then the end only
    assert len(_allowed(constraint, rows[0])) == vocab
    assert _allowed(constraint, rows[1]) == {ids["</think>"]}
    assert _allowed(constraint, rows[2]) == {ids["</think>"]}  # c rejected: the last valid row repeats
    assert len(_allowed(constraint, constraint.step_masks([])[0])) == vocab  # rolled back to after a
    constraint.accept(b)
    constraint.accept(ids["</think>"])
    assert len(_allowed(constraint, constraint.step_masks([])[0])) == vocab  # ended: nothing masked


def test_with_a_forced_call_the_budget_ends_the_reasoning_and_the_call_follows(setup):
    compiler, tok, ids, vocab = setup
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    spec = grammar_spec({"tools": tools, "tool_choice": "required"}, SchemaLimits(), chat=True)
    assert spec is not None
    matcher = compiler.matcher(spec.model_copy(update={"after_reasoning": True}), [EOS],
                               ThinkingBudgetSpec(1, ids["<think>"]))
    constraint = Constraint(matcher, vocab, 1)
    constraint.accept_first(tok.encode("a").ids[0])
    assert _allowed(constraint, constraint.step_masks([])[0]) == {ids["</think>"]}
    constraint.accept(ids["</think>"])
    after = _allowed(constraint, constraint.step_masks([])[0])
    assert ids["<tool_call>"] in after and len(after) < vocab // 2  # the grammar's, after the reasoning


@pytest.mark.parametrize("end", [11, 31, 63, 64])
def test_the_forced_rows_bit_is_the_end_tokens_whatever_its_place_in_a_word(end):
    """xgrammar's int32 words: bit 31 is the sign bit."""
    matcher = ThinkingBudget(None, 0, start=5, end=end, reasoning_open=True)
    constraint = Constraint(matcher, 100, 1)
    row = constraint.step_masks([])[0]
    assert torch.nonzero(constraint.allowed(row)).flatten().tolist() == [end]
