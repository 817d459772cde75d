"""Run a client program (a CLI from npm, an SDK script) in a network namespace of its own whose
only interface is loopback, so that it reaches one server of the test's and nothing else: no
DNS, no internet, no other port of this machine.

Inside the namespace the client calls ``127.0.0.1:PORT``; a relay there carries each connection
over a Unix socket (a file: it crosses namespaces) to :class:`Bridge`, which connects it to the
server's own loopback port outside. Both relays copy bytes only.

    with Bridge(router_port, tmp_path / "bridge.sock") as bridge:
        subprocess.run(bridge.argv(["codex", "exec", ...], port=8000), ...)

Needs root (``unshare --net``) and ``ip`` (iproute2), as tests/nodes.py."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import TracebackType

Opener = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


def _relay(open_peer: Opener) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer_reader, peer_writer = await open_peer()
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, peer_writer), _pipe(peer_reader, writer))
    return handle


class Bridge:
    """The outside end: a Unix socket whose connections go to ``127.0.0.1:port``."""

    def __init__(self, port: int, path: Path) -> None:
        self.port, self.path = port, Path(path)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bridge", daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> Bridge:
        self._thread.start()
        opener: Opener = lambda: asyncio.open_connection("127.0.0.1", self.port)  # noqa: E731
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_unix_server(_relay(opener), path=str(self.path)), self._loop).result(10)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._server is not None:
            self._server.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self.path.unlink(missing_ok=True)

    def argv(self, command: Sequence[str], port: int) -> list[str]:
        """``command`` run in a new network namespace where ``127.0.0.1:port`` is the server."""
        return ["unshare", "--net", "--", sys.executable, str(Path(__file__).resolve()), "--port", str(port),
                "--socket", str(self.path), "--", *command]  # this file, by path: any working directory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    loop = asyncio.new_event_loop()
    opener: Opener = lambda: asyncio.open_unix_connection(args.socket)  # noqa: E731
    server = loop.run_until_complete(asyncio.start_server(_relay(opener), "127.0.0.1", args.port))
    threading.Thread(target=loop.run_forever, name="relay", daemon=True).start()
    try:
        return subprocess.run(command).returncode
    finally:
        loop.call_soon_threadsafe(server.close)


if __name__ == "__main__":
    sys.exit(main())
