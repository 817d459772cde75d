"""One agent turn through an agent SDK, as its users write it, run with the clients' own
environment (``make client-tools``: ``.cache/clients-venv``) in a loopback-only namespace
(tests/clients/sandbox.py). Prints one JSON line: what the client got (tool calls, text, the
error it raised), for the test to compare between the stack and vLLM alone.

    python sdk_turns.py CLIENT --base-url http://127.0.0.1:8000/v1 --model tiny-glm

CLIENT: ``agents-responses`` / ``agents-chat`` (the OpenAI Agents SDK's Responses and chat
models: a forced function tool, its result, the answer), ``langchain`` / ``langchain-responses``
(``ChatOpenAI.bind_tools`` with a forced tool, invoke and stream, then the tool's result),
``litellm-hosted_vllm`` / ``litellm-openai`` (``litellm.completion`` with a forced tool, then
the tool's result). Greedy, bounded outputs: the tiny model's words are the same on both."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

MAX_TOKENS = 64
QUESTION = "Weather in Paris?"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def weather(city: str = "") -> str:
    return f"Sunny in {city or 'the city'}, 20 C."


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc)[:300]}


async def _agents(base_url: str, model: str, responses: bool) -> dict[str, Any]:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    tool = function_tool(weather, name_override="get_weather")
    agent = Agent(name="a", instructions="Answer briefly.", tools=[tool], model=kind(model=model, openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS, tool_choice="get_weather"))
    try:
        result = await Runner.run(agent, QUESTION, max_turns=3)
    except Exception as exc:  # what the SDK raises is what its user gets
        return _error(exc)
    items = [(i.type, getattr(getattr(i, "raw_item", None), "name", None)) for i in result.new_items]
    return {"items": items, "final": result.final_output}


def _langchain(base_url: str, model: str, responses: bool) -> dict[str, Any]:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0, max_tokens=MAX_TOKENS,
                      max_retries=0, use_responses_api=responses)
    bound = chat.bind_tools([WEATHER], tool_choice="get_weather")
    out: dict[str, Any] = {}
    try:
        message = bound.invoke([HumanMessage(QUESTION)])
        out["calls"] = [(c["name"], c["args"]) for c in message.tool_calls]
        chunks = None
        for chunk in bound.stream([HumanMessage(QUESTION)]):
            chunks = chunk if chunks is None else chunks + chunk
        out["streamed_calls"] = [(c["name"], c["args"]) for c in chunks.tool_calls] if chunks is not None else []
        if message.tool_calls:
            call = message.tool_calls[0]
            answer = chat.invoke([HumanMessage(QUESTION), message,
                                  ToolMessage(weather(**call["args"]), tool_call_id=call["id"])])
            out["answer"] = answer.text if isinstance(answer.text, str) else answer.text()
    except Exception as exc:
        out.update(_error(exc))
    return out


def _litellm(base_url: str, model: str, provider: str) -> dict[str, Any]:
    import litellm

    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    out: dict[str, Any] = {}
    try:
        response = litellm.completion(model=f"{provider}/{model}", api_base=base_url, api_key="unused",
                                      messages=messages, tools=[WEATHER], tool_choice=forced, temperature=0,
                                      max_tokens=MAX_TOKENS)
        message = response.choices[0].message
        calls = message.tool_calls or []
        out["calls"] = [(c.function.name, c.function.arguments) for c in calls]
        out["finish"] = response.choices[0].finish_reason
        if calls:
            messages += [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": calls[0].id, "content": weather()}]
            answer = litellm.completion(model=f"{provider}/{model}", api_base=base_url, api_key="unused",
                                        messages=messages, tools=[WEATHER], temperature=0, max_tokens=MAX_TOKENS)
            out["answer"] = answer.choices[0].message.content
    except Exception as exc:
        out.update(_error(exc))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("client", choices=["agents-responses", "agents-chat", "langchain", "langchain-responses",
                                           "litellm-hosted_vllm", "litellm-openai"])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    if args.client.startswith("agents-"):
        got = asyncio.run(_agents(args.base_url, args.model, args.client == "agents-responses"))
    elif args.client.startswith("langchain"):
        got = _langchain(args.base_url, args.model, args.client == "langchain-responses")
    else:
        got = _litellm(args.base_url, args.model, args.client.split("-", 1)[1])
    print(json.dumps(got, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
