"""Secrets given by reference: a file path or the name of an environment variable, never the
value itself (a command line is visible to every user of the host in ``ps``). Used for the
decode server's HTTP API key, the key the router sends it, and the KV channel's shared secret.

:func:`read_secret` raises ``ValueError`` with a reason that never contains the secret;
:func:`is_loopback` says whether a listening address is reachable from this host only.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path

MIN_SECRET_CHARS = 16  # a shared secret or API key shorter than this is refused as guessable
MAX_SECRET_BYTES = 4096


def read_secret(file: Path | str | None, env_var: str | None, environ: Mapping[str, str] | None = None,
                min_chars: int = MIN_SECRET_CHARS) -> str | None:
    """The secret in ``file`` (surrounding white space stripped) or in the environment variable
    named ``env_var``; None when neither is given. Both given, an unreadable or empty file, an
    unset variable or a secret shorter than ``min_chars``: ``ValueError``."""
    if file is not None and env_var is not None:
        raise ValueError("give the secret either as a file or as an environment variable, not both")
    if file is not None:
        path = Path(file)
        try:
            with path.open("rb") as fh:
                raw = fh.read(MAX_SECRET_BYTES + 1)
        except OSError as exc:
            raise ValueError(f"cannot read the secret file: {exc.strerror or exc}") from None
        if len(raw) > MAX_SECRET_BYTES:
            raise ValueError(f"the secret file holds more than {MAX_SECRET_BYTES} bytes")
        try:
            value = raw.decode().strip()
        except UnicodeDecodeError:
            raise ValueError("the secret file is not UTF-8 text") from None
        where = "the secret file"
    elif env_var is not None:
        env = os.environ if environ is None else environ
        if env_var not in env:
            raise ValueError(f"the environment variable {env_var} is not set")
        value, where = env[env_var].strip(), f"the environment variable {env_var}"
    else:
        return None
    if len(value) < min_chars:
        raise ValueError(f"{where} holds a secret of {len(value)} characters; at least {min_chars} are required "
                         "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    if any(c.isspace() for c in value):
        raise ValueError(f"{where} holds a secret with white space inside")
    return value


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` only accepts connections from this host ("localhost",
    127.0.0.0/8, ::1). Any other name or address (0.0.0.0, ::, a host name) counts as exposed."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
