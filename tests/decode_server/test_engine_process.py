"""The engine in a process of its own (decode_server/engine/process.py, ``--engine-process``):
the reference engine there decodes exactly as on a thread of the server (greedy, sampled with a
seed, logprobs, MTP, structured output compiled in the child); a cancel, a failed start and a
failed load come back as the engine's errors; a child that dies fails its sequences and turns
the server's ``/ready`` to 503; and through the server, a stop string found on the loop ends
the child's steps and gives the slot back."""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from decode_server.engine.base import Cancelled, EngineError, SamplingParams
from decode_server.engine.build import EngineBuild
from decode_server.engine.grammar import Constraint
from decode_server.engine.process import GrammarRequests, ProcessEngine
from decode_server.engine.reference import ReferenceEngine
from decode_server.engine.structured import GrammarCompiler
from decode_server.reference import MlaMoeModel, load_model, prefill
from pd_grammar.spec import SchemaLimits, grammar_spec
from pd_wire.decode import CAPABILITIES_PATH
from tests.decode_server.conftest import start_server
from tests.decode_server.helpers import handoff, script_for
from tests.fakes.fake_engine import FakeEngine, FakeEngineConfig
from tests.reference.helpers import handoff_for, received
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["Once upon a time", "The decode server streams tokens"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> MlaMoeModel:
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, model: MlaMoeModel):
    """The same reference engine on this thread and in a process of its own."""
    build = EngineBuild("reference", tiny_model_dir, slots=2, max_seq_len=256, num_mtp=1)
    child = ProcessEngine(build, (tiny_model_dir, "compact"))
    here = ReferenceEngine(tiny_model_dir, slots=2, max_seq_len=256, num_mtp=1, model=model)
    try:
        yield here, child
    finally:
        child.shutdown()
        here.shutdown()


def _decode(engine, model: MlaMoeModel, ids: list[int], params: SamplingParams, first: int | None = None):
    out = prefill(model, ids)
    first = int(out.logits.argmax()) if first is None else first
    session = engine.start(received("h", out.kv), handoff_for(ids, first), params)
    tokens = []
    try:
        while len(tokens) + 1 < params.max_tokens:
            tokens += session.step()
    finally:
        session.close()
    return tokens[:params.max_tokens - 1], (session.stats.drafted, session.stats.accepted)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("sampling", [dict(temperature=0.0, logprobs=2), dict(temperature=0.8, seed=7, top_k=20)])
def test_the_engine_in_its_process_decodes_as_on_a_thread(engines, model, tiny_model_dir, prompt, sampling):
    here, child = engines
    ids = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(prompt).ids
    params = SamplingParams(max_tokens=24, **sampling)
    expected, expected_mtp = _decode(here, model, ids, params)
    got, mtp = _decode(child, model, ids, params)
    assert got == expected  # token ids, logprobs and top logprobs
    assert mtp == expected_mtp and mtp[0] > 0  # MTP ran: the same drafts, the same accepted


def test_structured_output_is_compiled_and_masked_in_the_child(engines, model, tiny_model_dir):
    here, child = engines
    spec = grammar_spec({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
                        SchemaLimits(), chat=False)
    assert spec is not None
    ids = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode("hello").ids
    compiler = GrammarCompiler(tiny_model_dir, "compact")
    constraint = Constraint(compiler.matcher(spec, [0]), model.cfg.vocab_size, 1)  # prefill's first token
    first = int(constraint.constrain(prefill(model, ids).logits.float(), constraint.step_masks([])[0]).argmax())
    params = SamplingParams(max_tokens=40, temperature=0.0)
    expected, _ = _decode(here, model, ids, SamplingParams(max_tokens=40, temperature=0.0,
                                                           grammar=compiler.matcher(spec, [0])), first)
    got, _ = _decode(child, model, ids, SamplingParams(max_tokens=40, temperature=0.0,
                                                       grammar=GrammarRequests().matcher(spec, [0])), first)
    unconstrained, _ = _decode(here, model, ids, params, first)
    assert got == expected != unconstrained  # the mask applied, in the child as here


def test_a_cancel_and_a_failed_start_come_back_and_the_engine_goes_on(engines, model, tiny_model_dir):
    _, child = engines
    ids = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(PROMPTS[1]).ids
    out = prefill(model, ids)
    session = child.start(received("h", out.kv), handoff_for(ids, 5), SamplingParams(max_tokens=200))
    assert session.step()
    session.cancel()
    with pytest.raises(Cancelled):
        session.step()
    session.close()
    with pytest.raises(EngineError, match="received KV for 1 tokens"):  # the child's engine's own message
        child.start(received("h", [t[:1] for t in out.kv]), handoff_for(ids, 5), SamplingParams(max_tokens=8))
    tokens, _ = _decode(child, model, ids, SamplingParams(max_tokens=6, temperature=0.0))
    assert len(tokens) == 5
    assert child.failure() is None


def test_an_engine_that_cannot_load_fails_the_start_with_its_reason(tmp_path):
    with pytest.raises(EngineError, match="could not load its engine"):
        ProcessEngine(EngineBuild("reference", tmp_path / "missing", slots=1, max_seq_len=64, num_mtp=0))


def test_a_dead_engine_process_fails_its_sequence_and_the_server_turns_unready(model_dir: Path):
    engine = ProcessEngine(functools.partial(FakeEngine, FakeEngineConfig(step_delay=0.005)))
    srv, server, thread = start_server(model_dir, FakeEngineConfig(), slots=1, engine=engine)
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=30, json={
                "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True,
                "kv_transfer_params": handoff(5)}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # decoding
            os.kill(engine.pid, signal.SIGKILL)
            rest = "\n".join(lines)
        assert "the engine process exited" in rest and "[DONE]" in rest
        ready = httpx.get(srv.url + "/ready")
        assert ready.status_code == 503 and "the engine process exited" in ready.text
        busy = httpx.post(srv.url + "/v1/completions", timeout=30, json={
            "prompt": "x", "max_tokens": 4, "kv_transfer_params": handoff(5)})
        assert busy.status_code >= 500 and "the engine process exited" in busy.text
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()


def test_a_stop_string_on_the_loop_ends_the_childs_steps_and_frees_the_slot(model_dir: Path, tokenizer):
    first, rest = script_for(tokenizer, "one two STOP three four five six seven eight nine", eos=False)
    cfg = FakeEngineConfig(script=rest, step_delay=0.002, slots=1)
    engine = ProcessEngine(functools.partial(FakeEngine, cfg))
    srv, server, thread = start_server(model_dir, cfg, slots=1, engine=engine)
    try:
        for _ in range(2):  # the second finds the slot free and the child's engine session closed
            r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
                "prompt": "x", "max_tokens": 200, "stop": ["STOP"], "kv_transfer_params": handoff(first)})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == "one two " and choice["finish_reason"] == "stop"
            # the slot comes back just after the answer's last byte (the worker closes the session first)
            wait_until(lambda: httpx.get(srv.url + CAPABILITIES_PATH).json()["busy_slots"] == 0, 10, "a free slot")
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()
