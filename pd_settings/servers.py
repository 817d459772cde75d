"""Which prefill and decode servers a deployment has, as settings that change at runtime.

Two sources that the router (``--servers-file``, ``--prefill-dns``, ``--decode-dns``) and
the prefill connector (``kv_connector_extra_config.servers_file`` / ``decode_kv_dns``) read
the same way, so both follow one list:

* a **servers file** (YAML or JSON; :class:`ServersFile`), re-read when its modification
  time, size or inode changes (:class:`FileWatch`; write it elsewhere and rename it over
  the old one, as Kubernetes does with a ConfigMap, so that no reader sees half of it)::

      prefill:
        - http://10.0.0.1:8100
      decode:
        - url: http://10.0.0.2:8200
          kv_endpoint: 10.0.0.2:8300       # what prefill's connector handshakes with
        - http://10.0.0.3:8200             # a decode server without a KV endpoint (plain vLLM)

* a **DNS name** that resolves to several addresses (a Kubernetes headless Service):
  :func:`resolve_all` turns ``NAME:PORT`` into one ``ADDRESS:PORT`` per address
  (:data:`Resolver`: injectable, :func:`system_resolver` by default).

Nothing here runs a thread or a loop: the router polls from its event loop, the connector
from its handshake keeper.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_SERVERS_FILE_BYTES = 1 << 20

# (host, port) -> the addresses it resolves to now (may raise OSError)
Resolver = Callable[[str, int], Sequence[str]]


def check_url(url: str) -> str:
    """``url`` as an http(s) base URL with a host and no query or fragment (trailing ``/``
    dropped); ``ValueError`` saying why not."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    try:
        _ = parts.port  # raises for a port out of range or not a number
    except ValueError as exc:
        raise ValueError(f"{url!r} has an invalid port") from exc
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r} must not carry a query or fragment")
    return url.rstrip("/")


def split_host_port(value: str) -> tuple[str, int]:
    """``NAME:PORT`` (``[v6]:PORT`` for an IPv6 literal) -> (name, port); ``ValueError``."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not NAME:PORT (a DNS name and a port 1-65535)")
    return host, int(port)


def checked_name_ports(value: tuple[str, ...]) -> tuple[str, ...]:
    """A pydantic validator for a list of ``NAME:PORT`` DNS targets."""
    for name_port in value:
        split_host_port(name_port)
    return value


def join_host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def system_resolver(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to (``getaddrinfo``, TCP), sorted, each once."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def resolve_all(name_port: str, resolver: Resolver = system_resolver) -> list[str]:
    """``ADDRESS:PORT`` for every address ``NAME`` resolves to now; raises OSError when the
    lookup fails (the caller keeps what it had: a DNS hiccup must not empty the pool)."""
    host, port = split_host_port(name_port)
    return [join_host_port(address, port) for address in sorted(set(resolver(host, port)))]


class DecodeEntry(BaseModel):
    """One decode server: its HTTP base URL (for the router) and its KV endpoint (for
    prefill's connector; none for a decode server without one, e.g. plain vLLM)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    kv_endpoint: str | None = Field(default=None, min_length=3)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_url(value)

    @field_validator("kv_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            split_host_port(value)
        return value


class ServersFile(BaseModel):
    """The servers file: ``prefill`` (URLs) and ``decode`` (URLs, or ``{url, kv_endpoint}``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill: tuple[str, ...] = ()
    decode: tuple[DecodeEntry, ...] = ()

    @field_validator("prefill")
    @classmethod
    def _prefill(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_url(u) for u in urls)

    @field_validator("decode", mode="before")
    @classmethod
    def _plain_urls(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            return [{"url": v} if isinstance(v, str) else v for v in value]
        return value

    def kv_endpoints(self) -> tuple[str, ...]:
        return tuple(d.kv_endpoint for d in self.decode if d.kv_endpoint is not None)


def read_servers_file(path: Path | str) -> ServersFile:
    """Parse and validate the servers file; ``ValueError`` naming what is wrong. An empty
    file is an error, not an empty list (a writer caught between truncating and writing)."""
    import yaml

    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_SERVERS_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_SERVERS_FILE_BYTES:
        raise ValueError(f"{path} is larger than {MAX_SERVERS_FILE_BYTES} bytes")
    if not raw.strip():
        raise ValueError(f"{path} is empty (write it elsewhere and rename it over the old one)")
    try:
        data = yaml.safe_load(raw)  # YAML is a superset of JSON
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML or JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping with the keys 'prefill' and 'decode'")
    try:
        return ServersFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ValueError(f"{path}: {where}: {err['msg']}") from None


def checked_servers_file(value: Any) -> Any:
    """A pydantic validator for a ``servers_file`` option: the path (or None) if it names a
    readable, valid servers file, else ``ValueError`` saying what is wrong."""
    if value is not None:
        read_servers_file(value)
    return value


@dataclass
class FileWatch:
    """Re-reads a servers file when it changed (modification time, size or inode)."""

    path: Path
    current: ServersFile | None = None
    error: str | None = None  # why the last read failed (``current`` is kept)
    _signature: tuple[int, int, int] | None = None

    def poll(self) -> bool:
        """Read the file if it changed since the last read; True when ``current`` changed.
        A failed read keeps the last good contents and sets ``error``."""
        try:
            st = os.stat(self.path)
            signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError as exc:
            self.error = f"cannot read {self.path}: {exc.strerror or exc}"
            return False
        if signature == self._signature:
            return False
        try:
            servers = read_servers_file(self.path)
        except ValueError as exc:
            self.error = str(exc)
            return False  # the signature stays old: the next poll tries again
        self._signature, self.error = signature, None
        changed = servers != self.current
        self.current = servers
        return changed
