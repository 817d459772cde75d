"""What carried an agent's KV WRITEs, read from the files UCX writes when asked
(connector/transport/ucx_proto.py): the parsing on UCX's own file format, then real NIXL
agents in this process, where UCX is made to choose TCP or left to choose."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from connector.transport import ucx_proto
from connector.transport.ucx_proto import PutChoice, put_carrier, read_choices, transport_class

# the first box of a file UCX 1.19 (NIXL 1.5.1's) wrote, as measured (docs/facts.md §2)
_DOT = '''digraph {
\tnode0 [label="zero-copy\\n%s" shape=box style=rounded]
\tnode0 -> node1 [style=bold];
\tnode1 [shape=oval fillcolor="#FFE0E0" style="filled" label=<<b>selected</b>>];
}
'''


def _write(directory: Path, name: str, transports: str) -> None:
    (directory / name).write_text(_DOT % transports)


def test_the_choices_are_read_per_agent_scope_memory_and_size(tmp_path: Path) -> None:
    _write(tmp_path, "pf_r0_self_cfg_0_put_from_host_memory_to_host_8173_inf.dot", "cma/memory")
    _write(tmp_path, "pf_r0_inter_node_cfg_2_put_from_host_memory_to_host_0_0.dot", "tcp/eth0")
    _write(tmp_path, "pf_r0_inter_node_cfg_2_put_from_host_memory_to_host_1_8172.dot", "tcp/eth0")
    _write(tmp_path, "pf_r0_inter_node_cfg_2_put_from_host_memory_to_host_8173_inf.dot",
           "rc_mlx5/mlx5_0:1 50% + rc_mlx5/mlx5_1:1 50%")
    _write(tmp_path, "pf_r0_inter_node_cfg_3_put_from_cuda_memory_to_cuda_0_inf.dot", "rc_mlx5/mlx5_2:1")
    _write(tmp_path, "pf_r0_inter_node_cfg_2_put_multi_from_host_memory_to_host_8173_inf.dot", "tcp/eth9")
    _write(tmp_path, "pf_r1_inter_node_cfg_1_put_from_host_memory_to_host_8173_inf.dot", "tcp/eth1")
    (tmp_path / "pf_r0_inter_node_cfg_2_am_send_from_host_memory_1_8176.dot").write_text(_DOT % "tcp/eth7")
    choices = read_choices(tmp_path, "pf-r0")
    assert len(choices) == 5  # its own put files only: not put_multi, not am_send, not another agent's
    assert PutChoice("pf_r0", "inter_node", 2, "host", 8173, None,
                     ("rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1")) in choices
    # a 1 MiB layer from host memory goes over both HCAs; its own endpoint ("self") is no peer
    assert put_carrier(choices, "DRAM", 1 << 20) == "rc_mlx5/mlx5_0:1+rc_mlx5/mlx5_1:1"
    assert put_carrier(choices, "DRAM", 4096) == "tcp/eth0"
    assert put_carrier(choices, "VRAM", 1 << 20) == "rc_mlx5/mlx5_2:1"
    assert put_carrier(read_choices(tmp_path, "pf-r1"), "VRAM", 1 << 20) == ucx_proto.UNKNOWN
    assert read_choices(tmp_path / "missing", "pf-r0") == []
    assert len(read_choices(tmp_path)) == 6  # every agent's
    # UCX keeps 31 characters of a name
    _write(tmp_path, "tilert_prefill_vm_example_12345_inter_node_cfg_1_put_from_host_memory_to_host_1_inf.dot",
           "tcp/ib0")
    long = read_choices(tmp_path, "tilert-prefill-vm.example-12345-abcdef01-r0")
    assert [c.transports for c in long] == [("tcp/ib0",)]


@pytest.mark.parametrize(("carrier", "kind"), [
    ("rc_mlx5/mlx5_0:1", "rdma"), ("dc_mlx5/mlx5_0:1+rc_verbs/mlx5_1:1", "rdma"), ("tcp/eth0", "tcp"),
    ("cma/memory", "shm"), ("cuda_ipc/cuda", "gpu"), ("tcp/eth0+rc_mlx5/mlx5_0:1", "mixed"),
    ("unknown", "unknown"), ("", "unknown"),
])
def test_a_carrier_has_a_kind(carrier: str, kind: str) -> None:
    assert transport_class(carrier) == kind


def test_the_operators_directory_is_kept() -> None:
    assert ucx_proto.proto_info_env(Path("/x"), {"UCX_PROTO_INFO_DIR": "/theirs"}) == {"UCX_PROTO_INFO": "put*"}
    assert ucx_proto.proto_info_env(Path("/x"), {"UCX_PROTO_INFO_DIR": "/theirs", "UCX_PROTO_INFO": "n"}) == {}
    assert ucx_proto.proto_info_env(Path("/x"), {"UCX_PROTO_INFO": "y"}) == {"UCX_PROTO_INFO_DIR": "/x"}
    assert ucx_proto.proto_info_env(Path("/x"), {}) == {"UCX_PROTO_INFO": "put*", "UCX_PROTO_INFO_DIR": "/x"}


def _write_once(tls: str | None, monkeypatch: pytest.MonkeyPatch, proto_dir: Path | None = None) -> str:
    """One WRITE between two NIXL agents of this process; what the sender's carrier says."""
    from connector.transport.nixl import NixlTransport

    if tls is not None:
        monkeypatch.setenv("UCX_TLS", tls)
    if proto_dir is not None:
        monkeypatch.setenv("UCX_PROTO_INFO_DIR", str(proto_dir))
    before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    a, b = NixlTransport("carrier-a"), NixlTransport("carrier-b")
    own = a._own_proto_dir
    try:
        assert {k: v for k, v in os.environ.items() if k.startswith("UCX_")} == before  # put back
        src = torch.arange(1 << 18, dtype=torch.int32).view(torch.uint8)
        dst = torch.zeros_like(src)
        rs, rd = a.register(src), b.register(dst)
        peer = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        handle = a.write(peer, [(rs.addr, rd.addr, rs.nbytes)], b"n", rd)
        for _ in range(100_000):
            if a.poll(handle) != "pending":
                break
            b.notifications()
        assert a.poll(handle) == "done" and torch.equal(src, dst)
        a.release(handle)
        return a.carrier(rs.nbytes)
    finally:
        a.close()
        b.close()
        assert own is None or not Path(own).exists()  # an agent's own directory goes with it


@pytest.mark.integration
def test_ucx_made_to_use_tcp_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _write_once("^cma,posix,sysv,knem,xpmem", monkeypatch) == "tcp/lo"


@pytest.mark.integration
def test_ucx_left_to_choose_names_what_it_chose(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    carrier = _write_once(None, monkeypatch, proto_dir=tmp_path)  # the operator's directory
    assert transport_class(carrier) in ("shm", "tcp"), carrier
    assert any(p.name.startswith("carrier_a_") for p in tmp_path.iterdir())  # kept: it is theirs
