"""Claude Code (``@anthropic-ai/claude-code`` from npm, print mode) really run against the stack
as a GLM-5.1 user runs it, and against vLLM alone on the same model (issue 60): in a network
namespace whose only interface is loopback (tests/clients/sandbox.py), its non-essential
traffic, telemetry and updater off, its system prompt one line and its tools one (``Read``)
so that they fit the tiny model's 4096 tokens, its output bound below that. It sends what
it always sends (``HEAD /``, then streamed ``POST /v1/messages?beta=true`` with its billing
header, ``thinking: adaptive``, ``output_config``, ``context_management``, ``metadata``, its
tools, no temperature: sampled, so the two answers differ).

Before issue 60: exit 1, "There's an issue with the selected model (tiny-glm). It may not exist
or you may not have access to it" (the router's 404 on /v1/messages)."""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.clients.install import npm_bin
from tests.clients.sandbox import Bridge
from tests.e2e.conftest import MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.332")
INSIDE_PORT = 8000  # the server, as the client inside the namespace sees it


def _claude(binary: Path, port: int, home: Path) -> dict[str, Any]:
    """``claude -p`` against the server at ``port``: its JSON result."""
    work = home / "work"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("The answer is 42.\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{INSIDE_PORT}",
           "ANTHROPIC_API_KEY": "unused", "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL_NAME,
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "NO_COLOR": "1"}
    argv = [str(binary), "-p", "What does notes.txt say?", "--output-format", "json", "--model", MODEL_NAME,
            "--system-prompt", "You are a coding agent. Answer briefly.", "--tools", "Read", "--max-turns", "8"]
    with Bridge(port, home / "server.sock") as bridge:
        out = subprocess.run(bridge.argv(argv, INSIDE_PORT), cwd=work, env=env, capture_output=True, text=True,
                             timeout=300, stdin=subprocess.DEVNULL)
    print(f"\nclaude exit {out.returncode}: {out.stdout[-1500:]}\n{out.stderr[-1500:]}")
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _answered(router_url: str) -> dict[str, float]:
    """The router's requests by status (``pd_router_requests_total``)."""
    counts: dict[str, float] = {}
    for line in httpx.get(router_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pd_router_requests_total{"):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            counts[status] = counts.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_claude_code_completes_a_turn_as_against_vllm_alone(glm_user_stack, glm_user_vllm, tmp_path):
    binary = npm_bin(*CLAUDE_CODE, "claude")
    router = glm_user_stack.config.router_url
    before = _answered(router)
    with ThreadPoolExecutor(2) as pool:  # the two at once: each waits on its own server
        pd, vllm = pool.map(lambda job: _claude(binary, int(job[1].rsplit(":", 1)[1]), tmp_path / job[0]),
                            (("pd", router), ("vllm", glm_user_vllm)))
    for result in (pd, vllm):
        assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"], result
        assert result["terminal_reason"] == "completed" and result["num_turns"] >= 1, result
        assert result["usage"]["input_tokens"] > 0 and result["usage"]["output_tokens"] > 0, result
    after = _answered(router)
    served = {status: after.get(status, 0.0) - before.get(status, 0.0) for status in after}
    assert served.get("200", 0) >= 1 and all(n == 0 for status, n in served.items() if status != "200"), served
