"""A router that stops (SIGSTOP) or dies (SIGKILL) while its request's decode request holds a
decode slot, before and after the request's first byte: the decode server frees the slot on
its own, within a stated bound (issue 48: what a lease's expiry guarded, now that the decode
request holds the slot):

| the router | before its first byte | after it |
|---|---|---|
| dies | the decode request's connection closes: at once (< 5 s here) | the same |
| stops | its KV never comes: ``--kv-timeout`` | the answer's bytes fill the socket buffers, then ``--write-timeout`` |

The real decode server (in-process: fake engine and KV receiver), a fake prefill, the router a
process of its own. A request asking for logprobs, so that its result is posted by the router
(the fake prefill has no KV channel to this decode server)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pd_deploy.commands import RouterSpec, router_argv
from tests.decode_server.conftest import build_model_dir, start_server
from tests.fakes.fake_backends import FakePrefill, ServerThread
from tests.fakes.fake_engine import FakeEngineConfig
from tests.metrics import metric_sum
from tests.procs import free_port, server
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
MODEL = "fake-model"  # the decode test server's served name
KV_TIMEOUT = WRITE_TIMEOUT = 2.0
CLOSED_WITHIN = 5.0  # a closed connection: the decode server sees it go at once
FILLED_WITHIN = 60.0  # a stopped router's socket buffers filled by a fast engine, then the write timeout
ANSWER = 1 << 19  # tokens: far more than the socket buffers hold (~12.6k of them here)
# the engine's pace: the whole answer takes it twice FILLED_WITHIN, so that only the write timeout can
# free the slot in time (an engine that ends the answer frees it at once, its bytes still unsent)
PACED = {"step_delay": 2 * FILLED_WITHIN / ANSWER}


class Rig:
    def __init__(self, decode, router, prefill: ServerThread) -> None:
        self.decode, self.router, self.prefill = decode, router, prefill
        self.url = router.url

    def busy(self) -> int:
        return self.decode.state.slots.busy

    def signal(self, sig: int) -> None:
        os.kill(self.router.proc.pid, sig)


@pytest.fixture
def rig(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Rig]:
    model_dir = build_model_dir(tmp_path / "fake-model")
    engine = FakeEngineConfig(script=[], filler_token=5, **getattr(request, "param", {}))
    decode, uvicorn_server, thread = start_server(model_dir, engine, slots=1, kv_timeout=KV_TIMEOUT,
                                                  write_timeout=WRITE_TIMEOUT, max_seq_len=1 << 20)
    prefill = ServerThread(FakePrefill(model=MODEL), free_port()).start()
    port = free_port()
    argv = router_argv(RouterSpec((prefill.url,), (decode.url,), port=port,
                                  extra_args=("--probe-interval", "0.2", "--log-level", "warning")))
    try:
        with server(argv, tmp_path / "router.log", f"http://127.0.0.1:{port}/ready", 60) as router:
            router.url = f"http://127.0.0.1:{port}"
            rig = Rig(decode, router, prefill)
            try:
                yield rig
            finally:
                rig.signal(signal.SIGCONT)  # (a stopped process cannot be stopped)
    finally:
        prefill.stop()
        uvicorn_server.should_exit = True
        thread.join(10)


def _send(url: str, max_tokens: int, first_byte: threading.Event, got: dict) -> None:
    """A streaming completion whose decode needs vLLM's answer (logprobs: the result posted)."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "stream": True, "logprobs": 1,
            "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            for _ in resp.iter_bytes():  # read on: a client that stays (the router's fate is the test's)
                first_byte.set()
    except httpx.HTTPError as exc:
        got["error"] = exc


def _holding(rig: Rig, max_tokens: int, first_byte_too: bool) -> threading.Thread:
    first_byte, got = threading.Event(), {}
    client = threading.Thread(target=_send, args=(rig.url, max_tokens, first_byte, got), daemon=True)
    client.start()
    wait_until(lambda: rig.busy() == 1, 30, "the request's decode request holding the slot")
    if first_byte_too:
        assert first_byte.wait(30), got
    return client


def _freed(rig: Rig, within: float) -> float:
    t0 = time.monotonic()
    wait_until(lambda: rig.busy() == 0, within, "the slot freed by the decode server")
    return time.monotonic() - t0


@pytest.mark.parametrize("after_first_byte", [False, True], ids=["before", "after"])
def test_a_router_that_dies_holding_a_slot_frees_it_at_once(rig, after_first_byte):
    if not after_first_byte:
        rig.prefill.app.knobs = rig.prefill.app.knobs.model_copy(update={"delay": 60.0})  # no first byte yet
    _holding(rig, 2000, after_first_byte)
    rig.signal(signal.SIGKILL)
    took = _freed(rig, CLOSED_WITHIN)
    print(f"\nfreed {took:.2f} s after the router died ({'after' if after_first_byte else 'before'} its first byte)")


def test_a_router_stopped_before_its_first_byte_frees_the_slot_at_the_kv_timeout(rig):
    rig.prefill.app.knobs = rig.prefill.app.knobs.model_copy(update={"delay": 60.0})  # the prefill never answers
    _holding(rig, 2000, first_byte_too=False)
    rig.signal(signal.SIGSTOP)
    took = _freed(rig, KV_TIMEOUT + CLOSED_WITHIN)
    assert metric_sum(rig.decode.url, "decode_server_errors_total", error_type="kv_timeout") == 1
    print(f"\nfreed {took:.2f} s after the router stopped (--kv-timeout {KV_TIMEOUT:g})")


@pytest.mark.parametrize("rig", [PACED], indirect=True, ids=["paced"])
def test_a_router_stopped_mid_stream_frees_the_slot_at_the_write_timeout(rig):
    """An engine fast enough to fill the socket buffers in seconds and an answer far longer than
    they hold: once they are full, the decode server's next write waits for the stopped router,
    and gives up after the write timeout. The engine is paced so that it cannot end the answer
    first: its worker runs ahead of the writes, and the slot goes back as soon as the engine
    ended (the stall is then counted at the write timeout, after the slot came back)."""
    _holding(rig, ANSWER, first_byte_too=True)
    rig.signal(signal.SIGSTOP)
    took = _freed(rig, FILLED_WITHIN)
    assert metric_sum(rig.decode.url, "decode_server_cancelled_total", reason="client_stalled") == 1
    print(f"\nfreed {took:.2f} s after the router stopped (--write-timeout {WRITE_TIMEOUT:g})")
