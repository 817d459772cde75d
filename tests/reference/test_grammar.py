"""Structured output in the reference engine on the tiny model, with the grammar compiled by
the decode server's compiler (xgrammar over the model's tokenizer): every emitted token
follows the grammar (replayed through a fresh matcher), MTP under the grammar equals plain
decoding under it (a draft the mask rejects is only a rejected draft), sampling stays in
the grammar, and a first token the grammar rejects fails the start with the slot given back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from decode_server.engine.base import EngineError, SamplingParams
from decode_server.engine.grammar import Constraint
from decode_server.engine.reference import ReferenceEngine
from decode_server.engine.structured import GrammarCompiler
from decode_server.reference import MlaMoeModel, load_model, prefill
from pd_grammar.spec import SchemaLimits, grammar_spec
from tests.reference.helpers import handoff_for, received

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                                            "n": {"type": "integer"}},
          "required": ["name", "tags", "n"], "additionalProperties": False}
FORMATS = {"json_object": {"type": "json_object"},
           "schema": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}
EOS = 0  # any stop token: the grammar allows it once complete


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> MlaMoeModel:
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tiny_model_dir: Path) -> GrammarCompiler:
    return GrammarCompiler(tiny_model_dir, whitespace="compact")  # as the local stack


def _spec(name: str):
    spec = grammar_spec({"response_format": FORMATS[name]}, SchemaLimits(), chat=False)
    assert spec is not None
    return spec


def _first_token(logits: torch.Tensor, matcher, vocab: int, sample: torch.Generator | None = None) -> int:
    """What vLLM does for the first token: the masked argmax (or a sample from the masked softmax)."""
    constraint = Constraint(matcher, vocab, 1)
    row = constraint.constrain(logits.float(), constraint.step_masks([])[0])
    if sample is None:
        return int(row.argmax())
    return int(torch.multinomial(row.softmax(-1), 1, generator=sample))


def _decode(engine: ReferenceEngine, model, compiler, tokenizer, name: str, n: int, prompt: str,
            temperature: float = 0.0, seed: int | None = None) -> tuple[list[int], object]:
    ids = tokenizer.encode(prompt).ids
    out = prefill(model, ids)
    vocab = model.cfg.vocab_size
    sample = torch.Generator().manual_seed(seed) if seed is not None else None
    first = _first_token(out.logits, compiler.matcher(_spec(name), [EOS]), vocab, sample)
    params = SamplingParams(max_tokens=n, temperature=temperature, seed=seed,
                            grammar=compiler.matcher(_spec(name), [EOS]))
    session = engine.start(received("h", out.kv), handoff_for(ids, first), params)
    tokens = [first]
    try:
        while len(tokens) < n and EOS not in tokens:
            tokens += [t.token_id for t in session.step()]
    finally:
        session.close()
    return tokens[:n], session.stats


def _follows(compiler, name: str, tokens: list[int]) -> bool:
    replay = compiler.matcher(_spec(name), [EOS])
    for t in tokens:
        if replay.is_terminated():
            return False
        if not replay.accept_token(t):
            return False
    return True


PROMPTS = ["A JSON record:", "[gMASK]<sop><|user|>\nDescribe heapq as JSON.<|assistant|>\n"]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_greedy_under_the_grammar_with_and_without_mtp(tiny_model_dir, model, compiler, name):
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    plain = ReferenceEngine(tiny_model_dir, model=model, num_mtp=0)
    mtp = ReferenceEngine(tiny_model_dir, model=model, num_mtp=1)
    drafted = 0
    for prompt in PROMPTS:
        a, _ = _decode(plain, model, compiler, tokenizer, name, 40, prompt)
        b, stats = _decode(mtp, model, compiler, tokenizer, name, 40, prompt)
        print(f"\n{name}: {tokenizer.decode(a)!r}")
        assert a == b
        assert _follows(compiler, name, a)
        drafted += stats.drafted
    assert drafted > 0


def test_sampling_stays_in_the_grammar(tiny_model_dir, model, compiler):
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    engine = ReferenceEngine(tiny_model_dir, model=model, num_mtp=1)
    for seed in range(6):
        tokens, _ = _decode(engine, model, compiler, tokenizer, "schema", 40, PROMPTS[seed % 2], 1.0, seed)
        assert _follows(compiler, "schema", tokens), tokenizer.decode(tokens)


def test_first_token_against_the_grammar_fails_and_frees_the_slot(tiny_model_dir, model, compiler):
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    engine = ReferenceEngine(tiny_model_dir, model=model, num_mtp=1, slots=1)
    ids = tokenizer.encode(PROMPTS[0]).ids
    out = prefill(model, ids)
    not_json = tokenizer.encode("hello").ids[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, grammar=compiler.matcher(_spec("schema"), [EOS]))
    with pytest.raises(EngineError, match="does not follow the request's grammar"):
        engine.start(received("h", out.kv), handoff_for(ids, not_json), params)
    assert engine.busy_slots == 0


def test_the_grammar_holds_with_logit_bias_and_penalties(tiny_model_dir, model, compiler):
    """logit_bias makes the engine choose the first token itself (prefill cannot apply it under
    MTP): the grammar's mask applies to that choice too, and to every position after the
    penalties; a bias towards a token the grammar forbids at the start does not get it chosen
    there, and MTP still equals plain decoding."""
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    ids = tokenizer.encode(PROMPTS[1]).ids
    out = prefill(model, ids)
    forbidden = tokenizer.encode("hello").ids[0]
    prefill_first = _first_token(out.logits, compiler.matcher(_spec("schema"), [EOS]), model.cfg.vocab_size)
    runs = []
    for num_mtp in (0, 1):
        engine = ReferenceEngine(tiny_model_dir, model=model, num_mtp=num_mtp)
        params = SamplingParams(max_tokens=40, temperature=0.0, logit_bias=((forbidden, 100.0),),
                                frequency_penalty=0.5, grammar=compiler.matcher(_spec("schema"), [EOS]))
        session = engine.start(received("h", out.kv), handoff_for(ids, prefill_first), params)
        try:
            assert session.first_token is not None  # chosen here, under the mask and the bias
            tokens = [session.first_token.token_id]
            while len(tokens) < 40 and EOS not in tokens:
                tokens += [t.token_id for t in session.step()]
        finally:
            session.close()
        # the bias would make "hell" the first token (JSON must open with "{"); inside a string it may appear
        assert tokens[0] != forbidden and _follows(compiler, "schema", tokens[:40]), tokenizer.decode(tokens)
        runs.append(tokens[:40])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("cut", [2, 7])
def test_a_sequence_resumed_under_its_grammar_goes_on_as_uninterrupted(tiny_model_dir, model, compiler, cut):
    """A sampled JSON answer cut after ``cut`` tokens, prefilled again with them and resumed
    (``resumed_from``: the grammar advanced over them, the token at the cut drawn here) gives
    the rest of the uninterrupted answer, and the whole follows the grammar."""
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    engine = ReferenceEngine(tiny_model_dir, model=model, num_mtp=1)
    ids = tokenizer.encode(PROMPTS[1]).ids

    def run(prompt_ids: list[int], resumed_from: tuple[int, ...], n: int) -> list[int]:
        params = SamplingParams(max_tokens=n, temperature=1.0, seed=21, logit_bias=((EOS, 0.0),),
                                resumed_from=resumed_from, grammar=compiler.matcher(_spec("schema"), [EOS]))
        out = prefill(model, prompt_ids)
        session = engine.start(received("h", out.kv), handoff_for(prompt_ids, int(out.logits.argmax())), params)
        try:
            tokens = [session.first_token.token_id]
            while len(tokens) < n and EOS not in tokens:
                tokens += [t.token_id for t in session.step()]
        finally:
            session.close()
        return tokens[:n]

    whole = run(ids, (), 30)
    assert _follows(compiler, "schema", whole) and len(whole) > cut + 5, tokenizer.decode(whole)
    assert run(ids + whole[:cut], tuple(whole[:cut]), 30 - cut) == whole[cut:]
