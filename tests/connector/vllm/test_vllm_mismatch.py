"""A vLLM started without MTP against a decode receiver expecting N+1 layers: vLLM refuses
to start, naming the missing flag, and the receiver records the rejected handshake."""

from __future__ import annotations

from pathlib import Path

import pytest

from connector.profiles import MTP_FLAG
from pd_deploy.commands import VLLM_CPU_ENV, vllm_prefill_argv
from tests.connector.vllm.conftest import prefill_spec, receiver
from tests.procs import ServerProcess, free_port

pytestmark = pytest.mark.slow


def test_vllm_without_mtp_fails_at_startup_and_the_receiver_records_the_rejection(
    tiny_model_dir: Path, tmp_path
):
    with receiver(tmp_path / "recv") as recv:
        spec = prefill_spec(tiny_model_dir, free_port(), mtp=False, decode_endpoints=(recv.endpoint,))
        vllm = ServerProcess(vllm_prefill_argv(spec), tmp_path / "vllm.log", VLLM_CPU_ENV)
        try:
            code = vllm.proc.wait(300)
        finally:
            vllm.stop()
        log = (tmp_path / "vllm.log").read_text(errors="replace")
        peers = recv.peers()
    assert code != 0
    assert MTP_FLAG in log, log[-3000:]
    assert "rejected the handshake" in log and "num_layers mismatch" in log
    print(f"receiver peers: {peers}")
    assert len(peers) == 1 and peers[0]["state"] == "rejected" and "num_layers" in peers[0]["reason"]
