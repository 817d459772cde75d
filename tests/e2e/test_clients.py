"""Real clients through the PD stack: the official openai SDK and the README's curl commands."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from openai import AsyncOpenAI, OpenAI

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _chat_prompt_tokens(tokenizer, messages: list[dict]) -> int:
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_sdk_chat_non_streaming_usage(pd_stack, model_name, tokenizer):
    client = OpenAI(base_url=f"{pd_stack.config.router_url}/v1", api_key="unused", timeout=120)
    messages = [{"role": "user", "content": "Tell me about Python."}]
    out = client.chat.completions.create(model=model_name, messages=messages, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == _chat_prompt_tokens(tokenizer, messages)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.choices[0].message.content


def test_sdk_completion_streaming_include_usage(pd_stack, model_name, tokenizer):
    client = OpenAI(base_url=f"{pd_stack.config.router_url}/v1", api_key="unused", timeout=120)
    prompt = "Simple is better than complex."
    stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert finish == "length" and text
    assert usage is not None, "include_usage asked for, no usage chunk"
    assert usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert usage.completion_tokens == 10


async def test_async_sdk_chat_streaming(pd_stack, model_name, tokenizer):
    client = AsyncOpenAI(base_url=f"{pd_stack.config.router_url}/v1", api_key="unused", timeout=120)
    messages = [{"role": "user", "content": "Count to five."}]
    stream = await client.chat.completions.create(model=model_name, messages=messages, max_tokens=8, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    roles, content, usage = [], "", None
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            if delta.role:
                roles.append(delta.role)
            content += delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    await client.close()
    assert roles[:1] == ["assistant"]
    assert content
    assert usage.prompt_tokens == _chat_prompt_tokens(tokenizer, messages) and usage.completion_tokens == 8


def _readme_curl_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        commands += [line.strip() for line in joined.splitlines() if line.strip().startswith("curl ")]
    return commands


def test_readme_curl_commands_work_as_written(pd_stack, model_name):
    commands = _readme_curl_commands()
    assert len(commands) >= 2, "README shows no curl commands"
    for cmd in commands:
        # as written, but aimed at this test's router port
        argv = [a.replace("127.0.0.1:8000", f"127.0.0.1:{pd_stack.config.router_port}") for a in shlex.split(cmd)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        body = out.stdout.strip()
        if body.startswith("data:"):
            events = [line[5:].strip() for line in body.splitlines() if line.startswith("data:")]
            assert events[-1] == "[DONE]" and json.loads(events[0])["choices"]
        else:
            assert json.loads(body)["choices"], body
