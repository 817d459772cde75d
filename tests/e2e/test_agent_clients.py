"""Coding agents and agent SDKs, really run against ``make run``'s stack (issue 59): each client
with its own defaults, in a network namespace whose only interface is loopback
(tests/clients/sandbox.py), so that it reaches the router and nothing else.

* Codex CLI (``@openai/codex`` from npm, ``codex exec``): the Responses API, streamed, with its
  developer messages, its function tools, ``reasoning``, ``include``, ``prompt_cache_key`` and
  ``client_metadata``; its instructions and tools trimmed to fit the tiny model's 4096 tokens."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.clients.install import npm_bin
from tests.clients.sandbox import Bridge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CODEX = ("@openai/codex", "0.171.0")
INSIDE_PORT = 8000  # the router, as the client inside the namespace sees it


def _codex_argv(binary: Path, home: Path, model: str, prompt: str) -> list[str]:
    """``codex exec`` with a model provider at the router (Responses API, no key), its base
    instructions a line, and the tools the tiny model's context cannot hold switched off."""
    instructions = home / "instructions.md"
    instructions.write_text("You are a coding agent. Answer briefly.\n")
    config = {
        "model_provider": "pd", "model_providers.pd.name": "pd",
        "model_providers.pd.base_url": f"http://127.0.0.1:{INSIDE_PORT}/v1",
        "model_providers.pd.wire_api": "responses", "model_instructions_file": str(instructions),
        "web_search": "disabled", "agents.enabled": False, "skills.bundled.enabled": False,
    }
    flags = [item for key, value in config.items() for item in ("-c", f"{key}={json.dumps(value)}")]
    return [str(binary), "exec", "--skip-git-repo-check", "--json", *flags, "--disable", "goals", "--disable",
            "apps", "-m", model, prompt]


def test_codex_exec_completes_a_turn(pd_stack, model_name, tmp_path):
    """Before: exit 1, the router's 400 'tools is not supported: this server implements the
    non-stateful text subset of the Responses API'."""
    binary = npm_bin(*CODEX, "codex")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {**os.environ, "CODEX_HOME": str(home), "NO_COLOR": "1"}
    with Bridge(pd_stack.config.router_port, tmp_path / "router.sock") as bridge:
        out = subprocess.run(bridge.argv(_codex_argv(binary, home, model_name, "Say hello."), INSIDE_PORT),
                             cwd=work, env=env, capture_output=True, text=True, timeout=300,
                             stdin=subprocess.DEVNULL)
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    print(f"\ncodex exit {out.returncode}: {[e.get('type') for e in events]}\n{out.stderr[-2000:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    kinds = [e.get("type") for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds and "error" not in kinds, events
    usage = next(e for e in events if e.get("type") == "turn.completed")["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
