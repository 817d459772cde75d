"""The KV control channel: length-prefixed JSON frames of :data:`ControlMessage`.

A frame is a 4-byte big-endian length, then that many bytes of one JSON-encoded
message (at most :data:`MAX_FRAME` bytes). The receiver (decode server) runs
:class:`ControlServer` on its asyncio loop; the sender (connector worker) uses the
blocking :class:`ControlClient`, one persistent connection per endpoint, one
request/reply at a time. Every read and connect has a timeout.

With a shared secret (both sides), a connection authenticates first (:mod:`connector.kv_auth`):
the server answers nothing else until then, and closes a connection that fails, stays silent
or has not said Hello within ``auth_timeout_s``. Connections are capped (``max_connections``).
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import BaseModel, TypeAdapter, ValidationError

from connector import kv_auth
from connector.kv_errors import ControlChannelError
from connector.protocol import AuthChallenge, AuthFailed, AuthOk, AuthProof, AuthStart, ControlMessage
from pd_net.tcp import DeadPeer, detect_dead_peer, detect_dead_peer_on

MAX_FRAME = 1 << 20
ABORT_TIMEOUT_S = 5.0  # bound on telling a decode server that a handoff was given up
_LEN = struct.Struct(">I")
_ADAPTER: TypeAdapter[ControlMessage] = TypeAdapter(ControlMessage)  # type: ignore[arg-type, unused-ignore]  # 15-way union (flagged as needed in one checkout, unused in a fresh clone)


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


@dataclass(frozen=True)
class ControlLimits:
    max_connections: int = 256  # open control connections at once; more are closed at once
    auth_timeout_s: float = 10.0  # a connection authenticates and says Hello within this, or is closed
    dead_peer: DeadPeer = DeadPeer()  # a peer that vanished from the network is given up within its bound


NO_SECRET = ("this KV receiver has no shared secret: remove kv_secret_file/kv_secret_env from the connector's "
             "kv_connector_extra_config, or give the decode server the same secret (--kv-secret-file)")
SECRET_NEEDED = ("this KV receiver requires authentication: set kv_secret_file or kv_secret_env in the "
                 "connector's kv_connector_extra_config to the decode server's shared secret")


class ControlServer:
    """Accepts sender connections and answers each frame with ``handler``'s reply (after the
    connection authenticated, when ``secret`` is set)."""

    def __init__(self, host: str, port: int, handler: Handler, on_disconnect: DisconnectHandler,
                 frame_timeout: float = 10.0, secret: bytes | None = None,
                 limits: ControlLimits = ControlLimits()) -> None:
        self._host, self._port = host, port
        self._handler, self._on_disconnect = handler, on_disconnect
        self._frame_timeout = frame_timeout
        self._secret = secret
        self._limits = limits
        self._nonces = kv_auth.NonceLog()
        self._server: asyncio.Server | None = None
        self._conns: dict[asyncio.Task, asyncio.StreamWriter] = {}
        self.refused_connections = 0  # over max_connections, failed or late authentication (tests, logs)

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
        peername = writer.get_extra_info("peername")
        conn = ControlConnection(f"{peername[0]}:{peername[1]}" if peername else "?")
        detect_dead_peer_on(writer.transport, self._limits.dead_peer)
        if task is None or len(self._conns) >= self._limits.max_connections:
            self.refused_connections += 1
            writer.close()
            return
        self._conns[task] = writer
        loop = asyncio.get_running_loop()
        hello_by = loop.time() + self._limits.auth_timeout_s  # unauthenticated/no Hello yet: bounded
        try:
            if self._secret is not None and not await asyncio.wait_for(
                    self._authenticate(reader, writer, self._secret), self._limits.auth_timeout_s):
                self.refused_connections += 1
                return
            while True:
                idle = None if conn.peer is not None else max(0.0, hello_by - loop.time())
                msg = await self._read(reader, idle)
                if msg is None:
                    return
                if isinstance(msg, (AuthStart, AuthProof)):  # no secret here (else already authenticated)
                    await self._send(writer, AuthFailed(message=NO_SECRET))
                    return
                reply = await self._handler(conn, msg)
                if reply is not None:
                    await self._send(writer, reply)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            if conn.peer is None:
                self.refused_connections += 1
            return
        finally:
            self._conns.pop(task, None)
            self._on_disconnect(conn)
            writer.close()

    async def _read(self, reader: asyncio.StreamReader, timeout: float | None) -> BaseModel | None:
        """The next message; None at EOF or on a malformed or oversized frame (then the
        connection is closed). ``timeout`` bounds the wait for its first byte."""
        try:
            head = await asyncio.wait_for(reader.readexactly(_LEN.size), timeout)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        (size,) = _LEN.unpack(head)
        if size > MAX_FRAME:
            return None
        body = await asyncio.wait_for(reader.readexactly(size), self._frame_timeout)
        try:
            return decode_body(body)
        except ControlChannelError:
            return None

    async def _send(self, writer: asyncio.StreamWriter, msg: BaseModel) -> None:
        writer.write(encode_frame(msg))
        await asyncio.wait_for(writer.drain(), self._frame_timeout)

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes) -> bool:
        """The receiver's half of :mod:`connector.kv_auth`; True once the sender proved the secret."""
        start = await self._read(reader, None)
        if not isinstance(start, AuthStart):
            if start is not None:
                await self._send(writer, AuthFailed(message=SECRET_NEEDED))
            return False
        if not self._nonces.fresh(start.nonce):
            await self._send(writer, AuthFailed(message="replayed authentication nonce: start again with a fresh one"))
            return False
        mine = kv_auth.new_nonce()
        await self._send(writer, AuthChallenge(nonce=mine, proof=kv_auth.proof(secret, "decode", start.nonce, mine)))
        answer = await self._read(reader, None)
        if not isinstance(answer, AuthProof) or not kv_auth.check(secret, "prefill", start.nonce, mine, answer.proof):
            if answer is not None:
                await self._send(writer, AuthFailed(message="authentication failed: the shared secrets differ"))
            return False
        await self._send(writer, AuthOk())
        return True


# ----------------------------------------------------------------------------- client


class ControlClient:
    """Blocking client for one endpoint; thread-safe (one request at a time)."""

    def __init__(self, endpoint: str, timeout: float, secret: bytes | None = None) -> None:
        self.endpoint = endpoint
        host, port = parse_endpoint(endpoint)
        self._lock = threading.Lock()
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ControlChannelError(f"cannot reach the KV control endpoint {endpoint}: {exc}") from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        detect_dead_peer(self._sock, DeadPeer())  # a receiver host gone: a kept connection breaks within 6 s
        self._broken = False
        if secret is not None:
            try:
                self._authenticate(secret, timeout)
            except ControlChannelError:
                self.close()
                raise

    def _authenticate(self, secret: bytes, timeout: float) -> None:
        """The sender's half of :mod:`connector.kv_auth`: the receiver proves the secret first."""
        mine = kv_auth.new_nonce()
        challenge = self.request(AuthStart(nonce=mine), timeout)
        if not isinstance(challenge, AuthChallenge) or not kv_auth.check(
                secret, "decode", mine, challenge.nonce, challenge.proof):
            raise ControlChannelError(
                f"the KV control endpoint {self.endpoint} did not prove the shared secret (another secret, "
                "or not a decode server of this deployment)")
        done = self.request(AuthProof(proof=kv_auth.proof(secret, "prefill", mine, challenge.nonce)), timeout)
        if not isinstance(done, AuthOk):
            raise ControlChannelError(f"the KV control endpoint {self.endpoint} answered {type(done).__name__}")

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
                reply = decode_body(self._recv_exact(size))
                if isinstance(reply, AuthFailed):
                    raise ControlChannelError(f"the KV control endpoint {self.endpoint} refused this connection: "
                                              f"{reply.message}")
                return reply
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
