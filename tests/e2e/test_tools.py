"""Tool calling as agent frameworks send it (issue 52): a chat with ``tools`` and no
``tool_choice`` (OpenAI's default, "auto"), or ``"auto"`` itself, through the real stack,
against vLLM alone started as a GLM-5.1 user starts it (``--enable-auto-tool-choice
--tool-call-parser glm47 --reasoning-parser glm45``). The stack's decode server runs the same
parsers (``--reasoning-parser glm45``: this module's own stack; the session's runs none).

* served, streamed and not, with the prompt vLLM alone builds (the prompt's token ids, read
  from ``prompt_logprobs``), the same reasoning, content and finish reason;
* a generated tool call (forced by a regex in ``structured_outputs``: the tiny model calls no
  tool of its own) comes back in ``tool_calls`` exactly as vLLM's GLM-4.7 tool parser reads
  the same tokens, streamed and not, with ``finish_reason`` ``tool_calls``;
* ``parallel_tool_calls: false``: only the first call, as vLLM filters them;
* the OpenAI SDK's ``create(tools=...)`` and its streaming helper, end to end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from pd_deploy.stack.launcher import Stack
from tests.e2e.conftest import MODEL_NAME, make_stack_config, running_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GLM51_PARSER_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "glm47", "--reasoning-parser", "glm45")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}}}}
TOOLS = [WEATHER, TIME]
QUESTIONS = ["Weather in Paris?", "Hello!", "Tell me about the sea."]
CHOICES = {"no tool_choice": {}, "auto": {"tool_choice": "auto"}}
# a call of each tool, in GLM-4.7's format: the regex forces what the tiny model would not write
CALL_WEATHER = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>(Paris|Oslo)</arg_value>"
                "<arg_key>days</arg_key><arg_value>[1-7]</arg_value></tool_call>")
CALL_TIME = "<tool_call>get_time<arg_key>utc</arg_key><arg_value>(true|false)</arg_value></tool_call>"


@pytest.fixture(scope="module")
def glm_user_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = make_stack_config(tiny_model_dir, tmp_path_factory.mktemp("glm-user-stack"), reasoning_parser="glm45")
    with running_stack(cfg) as stack:
        yield stack


@pytest.fixture(scope="module")
def glm_user_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM alone with the stack's numerics and GLM-5.1's parser flags."""
    from pd_deploy.commands import VLLM_CPU_ENV, PrefillSpec, vllm_prefill_argv
    from tests.procs import free_port, server

    port = free_port()
    same_numerics = make_stack_config(tiny_model_dir, Path("/nonexistent")).prefill_extra_args()
    argv = vllm_prefill_argv(PrefillSpec(model=tiny_model_dir, port=port, mtp=False, connector=False,
                                         max_model_len=4096, served_model_name=MODEL_NAME,
                                         extra_args=same_numerics + GLM51_PARSER_FLAGS))
    url = f"http://127.0.0.1:{port}"
    with server(argv, tmp_path_factory.mktemp("glm-user-vllm") / "vllm.log", f"{url}/health", 300, VLLM_CPU_ENV):
        yield url


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _prompt_ids(answer: dict) -> list[int]:
    """The prompt's token ids, from ``prompt_logprobs: 0`` (each position's dict is keyed by its token)."""
    return [int(next(iter(entry))) for entry in answer["prompt_logprobs"][1:]]


def _reasoning(message: dict) -> str | None:
    """The message's reasoning: ``reasoning_content`` (ours), ``reasoning`` (vLLM 0.32's name)."""
    return message.get("reasoning_content") or message.get("reasoning") or None


@pytest.mark.parametrize("choice", sorted(CHOICES))
def test_tools_with_the_default_tool_choice_are_served_as_vllm_serves_them(glm_user_stack, glm_user_vllm, choice):
    """Failed before issue 52: vLLM's prefill refused the body, 400 '"auto" tool choice requires
    --enable-auto-tool-choice and --tool-call-parser to be set'."""
    answers = {}
    for name, url in (("pd", glm_user_stack.config.router_url), ("vllm", glm_user_vllm)):
        for question in QUESTIONS:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": question}], "tools": TOOLS,
                    "max_tokens": 30, "temperature": 0, "prompt_logprobs": 0, **CHOICES[choice]}
            resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            assert resp.status_code == 200, (name, resp.text)
            answer = resp.json()
            message, finish = answer["choices"][0]["message"], answer["choices"][0]["finish_reason"]
            answers[name, question] = (_prompt_ids(answer), answer["usage"]["prompt_tokens"], _reasoning(message),
                                       message["content"], message.get("tool_calls") or None, finish)
    for question in QUESTIONS:
        print(f"\n{question!r}: {answers['pd', question][2:]!r}")
        assert answers["pd", question] == answers["vllm", question], question
        assert answers["pd", question][1] == len(answers["pd", question][0]) + 1  # + the first, without logprobs


@pytest.mark.parametrize("choice", sorted(CHOICES))
def test_tools_streamed_with_the_default_tool_choice(glm_user_stack, glm_user_vllm, choice):
    streamed = {}
    for name, url in (("pd", glm_user_stack.config.router_url), ("vllm", glm_user_vllm)):
        stream = _client(url).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": QUESTIONS[1]}], tools=TOOLS, max_tokens=30,
            temperature=0, stream=True, **CHOICES[choice])
        content, reasoning, finish = "", "", None
        for chunk in stream:
            for c in chunk.choices:
                content += c.delta.content or ""
                extra = c.delta.model_extra or {}
                reasoning += extra.get("reasoning_content") or extra.get("reasoning") or ""
                finish = c.finish_reason or finish
        streamed[name] = (reasoning, content, finish)
    assert streamed["pd"] == streamed["vllm"]
    # (whether the tiny model closes its reasoning within 30 tokens depends on the host it was trained on)
    assert (streamed["pd"][0] or streamed["pd"][1]) and streamed["pd"][2] in ("stop", "length")


def _vllm_parse(tokenizer, text: str, tools: list[dict]) -> list[tuple[str, dict]]:
    """What vLLM's GLM-4.7 tool parser reads in ``text`` (the tokens a generation gave)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.glm47_moe_tool_parser import Glm47MoeModelToolParser

    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools)
    info = Glm47MoeModelToolParser(tokenizer, request.tools).extract_tool_calls(text, request)
    return [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]


def _forced(regex: str, **extra) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": QUESTIONS[0]}], "tools": TOOLS,
            "max_tokens": 200, "temperature": 0, "structured_outputs": {"regex": regex}, **extra}


@pytest.mark.parametrize("choice", sorted(CHOICES))
def test_a_generated_tool_call_is_parsed_as_vllms_parser_reads_it(glm_user_stack, tokenizer, choice):
    url = glm_user_stack.config.router_url
    body = _forced(CALL_WEATHER + "(\n)?" + CALL_TIME, logprobs=True, return_tokens_as_token_ids=True,
                   **CHOICES[choice])
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    choice_ = answer["choices"][0]
    ids = [int(t["token"].split(":", 1)[1]) for t in choice_["logprobs"]["content"]]
    raw = tokenizer.decode(ids, skip_special_tokens=False)
    ours = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice_["message"]["tool_calls"]]
    print(f"\n{raw!r}: {ours}")
    assert [name for name, _ in ours] == ["get_weather", "get_time"]
    assert ours == _vllm_parse(tokenizer, raw, TOOLS)
    assert choice_["finish_reason"] == "tool_calls" and choice_["message"]["content"] is None
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in choice_["message"]["tool_calls"])
    # streamed: the same calls, their deltas indexed by call
    calls, finish = _streamed_calls(url, {**body, "stream": True})
    assert calls == ours and finish == "tool_calls"


def _streamed_calls(url: str, body: dict) -> tuple[list[tuple[str, dict]], str | None]:
    """The tool calls of a streamed chat answer, put together from their deltas by index."""
    calls: dict[int, list[str]] = {}
    finish = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                finish = c.get("finish_reason") or finish
                for tc in c["delta"].get("tool_calls") or []:
                    name_args = calls.setdefault(tc["index"], ["", ""])
                    name_args[0] += tc["function"].get("name") or ""
                    name_args[1] += tc["function"].get("arguments") or ""
    return [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())], finish


def test_parallel_tool_calls_false_returns_the_first_call_only(glm_user_stack):
    """As vLLM honours it: the calls after the first are left out of the answer, streamed and not."""
    url = glm_user_stack.config.router_url
    body = _forced(CALL_WEATHER + CALL_TIME, parallel_tool_calls=False)
    message = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    calls, finish = _streamed_calls(url, {**body, "stream": True})
    assert [name for name, _ in calls] == ["get_weather"] and finish == "tool_calls"
    both = httpx.post(f"{url}/v1/chat/completions", json={**body, "parallel_tool_calls": True}, timeout=120).json()
    assert [c["function"]["name"] for c in both["choices"][0]["message"]["tool_calls"]] == ["get_weather", "get_time"]


def test_the_openai_sdks_tool_calling_and_streaming_helper(glm_user_stack):
    """What an agent framework does: ``create(tools=...)`` (no tool_choice), and the SDK's
    ``chat.completions.stream`` helper (which takes strict tools only), whose final message
    carries the parsed calls."""
    client = _client(glm_user_stack.config.router_url)
    strict_time = {"type": "function", "function": {**TIME["function"], "strict": True, "parameters": {
        **TIME["function"]["parameters"], "required": ["utc"], "additionalProperties": False}}}
    plain = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello!"}],
                                           tools=TOOLS, max_tokens=30, temperature=0)
    said = plain.choices[0].message.content or (plain.choices[0].message.model_extra or {}).get("reasoning_content")
    assert plain.choices[0].finish_reason in ("stop", "length") and said
    assert plain.choices[0].message.tool_calls is None
    created = client.chat.completions.create(**{k: v for k, v in _forced(CALL_TIME).items()
                                                if k != "structured_outputs"},
                                             extra_body={"structured_outputs": {"regex": CALL_TIME}})
    call = created.choices[0].message.tool_calls[0]
    assert created.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    with client.chat.completions.stream(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                        tools=[strict_time], max_tokens=200, temperature=0,
                                        extra_body={"structured_outputs": {"regex": CALL_TIME}}) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    streamed_call = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls" and streamed_call.function.name == "get_time"
    assert streamed_call.function.parsed_arguments == json.loads(streamed_call.function.arguments)
    assert isinstance(streamed_call.function.parsed_arguments["utc"], bool)
