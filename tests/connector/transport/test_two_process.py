"""Real NIXL between two processes: GLM-5.1-shaped KV arrives byte-identical; a killed
receiver fails the sender's handoff quickly."""

from __future__ import annotations

import os
import signal
import time

import pytest

from connector.kv_errors import ControlChannelError
from connector.layout import glm5_fp8_ds_mla_layout
from connector.sender import KVSender
from connector.transport.ucx_proto import transport_class
from tests.connector.transport.remote import remote_receiver
from tests.connector.transport.synthetic import fill, layer_bytes

pytestmark = pytest.mark.integration  # two processes over real NIXL

LAYOUT = glm5_fp8_ds_mla_layout(78, 1)
TOKENS = 2048


@pytest.mark.timeout(120)
def test_glm5_kv_79_layers_2k_tokens_arrive_byte_identical(tmp_path):
    seed = 7
    with remote_receiver(tmp_path, "--max-tokens", str(TOKENS), "--handoff", "glm-2k", "--seed", str(seed)) as rr:
        sender = KVSender("prefill-rank0", LAYOUT, TOKENS)
        try:
            sender.connect(rr.endpoint, timeout=10)
            handoff = sender.begin(rr.endpoint, "glm-2k", TOKENS, timeout=10)
            for layer in range(LAYOUT.num_layers):
                fill(handoff.staging(layer), layer_bytes(LAYOUT, layer, TOKENS, seed))
                handoff.post_layer(layer)
            assert handoff.wait(timeout=30) == "sent", handoff.error
            (result,) = rr.results(1, timeout=30)
        finally:
            sender.close()
    # what carried it, as UCX wrote it (two processes of one host: its shared memory or TCP over lo)
    assert transport_class(handoff.carrier) in ("shm", "tcp"), handoff.carrier
    assert handoff.write_seconds is not None and handoff.write_seconds > 0
    assert handoff.nbytes == LAYOUT.num_layers * LAYOUT.bytes_per_layer(TOKENS)
    assert result.get("error") is None
    assert result["layers"] == 79 and result["num_tokens"] == TOKENS
    assert result["mismatches"] == []
    assert result["busy_slots"] == 0
    assert result["peers"] == [{"peer": "prefill-rank0", "state": "ok", "reason": None}]


@pytest.mark.timeout(180)
def test_receiver_killed_mid_transfer_fails_the_handoff_quickly_then_a_restart_works(tmp_path):
    tokens = 1024
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    sender = KVSender("prefill-kill", LAYOUT, tokens, staging_slots=1)
    try:
        with remote_receiver(first, "--max-tokens", str(tokens), "--handoff", "doomed", "--timeout", "60",
                             "--agent-name", "decode-0") as rr:
            handoff = sender.begin(rr.endpoint, "doomed", tokens, timeout=10)
            for layer in range(40):
                handoff.post_layer(layer)
            time.sleep(0.5)
            assert handoff.status() == "pending"
            os.killpg(rr.proc.proc.pid, signal.SIGKILL)
            # gone once the kernel has torn down its memory (over 10 s once beside a CPU hog)
            rr.proc.proc.wait(120)
            start = time.monotonic()
            for layer in range(40, LAYOUT.num_layers):
                handoff.post_layer(layer)
            assert handoff.wait(timeout=30) == "failed"
            elapsed = time.monotonic() - start
            assert handoff.status() == "failed"
            assert "failed" in handoff.error and rr.endpoint in handoff.error, handoff.error
            assert elapsed < 10, f"took {elapsed:.1f}s to notice the dead receiver"
            # the staging buffer is free again (staging_slots=1) and the dead endpoint is reported clearly
            with pytest.raises(ControlChannelError, match=rr.endpoint):
                sender.begin(rr.endpoint, "after-death", tokens, timeout=2)
        # the decode server comes back under the same NIXL agent name: the sender drops the
        # dead agent and handshakes again
        with remote_receiver(second, "--max-tokens", str(tokens), "--handoff", "reborn", "--seed", "3",
                             "--agent-name", "decode-0") as rr:
            handoff = sender.begin(rr.endpoint, "reborn", tokens, timeout=10)
            for layer in range(LAYOUT.num_layers):
                fill(handoff.staging(layer), layer_bytes(LAYOUT, layer, tokens, 3))
                handoff.post_layer(layer)
            assert handoff.wait(timeout=30) == "sent", handoff.error
            (result,) = rr.results(1, timeout=30)
            assert result.get("error") is None and result["mismatches"] == []
    finally:
        sender.close()
