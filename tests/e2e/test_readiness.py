"""The router's readiness gate over real workers: not ready until every worker is ready and
the KV handshake succeeded; a prefill without MTP fails at start-up naming the flag it lacks,
the decode server's receiver records the rejected handshake with its reason, and the router
stays not ready, saying why."""

from __future__ import annotations

import time

import httpx
import pytest

from connector.profiles import MTP_FLAG
from pd_deploy.commands import VLLM_CPU_ENV, RouterSpec, decode_server_argv, router_argv, vllm_prefill_argv
from pd_deploy.stack.process import ManagedProcess
from pd_router.answers import ReadinessReport
from pd_wire.decode import CAPABILITIES_PATH, DecodeCapabilities
from tests.e2e.conftest import make_stack_config
from tests.waits import wait_until

pytestmark = pytest.mark.slow


def _ready(url: str) -> httpx.Response:
    return httpx.get(f"{url}/ready", timeout=5)


def _wait_ready_status(url: str, status: int, timeout: float) -> httpx.Response:
    """The router's /ready answer once it is ``status``."""
    seen: list[httpx.Response] = []
    wait_until(lambda: seen.append(_ready(url)) or seen[-1].status_code == status, timeout,
               f"/ready {status} (last: {seen[-1].status_code if seen else None})", 0.25)
    return seen[-1]


def test_router_not_ready_until_workers_and_handshake_and_after_a_decode_restart(tiny_model_dir, tmp_path):
    cfg = make_stack_config(tiny_model_dir, tmp_path, prefill_mtp=False)
    procs: list[ManagedProcess] = []
    try:
        router = ManagedProcess("router", router_argv(RouterSpec((cfg.prefill_url,), tuple(cfg.decode_urls),
                                                                 port=cfg.router_port,
                                                                 extra_args=("--probe-interval", "0.5"))),
                                tmp_path / "router.log")
        procs.append(router)
        router.wait_http(f"{cfg.router_url}/health", 60)
        r = _ready(cfg.router_url)
        assert r.status_code == 503, r.text
        report = ReadinessReport.model_validate_json(r.text)  # says which backend is down, and why
        assert not report.ready and [p.url for p in report.prefill] == [cfg.prefill_url]
        assert [d.url for d in report.decode] == cfg.decode_urls
        assert not any(p.healthy for p in report.prefill) and not any(d.healthy for d in report.decode)
        assert len(report.problems) == 2, report.problems
        assert any(p.startswith(f"prefill {cfg.prefill_url}: ") for p in report.problems), report.problems
        assert any(p.startswith(f"decode {cfg.decode_urls[0]}: ") for p in report.problems), report.problems

        decode_spec = cfg.decode_specs()[0]
        decode = ManagedProcess("decode", decode_server_argv(decode_spec), tmp_path / "decode.log", env=VLLM_CPU_ENV)
        procs.append(decode)
        decode.wait_http(f"{cfg.decode_urls[0]}/ready", 180)
        assert _ready(cfg.router_url).status_code == 503  # no prefill yet
        # the process froze its start-up heap (pd_http.heap) before it turned ready
        assert "decode server: " in (frozen := decode.log_path.read_text(errors="replace")) \
            and "objects of the start-up heap frozen" in frozen

        # a prefill without MTP: the connector's handshake is rejected, vLLM must not serve
        bad = ManagedProcess("prefill-no-mtp", vllm_prefill_argv(cfg.prefill_spec()), tmp_path / "bad.log",
                             env=VLLM_CPU_ENV)
        procs.append(bad)
        deadline = time.monotonic() + 240
        while bad.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not bad.alive(), "vLLM without MTP kept running against a decode server that needs MTP"
        assert bad.proc.returncode != 0
        bad_log = bad.log_path.read_text(errors="replace")
        assert MTP_FLAG in bad_log, bad_log[-3000:]  # vLLM names the flag it lacks
        assert "rejected the handshake" in bad_log and "num_layers mismatch" in bad_log
        # the decode server's receiver recorded the rejection, with the reason
        peers = DecodeCapabilities.model_validate_json(
            httpx.get(cfg.decode_urls[0] + CAPABILITIES_PATH, timeout=5).content).peers
        assert len(peers) == 1 and peers[0].state == "rejected" and "num_layers" in (peers[0].reason or ""), peers
        r = _wait_ready_status(cfg.router_url, 503, 5)
        assert r.status_code == 503
        assert "rejected" in r.text or "layer" in r.text, r.text  # the router says why

        # the right prefill: with MTP; the router turns ready after the handshake
        good_spec = cfg.prefill_spec().__class__(**{**cfg.prefill_spec().__dict__, "mtp": True})
        good = ManagedProcess("prefill", vllm_prefill_argv(good_spec), tmp_path / "good.log", env=VLLM_CPU_ENV)
        procs.append(good)
        good.wait_http(f"{cfg.prefill_url}/health", 300)
        r = _wait_ready_status(cfg.router_url, 200, 30)
        assert r.status_code == 200, r.text

        # the decode server restarts: not ready meanwhile; once it is back, the connector's
        # handshake keeper handshakes again on its own and requests flow, no manual step
        decode.stop()
        assert _wait_ready_status(cfg.router_url, 503, 10).status_code == 503
        decode = ManagedProcess("decode-restarted", decode_server_argv(decode_spec), tmp_path / "decode2.log",
                                env=VLLM_CPU_ENV)
        procs.append(decode)
        decode.wait_http(f"{cfg.decode_urls[0]}/ready", 180)
        r = _wait_ready_status(cfg.router_url, 200, 30)
        assert r.status_code == 200, r.text
        # ignore_eos: the tiny model is trained on this machine's CPU, its greedy answer may end early
        body = {"model": cfg.model_name, "prompt": "Flat is better than nested.", "max_tokens": 4, "ignore_eos": True}
        out = httpx.post(f"{cfg.router_url}/v1/completions", json=body, timeout=120)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 4, out.text
    finally:
        for p in reversed(procs):
            p.stop()
