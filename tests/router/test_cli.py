"""The command line exactly as other tools start it: options, env vars, validation, a real process."""

from __future__ import annotations

import subprocess
import sys

import pytest
from openai import OpenAI

from pd_deploy.commands import RouterSpec, router_argv
from pd_router.settings import RouterSettings, SettingsError, load_settings
from tests.fakes.fake_backends import FakeDecode, FakePrefill, ServerThread
from tests.procs import REPO, free_port, server
from tests.router.conftest import MODEL

pytestmark = [pytest.mark.timeout(60), pytest.mark.integration]  # integration: the router as a process


def test_help_documents_every_option():
    out = subprocess.run(
        [sys.executable, "-m", "pd_router", "--help"], capture_output=True, text=True, cwd=REPO, timeout=30
    )
    assert out.returncode == 0
    for name in RouterSettings.model_fields:
        assert "--" + name.replace("_", "-") in out.stdout and f"PD_ROUTER_{name.upper()}" in out.stdout, name
    assert "config" in RouterSettings.model_fields
    assert "--no-require-handshake" in out.stdout


def test_invalid_settings_name_option_value_and_reason():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pd_router",
            "--prefill",
            "localhost:8100",
            "--decode",
            "http://127.0.0.1:1",
            "--queue-timeout",
            "-3",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
    )
    assert out.returncode == 2
    assert "--prefill='localhost:8100': 'localhost:8100' is not an http:// or https:// URL" in out.stderr
    assert "--queue-timeout='-3': Input should be greater than 0" in out.stderr


def test_env_vars_and_command_line_precedence():
    env = {
        "PD_ROUTER_PREFILL": "http://a:1,http://b:2",
        "PD_ROUTER_DECODE": "http://c:3",
        "PD_ROUTER_MAX_QUEUE": "7",
        "PD_ROUTER_REQUIRE_HANDSHAKE": "false",
        "PD_ROUTER_LOG_LEVEL": "DEBUG",
        "PD_ROUTER_DECODE_SLOTS": "4",
    }
    s = load_settings(["--max-queue", "9"], env)
    assert s.prefill == ("http://a:1", "http://b:2") and s.decode == ("http://c:3",)
    assert (s.max_queue, s.require_handshake, s.log_level, s.decode_slots) == (9, False, "debug", 4)
    with pytest.raises(SettingsError, match=r"^PD_ROUTER_DECODE_SLOTS='0': Input should be greater than or equal to 1"):
        load_settings(["--prefill", "http://a:1", "--decode", "http://b:1"], {"PD_ROUTER_DECODE_SLOTS": "0"})
    with pytest.raises(SettingsError, match="given twice"):
        load_settings(["--prefill", "http://a:1", "--prefill", "http://a:1/", "--decode", "http://b:1"], {})


def test_router_process_serves_and_stops(tmp_path):
    prefill = ServerThread(FakePrefill(model=MODEL), free_port()).start()
    decode = ServerThread(FakeDecode(model=MODEL), free_port()).start()
    port = free_port()
    argv = router_argv(
        RouterSpec(
            (prefill.url,), (decode.url,), port=port, extra_args=("--probe-interval", "0.2", "--api-key", "k")
        )
    )
    try:
        with server(argv, tmp_path / "router.log", f"http://127.0.0.1:{port}/ready", timeout=30) as proc:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=10)
            chunks = list(
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, stream=True
                )
            )
            assert "".join(c.choices[0].delta.content for c in chunks) == "t0 t1 t2 "
            proc.stop()
            # uvicorn re-raises the SIGTERM it handled, after a graceful shutdown
            assert proc.proc.returncode in (0, -15), proc.log_tail()
            assert "Application shutdown complete" in proc.log_path.read_text()
            assert "request_id=" in proc.log_path.read_text()  # logs carry the request id
    finally:
        prefill.stop()
        decode.stop()
