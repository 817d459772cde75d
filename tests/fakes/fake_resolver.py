"""A DNS resolver for unit tests of discovery (:data:`pd_settings.servers.Resolver`): names
map to the addresses a test sets; a name set to an exception raises it (a failed lookup)."""

from __future__ import annotations

from collections.abc import Sequence


class FakeResolver:
    def __init__(self, names: dict[str, Sequence[str] | OSError] | None = None) -> None:
        self.names: dict[str, Sequence[str] | OSError] = dict(names or {})
        self.lookups: list[str] = []

    def __call__(self, host: str, port: int) -> Sequence[str]:
        self.lookups.append(host)
        found = self.names.get(host)
        if found is None:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        if isinstance(found, OSError):
            raise found
        return found
