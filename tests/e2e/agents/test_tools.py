"""Tool calling as agent frameworks send it (issues 52, 59), through the real stack, against
vLLM alone started as a GLM-5.1 user starts it (``--enable-auto-tool-choice --tool-call-parser
glm47 --reasoning-parser glm45``, its GLM-4.7 tool-call structural tags on). The stack's decode
server and prefill run the same parsers (``--reasoning-parser glm45``: this module's own stack;
the session's runs none).

* ``tools`` with no ``tool_choice`` (OpenAI's default, "auto") or ``"auto"``: served, streamed
  and not, with the prompt vLLM alone builds (the prompt's token ids, read from
  ``prompt_logprobs``), the same reasoning, content and finish reason;
* a named function and ``required``: the same call (vLLM's call grammar once the reasoning
  ended), a call cut by ``max_tokens`` included, the same finish reason and usage;
* a generated tool call (written by a regex in ``structured_outputs``: the tiny model calls no
  tool of its own) comes back in ``tool_calls`` exactly as vLLM's GLM-4.7 tool parser reads
  the same tokens, streamed and not, with ``finish_reason`` ``tool_calls``;
* ``parallel_tool_calls: false``: only the first call, as vLLM filters them;
* the OpenAI SDK's ``create(tools=...)`` and its streaming helper, end to end;
* ``/v1/responses`` with function tools and the SDK's ``responses`` calls."""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

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


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _prompt_ids(answer: dict) -> list[int]:
    """The prompt's token ids, from ``prompt_logprobs: 0`` (each position's dict is keyed by its token)."""
    return [int(next(iter(entry))) for entry in answer["prompt_logprobs"][1:]]


def _reasoning(message: dict) -> str | None:
    """The message's reasoning, in vLLM 0.32's field (what the Agents SDK sends back)."""
    return message.get("reasoning") or None


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
                reasoning += extra.get("reasoning") or ""
                finish = c.finish_reason or finish
        streamed[name] = (reasoning, content, finish)
    assert streamed["pd"] == streamed["vllm"]
    # (whether the tiny model closes its reasoning within 30 tokens depends on the host it was trained on)
    assert (streamed["pd"][0] or streamed["pd"][1]) and streamed["pd"][2] in ("stop", "length")


@pytest.mark.parametrize("effort", ["none", "high"])
def test_reasoning_effort_turns_thinking_on_or_off_as_in_vllm(glm_user_stack, glm_user_vllm, effort):
    """``reasoning_effort: none`` renders the template with thinking off (vLLM's
    ``enable_thinking`` false): the answer is content, no reasoning. Before: the stack's decode
    server read the output as reasoning (it looked at chat_template_kwargs only)."""
    got = {}
    for name, url in (("pd", glm_user_stack.config.router_url), ("vllm", glm_user_vllm)):
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24,
            "temperature": 0, "reasoning_effort": effort}).json()
        message = answer["choices"][0]["message"]
        got[name] = (_reasoning(message), message["content"], answer["choices"][0]["finish_reason"])
    assert got["pd"] == got["vllm"]
    assert (got["pd"][0] is None) == (effort == "none") and got["pd"][1], got


@pytest.mark.parametrize("budget", [0, 2, 7])
def test_a_thinking_budget_ends_the_reasoning_where_vllm_ends_it(glm_user_stack, glm_user_vllm, budget):
    """``thinking_token_budget`` (what Anthropic's ``thinking.budget_tokens`` becomes): after that
    many reasoning tokens ``</think>`` is forced, in every reasoning block the model opens (the
    tiny model opens a second one). The same tokens, reasoning and content as vLLM alone, whole
    and streamed. Before: the decode server ignored the budget (vLLM ends the reasoning after
    'The user', the stack reasoned on)."""
    got = {}
    for name, url in (("pd", glm_user_stack.config.router_url), ("vllm", glm_user_vllm)):
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40,
                "temperature": 0, "thinking_token_budget": budget, "logprobs": True,
                "return_tokens_as_token_ids": True, "skip_special_tokens": False}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        choice = answer["choices"][0]
        tokens = [c["token"] for c in choice["logprobs"]["content"]]
        chunks = list(_client(url).chat.completions.create(
            model=MODEL_NAME, messages=body["messages"], max_tokens=40, temperature=0, stream=True,
            extra_body={"thinking_token_budget": budget}))
        reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or "" for c in chunks if c.choices)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        got[name] = (tokens, _reasoning(choice["message"]), choice["message"]["content"], reasoning, content)
    assert got["pd"] == got["vllm"]
    assert got["pd"][0].count("token_id:11") >= 1  # </think>, forced or not


def _vllm_parse(tokenizer, text: str, tools: list[dict]) -> list[tuple[str, dict]]:
    """What vLLM's GLM-4.7 tool parser reads in ``text`` (the tokens a generation gave)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.glm47_moe_tool_parser import Glm47MoeModelToolParser

    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools)
    info = Glm47MoeModelToolParser(tokenizer, request.tools).extract_tool_calls(text, request)
    return [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # a grammar from the first token on


# text first: a tool_choice auto with a structured output is the calls or the output, and the model
# could take either; this text rules the calls out
LEAD, LEAD_RE = "Sure.", r"Sure\. "


def _forced(regex: str, **extra) -> dict:
    """A chat whose output is ``LEAD`` then ``regex``: with ``tools`` (``auto``) the grammar is the
    calls or the structured output (vLLM's ``or``), and the leading text rules the calls out
    first. Thinking off: with a reasoning parser a grammar holds once the reasoning ended."""
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": QUESTIONS[0]}], "tools": TOOLS,
            "max_tokens": 200, "temperature": 0, "structured_outputs": {"regex": LEAD_RE + regex}, **NO_THINKING,
            **extra}


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
    assert choice_["finish_reason"] == "tool_calls" and choice_["message"]["content"] == LEAD
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
               for c in choice_["message"]["tool_calls"])
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
    said = plain.choices[0].message.content or (plain.choices[0].message.model_extra or {}).get("reasoning")
    assert plain.choices[0].finish_reason in ("stop", "length") and said
    assert plain.choices[0].message.tool_calls is None
    regex = {"structured_outputs": {"regex": LEAD_RE + CALL_TIME}, **NO_THINKING}
    created = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                             tools=TOOLS, max_tokens=200, temperature=0, extra_body=regex)
    call = created.choices[0].message.tool_calls[0]
    assert created.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    with client.chat.completions.stream(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                        tools=[strict_time], max_tokens=200, temperature=0, extra_body=regex) \
            as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    streamed_call = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls" and streamed_call.function.name == "get_time"
    assert streamed_call.function.parsed_arguments == json.loads(streamed_call.function.arguments)
    assert isinstance(streamed_call.function.parsed_arguments["utc"], bool)


FORCED = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}


def _chat_summary(url: str, body: dict) -> tuple:
    """What a client reads of a chat answer, unstreamed and streamed: reasoning, content, the
    calls (name and arguments), the finish reason and the tokens."""
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    choice = answer["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls), calls  # vLLM's id shape
    whole = (_reasoning(message), message["content"],
             [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls],
             choice["finish_reason"], answer["usage"]["completion_tokens"])
    reasoning, content, streamed_calls, finish = "", "", {}, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                finish = c.get("finish_reason") or finish
                delta = c["delta"]
                reasoning += delta.get("reasoning") or ""
                content += delta.get("content") or ""
                for tc in delta.get("tool_calls") or []:
                    name_args = streamed_calls.setdefault(tc["index"], ["", ""])
                    name_args[0] += tc["function"].get("name") or ""
                    name_args[1] += tc["function"].get("arguments") or ""
    return whole, (reasoning, content, [(n, json.loads(a or "{}")) for _, (n, a) in sorted(streamed_calls.items())],
                   finish)


@pytest.mark.parametrize(("choice", "max_tokens", "thinking"), [
    ("named", 64, True), ("named", 300, True), ("required", 300, True), ("named", 300, False)],
    ids=["named-cut", "named", "required", "named-no-thinking"])
def test_a_forced_tool_call_is_the_one_vllm_makes(glm_user_stack, glm_user_vllm, choice, max_tokens, thinking):
    """A named function or ``required``: vLLM's GLM-4.7 call grammar, once the reasoning ended, the
    same tokens, calls, finish reason and usage. Before: the stack's own call grammar from the
    first token (no reasoning; ``{"city": "\\nParis\\n"}`` where vLLM wrote ``{"city": "Paris"}``).
    Streamed: the same reasoning and finish reason, and the calls of the unstreamed answer. (vLLM
    0.32's streaming parser reads GLM's markers by token id only: a call its grammar spelled in
    characters, as here, it streams as content; docs/router.md.)"""
    got = {}
    for name, url in (("pd", glm_user_stack.config.router_url), ("vllm", glm_user_vllm)):
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": QUESTIONS[0]}], "tools": TOOLS,
                "tool_choice": FORCED[choice], "max_tokens": max_tokens, "temperature": 0,
                **({} if thinking else NO_THINKING)}
        got[name] = _chat_summary(url, body)
    print(f"\n{choice} {max_tokens} {thinking}: {got['pd']!r}")
    (whole, streamed), (vllm_whole, vllm_streamed) = got["pd"], got["vllm"]
    assert whole == vllm_whole
    assert whole[2], whole  # a call, cut or whole
    assert (streamed[0], streamed[3]) == (vllm_streamed[0], vllm_streamed[3])
    assert streamed[1:3] == (whole[1], whole[2])


# ---- /v1/responses with tools (issue 59): as vLLM alone serves it ----

FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's tool shape
RESPONSES_CASES = {
    "a question": {"input": QUESTIONS[0]},
    "instructions and a developer message": {"instructions": "Be brief.", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use the tools."}]},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTIONS[1]}]}]},
    "the tool's result": {"input": [
        {"role": "user", "content": QUESTIONS[0]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 20 C."}]},
    "the model's reasoning and answer before": {"input": [
        {"role": "user", "content": QUESTIONS[2]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                      "text": "The sea is big."}]},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "It is big.", "annotations": []}]},
        {"role": "user", "content": QUESTIONS[1]}]},
    "a named function": {"input": QUESTIONS[0], "tool_choice": {"type": "function", "name": "get_weather"}},
    "a call required": {"input": QUESTIONS[0], "tool_choice": "required"},
}


def _response_items(response: dict) -> list[tuple]:
    """A response's output items without their ids: what a client reads of them."""
    out: list[tuple] = []
    for item in response["output"]:
        if item["type"] == "reasoning":
            out.append(("reasoning", "".join(c["text"] for c in item.get("content") or [])))
        elif item["type"] == "message":
            out.append(("message", "".join(c["text"] for c in item["content"]), item["status"]))
        else:
            out.append((item["type"], item.get("name"), json.loads(item["arguments"] or "{}"), item["status"]))
    return out


def _kinds(events: list) -> list[str]:
    """The events' types, a run of deltas counted once: how many tokens a delta carries is the
    server's own (the decode server sends an engine step's tokens together)."""
    kinds: list[str] = []
    for event in events:
        kind = event["type"] if isinstance(event, dict) else event.type
        if not (kind.endswith(".delta") and kinds and kinds[-1] == kind):
            kinds.append(kind)
    return kinds


def _response_summary(response: dict) -> tuple:
    usage = response["usage"]
    return (_response_items(response), response["status"], response["incomplete_details"],
            usage["input_tokens"], usage["output_tokens"], usage["total_tokens"])


@pytest.mark.parametrize("case", sorted(RESPONSES_CASES))
def test_responses_with_tools_are_served_as_vllm_serves_them(glm_user_stack, glm_user_vllm, case):
    """Before: 400 'tools is not supported: this server implements the non-stateful text subset'."""
    answers, streams = {}, {}
    for name, url in (("pd", glm_user_stack.config.router_url), ("vllm", glm_user_vllm)):
        body = {"model": MODEL_NAME, "tools": FLAT_TOOLS, "max_output_tokens": 40, "temperature": 0, "store": False,
                "include": ["reasoning.encrypted_content"], **RESPONSES_CASES[case]}
        resp = httpx.post(f"{url}/v1/responses", json=body, timeout=120)
        assert resp.status_code == 200, (name, resp.text)
        answers[name] = _response_summary(resp.json())
        events = []
        with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}, timeout=120) as streamed:
            assert streamed.status_code == 200
            for line in streamed.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        assert [e["sequence_number"] for e in events] == list(range(len(events))), name
        streams[name] = (_kinds(events), _response_summary(events[-1]["response"]))
    print(f"\n{case}: {answers['pd']!r}")
    assert answers["pd"] == answers["vllm"]
    if "tool_choice" not in RESPONSES_CASES[case]:  # a forced call vLLM 0.32 streams as text (see the chat test)
        assert streams["pd"] == streams["vllm"]
    assert streams["pd"][1] == answers["pd"]


def test_the_sdks_responses_calls_with_a_function_tool_and_its_output(glm_user_stack, glm_user_vllm):
    """The OpenAI SDK's ``responses.create`` and ``responses.stream`` (what the Agents SDK's
    Responses model calls): a call (forced by a grammar, on the stack), then the turn with its
    output on both servers; and what vLLM without a store answers to a ``previous_response_id``."""
    import openai

    call = _client(glm_user_stack.config.router_url).responses.create(
        model=MODEL_NAME, input=QUESTIONS[0], tools=FLAT_TOOLS, temperature=0, max_output_tokens=200,
        extra_body={"structured_outputs": {"regex": LEAD_RE + CALL_TIME}, **NO_THINKING})
    calls = [item for item in call.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_time"] and call.status == "completed", call.output
    assert isinstance(json.loads(calls[0].arguments)["utc"], bool) and calls[0].call_id
    turn = [{"role": "user", "content": QUESTIONS[0]}, *[c.model_dump(exclude_none=True) for c in calls],
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00 UTC"}]
    got = {}
    for name, url in (("pd", glm_user_stack.config.router_url), ("vllm", glm_user_vllm)):
        client = _client(url)
        with client.responses.stream(model=MODEL_NAME, input=turn, tools=FLAT_TOOLS, temperature=0,
                                     max_output_tokens=30) as stream:
            kinds = _kinds(list(stream))
            final = stream.get_final_response()
        with pytest.raises(openai.NotFoundError) as unknown:
            client.responses.create(model=MODEL_NAME, input="x", previous_response_id="resp_unknown")
        got[name] = (kinds, _response_summary(final.model_dump()), unknown.value.status_code,
                     unknown.value.body.get("param"))
    print(f"\nthe SDK: {got['pd']!r}")
    assert got["pd"] == got["vllm"]


# ---- agent SDKs, really run (issue 59): what each gives its user, the same from both ----

SDK_CLIENTS = ["agents-chat", "agents-responses", "langchain", "langchain-responses", "litellm-hosted_vllm",
               "litellm-openai"]


@pytest.mark.parametrize("client", SDK_CLIENTS)
def test_agent_sdks_get_what_vllm_gives_them(glm_user_stack, glm_user_vllm, client, tmp_path):
    """The OpenAI Agents SDK (Responses and chat models), LangChain's ``ChatOpenAI`` (chat and its
    Responses option) and LiteLLM (``hosted_vllm/`` and ``openai/``), each with a forced function
    tool, the tool's result and the answer, run in a loopback-only namespace
    (tests/clients/sdk_turns.py): the same calls, text and errors from the stack as from vLLM
    alone. Before: the Responses clients got the router's 400 'tools is not supported', and a
    named tool_choice no call where vLLM made one."""
    from tests.clients.install import clients_python
    from tests.clients.sandbox import Bridge

    script = Path(__file__).resolve().parents[2] / "clients" / "sdk_turns.py"
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "NO_PROXY": "*"}

    def run(name: str, url: str) -> dict:
        with Bridge(int(url.rsplit(":", 1)[1]), tmp_path / f"{name}.sock") as bridge:
            out = subprocess.run(bridge.argv([str(clients_python()), str(script), client, "--base-url",
                                              "http://127.0.0.1:8000/v1", "--model", MODEL_NAME], 8000),
                                 env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    # the two servers at once: each client process waits on its own server (2 cores, half the time)
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(run, name, url)
                   for name, url in (("pd", glm_user_stack.config.router_url), ("vllm", glm_user_vllm))}
        got = {name: future.result() for name, future in futures.items()}
    print(f"\n{client}: {got['pd']!r}")
    # vLLM 0.32 streams a forced call written in characters as text (test_a_forced_tool_call_is_the_one_vllm_makes):
    # LangChain's stream gets the call from the stack, none from vLLM
    streamed = got["pd"].pop("streamed_calls", None), got["vllm"].pop("streamed_calls", None)
    assert got["pd"] == got["vllm"]
    assert streamed[0] is None or streamed[0] == got["pd"].get("calls")
    assert got["pd"].get("calls") or got["pd"].get("items") or "error" in got["pd"]
