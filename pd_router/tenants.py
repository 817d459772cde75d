"""Who a request is (its tenant) and what it may ask for (docs/router.md, "Tenants and keys").

A tenant is the name of the API key the request came with, from ``--api-keys-file``: a TOML
file of named keys, each stored as the SHA-256 of the key (never the key itself), with what
that key's requests may ask for::

    [[key]]
    name = "team-a"                  # the tenant (1-64 of A-Z a-z 0-9 . _ -)
    sha256 = "9f86d08...0f00a08"     # hex SHA-256 of the key (python -m pd_router.tenants hash)
    weight = 2.0                     # its share of the decode slots against the others' (default 1)
    min_priority = -10               # the lowest (soonest) priority it may ask for (default --min-priority)
    max_queued = 32                  # its requests that may wait for a slot here (default --max-queued-per-tenant)

The file is read again when it changes (its size or modification time, looked at every
``--discovery-interval``): keys added or removed without a restart; a file that no longer
parses is reported in the log and the keys before stay. ``--api-key``, when set too, is a key of
the default tenant. With neither, every request is the default tenant's and nothing is asked.

Behind a trusted gateway, ``--tenant-header NAME`` names the header whose value is the tenant
(the gateway authenticates users; its own key, if any, is checked as above); a request without
that header is its key's. Off by default: a client's header names nothing.

A key is found by the SHA-256 of what the request presents (a dictionary lookup on that hash:
the time it takes says nothing about any key's value); the single ``--api-key`` is compared in
constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pd_router.errors import InvalidRequest, Unauthorized

log = logging.getLogger("pd_router.tenants")
DEFAULT_TENANT = "default"  # the tenant of a request without a named key or a tenant header
OTHER_TENANT = "other"  # the metrics' label of a tenant not named in the keys file
_NAME = r"[A-Za-z0-9._-]{1,64}"
_TENANT_VALUE = re.compile(rb"[\x21-\x7e]{1,64}")
_UNAUTHORIZED = "invalid or missing API key (Authorization: Bearer KEY)"


class KeyEntry(BaseModel):
    """One named key of the keys file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=f"^{_NAME}$")
    sha256: str = Field(pattern="^[0-9a-f]{64}$", description="hex SHA-256 of the key")
    weight: float = Field(1.0, gt=0, le=1000, description="share of the decode slots against the other tenants'")
    min_priority: int | None = Field(None, ge=-(2**63), le=2**63 - 1,
                                     description="the lowest priority this key may ask for (None: --min-priority)")
    max_queued: int | None = Field(None, ge=0, description="requests of this tenant that may wait for a decode "
                                   "slot at one router (None: --max-queued-per-tenant)")


class KeysFile(BaseModel):
    """``--api-keys-file``: ``[[key]]`` tables, names and hashes unique."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: list[KeyEntry] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> KeysFile:
        for what in ("name", "sha256"):
            values = [getattr(k, what) for k in self.key]
            dup = next((v for v in values if values.count(v) > 1), None)
            if dup is not None:
                raise ValueError(f"two keys have the same {what}" + (f" {dup!r}" if what == "name" else ""))
        if any(k.name == DEFAULT_TENANT or k.name == OTHER_TENANT for k in self.key):
            raise ValueError(f"{DEFAULT_TENANT!r} and {OTHER_TENANT!r} are not names a key may have")
        return self


def read_keys(path: Path) -> KeysFile:
    """The keys file, validated; ``ValueError`` saying what is wrong (never a key's hash)."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from None
    try:
        return KeysFile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{path}: {where}: {first['msg']}") from None


def key_hash(key: str) -> str:
    """What the keys file stores for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    """A request's tenant and what it may ask for."""

    name: str
    label: str  # its metrics label: the keys file's names, the default tenant, else ``other``
    weight: float = 1.0
    min_priority: int = 0
    max_queued: int | None = None


class Tenants:
    """The keys (``--api-key``, ``--api-keys-file``) and ``--tenant-header``: a request's tenant."""

    def __init__(self, api_key: str | None, keys_file: Path | None, tenant_header: str | None,
                 min_priority: int, max_queued: int | None) -> None:
        self._api_key = f"Bearer {api_key}".encode() if api_key else None
        self.keys_file = keys_file
        self._header = tenant_header.lower().encode() if tenant_header else None
        self.min_priority = min_priority
        self.max_queued = max_queued
        self._by_hash: dict[str, KeyEntry] = {}
        self._by_name: dict[str, KeyEntry] = {}
        self._seen: tuple[int, int] | None = None  # (size, mtime_ns) of the file last read
        self.default = Tenant(DEFAULT_TENANT, DEFAULT_TENANT, min_priority=min_priority, max_queued=max_queued)
        if keys_file is not None:
            self._load(read_keys(keys_file), self._stat())  # at start, a bad file is a settings error

    @property
    def header(self) -> bytes | None:
        """The tenant header's name as ASGI carries it (lower case), None when off."""
        return self._header

    @property
    def named(self) -> bool:
        """Whether requests may have tenants other than the default one (a keys file or a
        tenant header): the queues' fair shares are on (:mod:`pd_router.slots.fair`)."""
        return self.keys_file is not None or self._header is not None

    @property
    def required(self) -> bool:
        """Whether a request must bring a key."""
        return self._api_key is not None or self.keys_file is not None

    def tenant(self, authorization: bytes | None, header: bytes | None = None) -> Tenant:
        """The tenant of a request with these ``Authorization`` and tenant headers; raises
        :class:`Unauthorized` when a key is required and none of them matches."""
        entry: KeyEntry | None = None
        if self.required:
            presented = authorization or b""
            if self._api_key is not None and hmac.compare_digest(presented, self._api_key):
                pass
            elif self._by_hash and presented[:7].lower() == b"bearer ":
                entry = self._by_hash.get(hashlib.sha256(presented[7:].strip()).hexdigest())
                if entry is None:
                    raise Unauthorized(_UNAUTHORIZED)
            else:
                raise Unauthorized(_UNAUTHORIZED)
        if self._header is not None and header is not None:
            if not _TENANT_VALUE.fullmatch(header):
                raise InvalidRequest("the tenant header must be 1-64 visible ASCII characters",
                                     param=self._header.decode())
            name = header.decode()
            entry = self._by_name.get(name)
            if entry is None:
                return Tenant(name, DEFAULT_TENANT if name == DEFAULT_TENANT else OTHER_TENANT,
                              min_priority=self.min_priority, max_queued=self.max_queued)
        if entry is None:
            return self.default
        return Tenant(entry.name, entry.name, entry.weight,
                      self.min_priority if entry.min_priority is None else entry.min_priority,
                      self.max_queued if entry.max_queued is None else entry.max_queued)

    def label(self, name: str) -> str:
        """The metrics label of the tenant named ``name``."""
        return name if name in self._by_name or name == DEFAULT_TENANT else OTHER_TENANT

    def labels(self) -> list[str]:
        """Every metrics label a tenant may have now."""
        return [DEFAULT_TENANT, OTHER_TENANT, *self._by_name]

    def reload(self) -> bool:
        """Read the keys file again if it changed; True when new keys are in use. A file that
        does not parse is logged and the keys before stay."""
        if self.keys_file is None:
            return False
        seen = self._stat()
        if seen == self._seen:
            return False
        try:
            keys = read_keys(self.keys_file)
        except ValueError as exc:
            log.error("keys file not reloaded (the keys before stay in use): %s", exc)
            self._seen = seen
            return False
        self._load(keys, seen)
        log.info("keys file reloaded: %d keys (%s)", len(keys.key), ", ".join(k.name for k in keys.key) or "none")
        return True

    def _stat(self) -> tuple[int, int] | None:
        assert self.keys_file is not None
        try:
            st = self.keys_file.stat()
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    def _load(self, keys: KeysFile, seen: tuple[int, int] | None) -> None:
        self._by_hash = {k.sha256: k for k in keys.key}
        self._by_name = {k.name: k for k in keys.key}
        self._seen = seen


def main(argv: list[str] | None = None) -> int:
    """``python -m pd_router.tenants hash``: a key read from stdin, its line for the keys file."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["hash"]:
        print("usage: python -m pd_router.tenants hash  (reads the key on stdin, prints its sha256)",
              file=sys.stderr)
        return 2
    key = sys.stdin.readline().strip()
    if not key:
        print("no key on stdin", file=sys.stderr)
        return 2
    print(f'sha256 = "{key_hash(key)}"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
