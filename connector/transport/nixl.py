"""The NIXL implementation of :class:`connector.transport.base.Transport` (UCX backend).

Host tensors register as DRAM, CUDA tensors as VRAM. Every call into the agent goes
through NIXL's own reader/writer lock (``NIXL_THREAD_SYNC_RW``), so a sender thread
can post WRITEs while another thread adds a peer. The agent has no progress thread:
``poll`` and ``notifications`` progress it, so callers poll while anything is pending. ``nixl`` is imported when a
transport is created, so modules using this one import without NIXL installed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from connector.kv_errors import TransportError
from connector.transport import ucx_proto
from connector.transport.base import Piece, Region, Transport, XferHandle, XferState, merge_pieces

_STATES: dict[str, XferState] = {"DONE": "done", "PROC": "pending"}  # NIXL's transfer states; else "error"
# UCX reads its variables from the environment when an agent creates its backend: the few
# lines that set them for one agent and put them back are serialised (tests make agents in threads)
_UCX_ENV_LOCK = threading.Lock()

if TYPE_CHECKING:
    import torch


class _NixlXfer(XferHandle):
    def __init__(self, handle: Any) -> None:
        self.handle = handle


def _load_nixl() -> Any:
    try:
        from nixl import _api
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise TransportError(
            "transport 'nixl' needs the NIXL Python package: "
            "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 numpy"
        ) from exc
    return _api


class NixlTransport(Transport):
    kind = "nixl"

    def __init__(self, name: str, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"NixlTransport workers={workers}: must be >= 1")
        api = _load_nixl()
        # No NIXL progress thread: it spins (no delay) and takes a core from the thread
        # doing the (synchronous, CMA) WRITE; our callers progress the agent themselves
        # (poll / notifications). Measured on 2 cores: 486 MiB push 1.8 -> 3.5 GB/s.
        config = api.nixl_agent_config(backends=[], enable_prog_thread=False,
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        # UCX states which transport it chose for this agent's WRITEs in files (ucx_proto):
        # the operator's UCX_PROTO_INFO_DIR, else a directory of this agent's own
        operator_dir = os.environ.get(ucx_proto.PROTO_INFO_DIR)
        self._own_proto_dir = None if operator_dir else tempfile.mkdtemp(prefix="ucx-proto-")
        self._proto_dir = Path(operator_dir or self._own_proto_dir or "")
        self._proto_seen: tuple[float, list[ucx_proto.PutChoice]] = (-1.0, [])
        try:
            with _UCX_ENV_LOCK, _environ(ucx_proto.proto_info_env(self._proto_dir, dict(os.environ))):
                self._agent = api.nixl_agent(name, config)
                # One UCX worker per posting thread: NIXL binds each thread that prepares
                # transfers to one of its workers (round robin), and posts on different
                # workers run in parallel (an intra-node CMA put is a synchronous copy in the
                # posting thread, so one worker is one copying core).
                self._agent.create_backend("UCX", {"num_workers": str(workers)})
        except Exception as exc:  # nixl raises its own binding errors
            self._remove_proto_dir()
            raise TransportError(f"cannot create NIXL agent {name!r}: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise TransportError(f"NIXL agent {name!r}: the UCX backend plugin did not load")
        self._name = name
        self._lock = threading.Lock()  # guards the Python-side lists below
        self._registrations: list[Any] = []
        self._buffers: list[torch.Tensor] = []
        self._mem_type, self._device = "DRAM", 0
        self._closed = False

    @property
    def name(self) -> str:
        return self._name

    def register(self, tensor: torch.Tensor) -> Region:
        if not tensor.is_contiguous():
            raise TransportError("NIXL transport: can only register contiguous tensors")
        device = tensor.get_device()
        mem_type = "VRAM" if device >= 0 else "DRAM"
        region = Region(tensor.data_ptr(), tensor.numel() * tensor.element_size(), max(device, 0), mem_type)
        try:
            reg = self._agent.register_memory([(region.addr, region.nbytes, region.device, "")], mem_type)
        except Exception as exc:
            raise TransportError(
                f"NIXL register_memory of {region.nbytes} bytes ({mem_type}) failed: {exc}") from exc
        with self._lock:
            self._registrations.append(reg)
            self._buffers.append(tensor)
            self._mem_type, self._device = mem_type, region.device  # one kind of local memory per agent
        return region

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def carrier(self, nbytes: int) -> str:
        """The transport UCX chose for this agent's WRITEs of ``nbytes`` to its peers, as UCX
        wrote it into the protocol-info directory (re-read only when a file was added)."""
        try:
            mtime = self._proto_dir.stat().st_mtime
        except OSError:
            return ucx_proto.UNKNOWN
        seen, choices = self._proto_seen
        if mtime != seen:
            # its own directory holds only its files; the operator's, every agent's of theirs
            choices = ucx_proto.read_choices(self._proto_dir, None if self._own_proto_dir else self._name)
            self._proto_seen = (mtime, choices)
        return ucx_proto.put_carrier(choices, self._mem_type, nbytes)

    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransportError(f"NIXL add_remote_agent failed: {exc}") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, peer: str) -> None:
        try:
            self._agent.remove_remote_agent(peer)
        except Exception:  # unknown peer: nothing to remove
            pass

    def connect(self, peer: str) -> None:
        try:
            self._agent.make_connection(peer)
        except Exception as exc:
            raise TransportError(f"NIXL make_connection to {peer!r} failed: {exc}") from exc

    def write(self, peer: str, pieces: Sequence[Piece], notif: bytes,
              remote_region: Region | None = None) -> XferHandle:
        import numpy as np

        merged = merge_pieces(pieces)
        if not merged:
            raise TransportError("NIXL write: nothing to write")
        arr = np.array(merged, dtype=np.uint64)
        local = np.zeros((len(merged), 3), dtype=np.uint64)
        remote = np.zeros((len(merged), 3), dtype=np.uint64)
        local[:, 0], local[:, 1], local[:, 2] = arr[:, 0], arr[:, 2], self._device
        remote[:, 0], remote[:, 1] = arr[:, 1], arr[:, 2]
        remote[:, 2] = remote_region.device if remote_region else 0
        try:
            handle = self._agent.initialize_xfer(
                "WRITE", self._agent.get_xfer_descs(local, self._mem_type),
                self._agent.get_xfer_descs(remote, remote_region.mem if remote_region else "DRAM"), peer, notif)
        except Exception as exc:
            raise TransportError(f"NIXL cannot prepare a WRITE to {peer!r}: {exc}") from exc
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            self._safe_release(handle)
            raise TransportError(f"NIXL WRITE to {peer!r} failed: {type(exc).__name__}: {exc}") from exc
        if state == "ERR":
            self._safe_release(handle)
            raise TransportError(f"NIXL WRITE to {peer!r} failed at post")
        return _NixlXfer(handle)

    def notify(self, peer: str, notif: bytes) -> None:
        try:
            self._agent.send_notif(peer, notif)
        except Exception as exc:
            raise TransportError(f"NIXL notification to {peer!r} failed: {exc}") from exc

    def poll(self, handle: XferHandle) -> XferState:
        if not isinstance(handle, _NixlXfer):
            raise TypeError(f"not a NIXL transfer handle: {handle!r}")
        try:
            state = self._agent.check_xfer_state(handle.handle)
        except Exception:  # e.g. nixlRemoteDisconnectError
            return "error"
        return _STATES.get(state, "error")

    def release(self, handle: XferHandle) -> None:
        if not isinstance(handle, _NixlXfer):
            raise TypeError(f"not a NIXL transfer handle: {handle!r}")
        self._safe_release(handle.handle)

    def _safe_release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # an in-flight transfer that cannot be cancelled stays with NIXL
            pass

    def notifications(self) -> list[tuple[str, bytes]]:
        notifs = self._agent.get_new_notifs()
        return [(peer, msg) for peer, msgs in notifs.items() for msg in msgs]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regs, self._registrations = self._registrations, []
        for reg in regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception:
                pass
        with self._lock:
            self._buffers.clear()
        self._remove_proto_dir()

    def _remove_proto_dir(self) -> None:
        if self._own_proto_dir is not None:
            shutil.rmtree(self._own_proto_dir, ignore_errors=True)


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in this process's environment for the block, then put back."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
