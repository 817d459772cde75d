"""The router process stays light: no engine code (connector, decode server), no torch or
transformers, not at import and not after serving structured output (it checks grammars
without compiling them: pd_grammar.spec, compile=False), and a small resident set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pd_deploy.commands import RouterSpec, router_argv
from tests.fakes.fake_backends import FakeDecode, FakePrefill, ServerThread
from tests.procs import REPO, free_port, server
from tests.router.conftest import MODEL

pytestmark = [pytest.mark.timeout(60), pytest.mark.integration]  # integration: the router as a process

HEAVY = ("connector", "decode_server", "torch", "transformers", "xgrammar")
MAX_RSS_MB = 150
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_importing_the_router_app_loads_no_engine_code():
    probe = ("import json, sys; import pd_router.server.app, pd_router.__main__; "
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout))
    assert "pd_router" in loaded and "pd_wire" in loaded  # the probe looked at the right process
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_the_router_process_serves_structured_output_without_torch(tmp_path):
    prefill = ServerThread(FakePrefill(model=MODEL), free_port()).start()
    decode = ServerThread(FakeDecode(model=MODEL), free_port()).start()
    port = free_port()
    argv = router_argv(RouterSpec((prefill.url,), (decode.url,), port=port))
    try:
        with server(argv, tmp_path / "router.log", f"http://127.0.0.1:{port}/ready", timeout=30) as proc:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            bodies = [
                {"tools": TOOLS, "tool_choice": "required"},
                {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
                {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "strin"}}}},
            ]
            codes = [httpx.post(url, timeout=10, json={
                "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra,
            }).status_code for extra in bodies]
            assert codes == [200, 200, 400]
            maps = Path(f"/proc/{proc.proc.pid}/maps").read_text()
            assert "libtorch" not in maps and "xgrammar" not in maps, "the router loaded torch or xgrammar"
            rss = _rss_mb(proc.proc.pid)
            print(f"router RSS {rss:.0f} MB")
            assert rss <= MAX_RSS_MB, f"router RSS {rss:.0f} MB after start and three requests"
    finally:
        prefill.stop()
        decode.stop()
