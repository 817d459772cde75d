"""The KV control channel: length-prefixed JSON frames of :data:`ControlMessage`.

A frame is a 4-byte big-endian length, then that many bytes of one JSON-encoded
message (at most :data:`MAX_FRAME` bytes). The receiver (decode server) runs
:class:`ControlServer` on its asyncio loop; the sender (connector worker) uses the
blocking :class:`ControlClient`, one persistent connection per endpoint, one
request/reply at a time. Every read and connect has a timeout.
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct
import threading
from collections.abc import Awaitable, Callable

from pydantic import BaseModel, TypeAdapter, ValidationError

from connector.kv_errors import ControlChannelError
from connector.protocol import ControlMessage

MAX_FRAME = 1 << 20
ABORT_TIMEOUT_S = 5.0  # bound on telling a decode server that a handoff was given up
_LEN = struct.Struct(">I")
_ADAPTER: TypeAdapter[ControlMessage] = TypeAdapter(ControlMessage)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"KV endpoint {endpoint!r}: expected host:port with a port in 1..65535")
    return host.strip("[]"), int(port)


def encode_frame(msg: BaseModel) -> bytes:
    body = msg.model_dump_json().encode()
    if len(body) > MAX_FRAME:
        raise ControlChannelError(f"control message of {len(body)} bytes exceeds {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def decode_body(body: bytes) -> BaseModel:
    try:
        return _ADAPTER.validate_json(body)
    except ValidationError as exc:
        raise ControlChannelError(f"malformed control message: {exc.errors()[0]['msg']}") from exc


# ----------------------------------------------------------------------------- server

Handler = Callable[["ControlConnection", BaseModel], Awaitable[BaseModel | None]]
DisconnectHandler = Callable[["ControlConnection"], None]


class ControlConnection:
    """One accepted connection; ``peer`` is set by the handler after a good Hello."""

    def __init__(self, remote: str) -> None:
        self.remote = remote
        self.peer: str | None = None


class ControlServer:
    """Accepts sender connections and answers each frame with ``handler``'s reply."""

    def __init__(self, host: str, port: int, handler: Handler, on_disconnect: DisconnectHandler,
                 frame_timeout: float = 10.0) -> None:
        self._host, self._port = host, port
        self._handler, self._on_disconnect = handler, on_disconnect
        self._frame_timeout = frame_timeout
        self._server: asyncio.Server | None = None
        self._conns: dict[asyncio.Task, asyncio.StreamWriter] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)

    @property
    def port(self) -> int:
        if self._server is None:
            raise ControlChannelError("control server not started")
        return self._server.sockets[0].getsockname()[1]

    @property
    def listening(self) -> bool:
        return self._server is not None and self._server.is_serving()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._conns.values()):
                writer.close()  # the connection's reader sees EOF and ends
            if self._conns:
                await asyncio.wait(list(self._conns), timeout=self._frame_timeout)
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns[task] = writer
        peername = writer.get_extra_info("peername")
        conn = ControlConnection(f"{peername[0]}:{peername[1]}" if peername else "?")
        try:
            while True:
                try:
                    head = await reader.readexactly(_LEN.size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                (size,) = _LEN.unpack(head)
                if size > MAX_FRAME:
                    return
                body = await asyncio.wait_for(reader.readexactly(size), self._frame_timeout)
                try:
                    msg = decode_body(body)
                except ControlChannelError:
                    return
                reply = await self._handler(conn, msg)
                if reply is not None:
                    writer.write(encode_frame(reply))
                    await asyncio.wait_for(writer.drain(), self._frame_timeout)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            if task is not None:
                self._conns.pop(task, None)
            self._on_disconnect(conn)
            writer.close()


# ----------------------------------------------------------------------------- client


class ControlClient:
    """Blocking client for one endpoint; thread-safe (one request at a time)."""

    def __init__(self, endpoint: str, timeout: float) -> None:
        self.endpoint = endpoint
        host, port = parse_endpoint(endpoint)
        self._lock = threading.Lock()
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ControlChannelError(f"cannot reach the KV control endpoint {endpoint}: {exc}") from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._broken = False

    @property
    def broken(self) -> bool:
        """True once the connection failed, or the endpoint closed it (e.g. a restarted
        decode server): then the sender handshakes again before its next use."""
        if not self._broken and self._lock.acquire(blocking=False):
            try:
                readable, _, _ = select.select([self._sock], [], [], 0)
                # idle and open: nothing to read; readable while idle: EOF (or a reset)
                if readable and self._sock.recv(1, socket.MSG_PEEK) == b"":
                    self._broken = True
            except OSError:
                self._broken = True
            finally:
                self._lock.release()
        return self._broken

    def request(self, msg: BaseModel, timeout: float) -> BaseModel:
        with self._lock:
            if self._broken:
                raise ControlChannelError(f"control connection to {self.endpoint} is closed")
            try:
                self._sock.settimeout(timeout)
                self._sock.sendall(encode_frame(msg))
                (size,) = _LEN.unpack(self._recv_exact(_LEN.size))
                if size > MAX_FRAME:
                    raise ControlChannelError(f"{self.endpoint} sent a {size}-byte frame (max {MAX_FRAME})")
                return decode_body(self._recv_exact(size))
            except TimeoutError as exc:
                self._broken = True
                raise ControlChannelError(
                    f"no reply from the KV control endpoint {self.endpoint} within {timeout:.1f}s") from exc
            except (OSError, ControlChannelError) as exc:
                self._broken = True
                if isinstance(exc, ControlChannelError):
                    raise
                raise ControlChannelError(f"control connection to {self.endpoint} failed: {exc}") from exc

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise ControlChannelError(f"the KV control endpoint {self.endpoint} closed the connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self._broken = True
        try:
            self._sock.close()
        except OSError:
            pass
