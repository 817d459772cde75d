"""Unit tests of the pure pieces: detokenizer, stop strings, sequence processor,
GLM parsing, request planning and settings."""

from __future__ import annotations

import pytest

from decode_server.engine.base import TokenOut
from decode_server.server import (
    GlmChatParser,
    IncrementalDetokenizer,
    SequenceProcessor,
    StopSpec,
    StopStringMatcher,
    TextTokenizer,
    parse_tool_call,
)
from decode_server.server.api_errors import InvalidRequest, KVHandoffFailed
from decode_server.server.request_plan import ServerLimits, build_plan, prefill_logprob
from decode_server.server.text import GenerationDefaults
from decode_server.settings import SettingsError, load_settings
from pd_grammar.tool_calls import MARKERS
from pd_wire.decode import EngineFeatures, SamplingDefaults
from pd_wire.handoff import HandoffResult
from pd_wire.requests import ChatCompletionRequest, CompletionRequest
from tests.decode_server.helpers import handoff


@pytest.fixture(scope="module")
def text_tok(model_dir):
    return TextTokenizer.from_model_dir(model_dir)


def test_detokenizer_holds_partial_characters(text_tok):
    text = "a 日本 🙂 wörld"
    ids = text_tok.tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(text_tok, [])
    deltas = [detok.feed(i) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some token completed no character on its own


def test_detokenizer_skips_special_tokens(text_tok):
    eos = text_tok.token_id("<|endoftext|>")
    ids = text_tok.tokenizer.encode("hello").ids
    detok = IncrementalDetokenizer(text_tok, [])
    assert "".join(detok.feed(i) for i in [*ids, eos, *ids]) == "hellohello"
    keep = IncrementalDetokenizer(text_tok, [], skip_special_tokens=False)
    assert "".join(keep.feed(i) for i in [*ids, eos]) == "hello<|endoftext|>"


@pytest.mark.parametrize("markers_special", [True, False], ids=["glm5.1-markers-special", "markers-plain"])
def test_detokenizer_keeps_only_the_parsers_special_tokens(model_dir, markers_special):
    """GLM's parser reads its markers and no other special token (vLLM's GLM parser drops them
    from reasoning and content): a role token inside a thinking block adds no text, whether the
    markers are special tokens (GLM-5.1's tokenizer, the tiny model's) or plain added ones."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|system|>", special=True)])
    if markers_special:
        tok.add_special_tokens([AddedToken(m, special=True) for m in ("<think>", "</think>")])
    text_tok = TextTokenizer(tok, frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special))
    assert (text_tok.special_id("<think>") is not None) == markers_special
    special = {name: text_tok.token_id(name) for name in ("<think>", "</think>", "<|assistant|>", "<|system|>")}
    ids = text_tok.tokenizer.encode("hi").ids
    stream = [special["<|assistant|>"], special["<think>"], *ids, special["<|assistant|>"], special["</think>"],
              *ids, special["<|system|>"]]
    detok = IncrementalDetokenizer(text_tok, [special["<|assistant|>"]], keep_special=frozenset(MARKERS))
    assert "".join(detok.feed(i) for i in stream) + detok.flush() == "<think>hi</think>hi"


@pytest.mark.parametrize("deltas,stops,expect,matched", [
    (["hel", "lo wo", "rld"], ["o w"], "hell", "o w"),
    (["ab", "c", "d"], ["cd", "bc"], "a", "bc"),  # the earliest match wins
    (["x", "ST", "O", "P!"], ["STOP"], "x", "STOP"),
    (["ST", "ART"], ["STOP"], "START", None),  # a prefix that did not complete is released
])
def test_stop_string_matcher(deltas, stops, expect, matched):
    m = StopStringMatcher(stops)
    out = "".join(m.feed(d) for d in deltas) + m.flush()
    assert out == expect and m.matched == matched


def test_stop_matcher_include_and_no_text_after_stop():
    m = StopStringMatcher(["END"], include_stop=True)
    assert m.feed("abcEN") == "abc"
    assert m.feed("Dxyz") == "END"
    assert m.feed("more") == "" and m.flush() == ""


def _proc(text_tok, **kw):
    spec = StopSpec(**{"max_tokens": 100, "eos_token_ids": frozenset({text_tok.token_id("<|endoftext|>")}), **kw})
    return SequenceProcessor(text_tok, spec, [])


def test_sequence_eos_min_tokens_and_drop_after_finish(text_tok):
    eos = text_tok.token_id("<|endoftext|>")
    ids = text_tok.tokenizer.encode("hello world").ids
    p = _proc(text_tok)
    d = p.feed([TokenOut(i) for i in [*ids, eos, *ids]])
    assert (d.text, d.finish_reason, p.num_generated) == ("hello world", "stop", len(ids) + 1)
    assert d.token_ids == [*ids, eos]
    p = _proc(text_tok, min_tokens=len(ids) + 2, max_tokens=len(ids) + 3)
    d = p.feed([TokenOut(i) for i in [*ids, eos, ids[0], ids[1]]])
    assert d.finish_reason == "length" and p.num_generated == len(ids) + 3


def test_sequence_max_tokens_flushes_held_stop_prefix(text_tok):
    ids = text_tok.tokenizer.encode("hello wo").ids
    p = _proc(text_tok, stop_strings=("world",), max_tokens=len(ids))
    d = p.feed([TokenOut(i) for i in ids])
    assert d.text == "hello wo" and d.finish_reason == "length"


def test_glm_parser_streaming_any_split():
    text = "plan</think>Hi <tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call> bye"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}}}]
    for size in (1, 2, 3, 7, len(text)):
        p = GlmChatParser(reasoning=True, tools=tools)
        pieces = [p.feed(text[i:i + size]) for i in range(0, len(text), size)] + [p.finish()]
        assert "".join(x.reasoning for x in pieces) == "plan"
        assert "".join(x.content for x in pieces) == "Hi  bye"
        calls = [c for x in pieces for c in x.tool_calls]
        assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]


def test_glm_parser_drops_invalid_calls_and_completes_a_cut_off_one():
    """As vLLM's GLM-4.7 parser (tests/decode_server/test_glm_vs_vllm.py compares them on
    generated streams): a call of no known tool is dropped, a cut-off call keeps the
    arguments completed so far."""
    tools = [{"type": "function", "function": {"name": "g", "parameters": {"properties": {"q": {"type": "string"}}}}}]
    p = GlmChatParser(reasoning=False, tools=tools)
    out = p.feed("x<tool_call>{not json}</tool_call>y<tool_call>nope</tool_call>z<tool_call>g<arg_key>q</arg_key>"
                 "<arg_value>v</arg_value><arg_key>r</arg_key><arg_value>cut")
    tail = p.finish()
    assert out.content + tail.content == "xyz"
    assert [(c.name, c.arguments) for c in out.tool_calls + tail.tool_calls] == [("g", '{"q": "v"}')]
    assert p.message_content() == "x"  # a whole message keeps the text before the first call
    assert parse_tool_call('{"name": "g", "arguments": {"q": "x"}}', {"g": {}}) is None  # not GLM's format


LIMITS = ServerLimits(max_seq_len=100, features=EngineFeatures(logprobs=True), engine="fake", model_name="m")


def _plan(kind, **body):
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    req = model.model_validate({"kv_transfer_params": handoff(5, num_prompt_tokens=10), **body})
    return build_plan(kind, req, "r", LIMITS, GenerationDefaults(eos_token_ids=frozenset({9}),
                                                                 sampling=SamplingDefaults(temperature=0.7)))


def test_plan_defaults_and_limits():
    p = _plan("chat")
    assert p.sampling.max_tokens == 90 and p.sampling.temperature == 0.7 and p.stop.eos_token_ids == {9}
    assert _plan("completions").sampling.max_tokens == 16  # the OpenAI completions default
    assert _plan("chat", max_tokens=5, max_completion_tokens=7).sampling.max_tokens == 7
    with pytest.raises(InvalidRequest, match="maximum context length"):
        _plan("chat", max_tokens=91)
    with pytest.raises(KVHandoffFailed):
        _plan("completions", kv_transfer_params=handoff(5, status="failed"))
    with pytest.raises(InvalidRequest, match="protocol_version"):
        _plan("completions", kv_transfer_params=handoff(5, protocol_version=99))


def test_prefill_logprob_both_shapes():
    comp = {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [{"a": -1.0, "b": -2.0, "c": -0.5}]}
    lp = prefill_logprob(comp, 2)
    assert lp.token == "a" and lp.logprob == -1.0 and lp.top == (("c", -0.5), ("a", -1.0))
    chat = {"content": [{"token": "a", "logprob": -1.0, "top_logprobs": [{"token": "a", "logprob": -1.0}]}]}
    assert prefill_logprob(chat, 1).top == (("a", -1.0),)
    with pytest.raises(InvalidRequest):
        prefill_logprob({"content": [{}]}, 1)


def test_handoff_result_round_trip():
    h = HandoffResult.model_validate(handoff(3, remote_prefill_cached_tokens=0))
    assert h.first_token_id == 3


@pytest.mark.parametrize(("flag", "asked"), [((), None), (("--no-attention-kernel",), False)])
def test_the_attention_kernel_flag_reaches_the_engine(model_dir, monkeypatch, flag, asked):
    """On by default as "where it applies" (None: a bf16 model or no numba keeps the products,
    never a failed start); --no-attention-kernel asks for the products."""
    import decode_server.engine.reference as reference
    from decode_server.__main__ import engine_factory

    seen = {}
    monkeypatch.setattr(reference, "ReferenceEngine", lambda *a, **kw: seen.update(kw))
    engine_factory(load_settings(["--engine", "reference", "--model", str(model_dir), "--no-engine-process", *flag],
                                 env={}))()
    assert seen["attention_kernel"] is asked


@pytest.mark.parametrize(("flag", "in_process"), [((), False), (("--engine-process",), True)])
def test_the_engine_runs_in_a_process_of_its_own_with_the_flag(model_dir, flag, in_process):
    """The same engine build either way (the child builds it), the placement from the flag."""
    import functools

    from decode_server.__main__ import engine_factory
    from decode_server.engine.build import EngineBuild
    from decode_server.engine.process import ProcessEngine

    factory = engine_factory(load_settings(["--engine", "reference", "--model", str(model_dir), "--no-attention-kernel",
                                            *flag], env={}))
    if in_process:
        assert isinstance(factory, functools.partial) and factory.func is ProcessEngine
        factory = factory.args[0]
    assert factory == EngineBuild("reference", model_dir, slots=1, max_seq_len=4096, num_mtp=1, attention_kernel=False)


def test_settings_cli_env_and_errors(model_dir, tmp_path):
    s = load_settings(["--engine", "reference", "--model", str(model_dir), "--slots", "3"],
                      env={"PD_DECODE_KV_TIMEOUT": "12.5", "PD_DECODE_SLOTS": "9"})
    assert (s.slots, s.kv_timeout, s.model_name) == (3, 12.5, "fake-model")
    assert s.attention_kernel  # on where it applies (docs/reference_engine.md)
    assert not load_settings(["--engine", "reference", "--model", str(model_dir), "--no-attention-kernel"],
                             env={}).attention_kernel
    with pytest.raises(SettingsError, match=r"^--port='0': Input should be greater than or equal to 1$"):
        load_settings(["--engine", "reference", "--model", str(model_dir), "--port", "0"], env={})
    with pytest.raises(SettingsError, match=r"^--model='.*nope': '.*nope' is not a directory$"):
        load_settings(["--engine", "reference", "--model", str(tmp_path / "nope")], env={})
    with pytest.raises(SettingsError, match=r"--num-mtp / PD_DECODE_NUM_MTP=1: TileRT's GLM-5 MTP drafts 3"):
        load_settings(["--engine", "tilert", "--model", str(model_dir)], env={})
    s = load_settings(["--engine", "tilert", "--model", str(model_dir), "--num-mtp", "3", "--slots", "4"], env={})
    assert s.effective_slots == 1
    with pytest.raises(SettingsError, match="--engine='vllm': Input should be 'reference' or 'tilert'"):
        load_settings(["--engine", "vllm", "--model", str(model_dir)], env={})


def test_settings_from_a_config_file_under_env_and_command_line(model_dir, tmp_path):
    config = tmp_path / "decode.yaml"
    config.write_text(f"engine: reference\nmodel: {model_dir}\nslots: 5\nkv_timeout: 7\nport: 8300\n")
    s = load_settings(["--config", str(config), "--port", "8400"], env={"PD_DECODE_SLOTS": "6"})
    assert (s.engine, s.model, s.slots, s.kv_timeout, s.port) == ("reference", model_dir.resolve(), 6, 7.0, 8400)
    s = load_settings([], env={"PD_DECODE_CONFIG": str(config)})
    assert (s.slots, s.port) == (5, 8300)
    config.write_text("engine: reference\nslot: 5\n")
    with pytest.raises(SettingsError) as info:
        load_settings(["--config", str(config)], env={})
    assert f"{config}: slot=5: unknown option" in str(info.value)
    assert "--model / PD_DECODE_MODEL=<unset>: Field required" in str(info.value)
    with pytest.raises(SettingsError, match="no such file"):
        load_settings(["--config", str(tmp_path / "absent.yaml")], env={})


def test_infinite_logprobs_are_clamped(text_tok):
    spec = StopSpec(max_tokens=5)
    p = SequenceProcessor(text_tok, spec, [], logprobs=1)
    d = p.feed([TokenOut(7, float("-inf"), ((7, float("-inf")),))])
    assert d.logprobs[0].logprob == -9999.0 and d.logprobs[0].top[0][1] == -9999.0
