"""Mutual HMAC challenge-response of the KV control channel (protocol 3), with Python's
:mod:`hmac` and :mod:`secrets` (no hand-made primitive).

Both sides hold the same shared secret (``kv_secret_file`` / ``kv_secret_env`` on either
side; never on a command line). On a new connection the sender sends a fresh 32-byte nonce
``cn`` (:class:`~connector.protocol.AuthStart`); the receiver answers with its own fresh
nonce ``sn`` and ``HMAC(secret, "decode" | cn | sn)``; the sender checks that proof (a
receiver without the secret cannot make it) and answers ``HMAC(secret, "prefill" | cn | sn)``,
which the receiver checks. Each proof covers both nonces and names its side, so neither a
recorded proof (the other side's nonce is new) nor the receiver's own proof reflected back
(other label) is accepted. The receiver also refuses a client nonce it saw recently.

Only the start of the connection is authenticated: the channel is not encrypted and its later
frames carry no MAC, so it must run on a private network (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict

NONCE_BYTES = 32
_DOMAIN = b"pd-kv-control/3\x00"


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def proof(secret: bytes, side: str, client_nonce: str, server_nonce: str) -> str:
    """``side`` is "decode" (the receiver's proof) or "prefill" (the sender's)."""
    if side not in ("decode", "prefill"):
        raise ValueError(f"side={side!r}")
    msg = _DOMAIN + side.encode() + b"\x00" + bytes.fromhex(client_nonce) + bytes.fromhex(server_nonce)
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def check(secret: bytes, side: str, client_nonce: str, server_nonce: str, given: str) -> bool:
    """Constant-time comparison of ``given`` with the expected proof."""
    return hmac.compare_digest(proof(secret, side, client_nonce, server_nonce).encode(), given.encode())


class NonceLog:
    """Client nonces seen in the last ``ttl_s`` seconds (at most ``capacity``, oldest
    forgotten first): a nonce seen again is a replay."""

    def __init__(self, ttl_s: float = 600.0, capacity: int = 65536) -> None:
        self._ttl, self._capacity = ttl_s, capacity
        self._seen: OrderedDict[str, float] = OrderedDict()

    def fresh(self, nonce: str) -> bool:
        """Record ``nonce``; False if it was seen already (within the window)."""
        now = time.monotonic()
        while self._seen and (len(self._seen) >= self._capacity or now - next(iter(self._seen.values())) > self._ttl):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return False
        self._seen[nonce] = now
        return True
