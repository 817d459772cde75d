"""A request's conversation keys (``pd_wire.handoff.KeepKey``; docs/router.md, "Which decode server
a conversation's next turn goes to"): what the router names the KV a decode server may keep after
the answer, and how a later turn of the same conversation finds it.

* ``scope``: whose KV it is: the tenant, the body's ``cache_salt`` (vLLM's), the served model
  and the endpoint, as one JSON list (unambiguous), hashed.
* the prefix keys: a chain over the request's units, ``h0`` = H(scope + the canonical JSON of
  what is rendered before the units), ``h_i`` = H(``h_{i-1}`` + unit i). The units: for chat,
  each message as the client sent it (canonical JSON); for a completion's text prompt, its
  consecutive :data:`TEXT_CHUNK`-character chunks, for its token ids its consecutive
  :data:`IDS_CHUNK`-id chunks (whole chunks only: the rest is no unit). A next turn (the
  messages so far, the answer and the new ones; or the prompt, the answer and more) begins with
  the units of the turn before, so its chain holds that turn's last key, its ``conversation``.

H is blake2b with a 16-byte digest (32 lowercase hex digits, ``pd_wire.handoff.KEY_PATTERN``),
keyed with a key derived from the decode servers' API key (``--decode-api-key-file``; empty
without one): every router in front of the same decode servers computes the same keys, and a
client cannot compute another tenant's. The keys only choose a server; the KV itself is matched
on token ids by the decode server. Canonical JSON is ``json.dumps(sort_keys=True,
separators=(",", ":"))``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pd_wire.handoff import KeepKey
from pd_wire.requests import Endpoint

DIGEST_BYTES = 16
TEXT_CHUNK = 256  # characters of a completion's text prompt per unit
IDS_CHUNK = 64  # token ids of a completion's token-id prompt per unit
MAX_UNITS = 4096  # a longer chain: no keys (no keep, no preference)
# what a chat template renders before (or around) the messages: part of h0
CHAT_PREAMBLE = ("tools", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                 "documents")


def secret(decode_api_key: str | None) -> bytes:
    """The key of every hash (blake2b's ``key``, at most 64 bytes): derived from the decode
    servers' API key, which all routers in front of them share; empty without one."""
    if not decode_api_key:
        return b""
    return hashlib.blake2b(decode_api_key.encode(), digest_size=32, person=b"pd-router-keep").digest()


@dataclass(frozen=True)
class ConversationKeys:
    """A request's keys: its ``scope``, and its prefix keys (key -> index in the chain, 1 for
    the first unit; ``h0``, which covers no unit, is left out), the last of which is its
    ``conversation``."""

    scope: str
    prefixes: dict[str, int]
    conversation: str

    def keep(self, continues: str | None = None) -> KeepKey:
        """The decode request's ``HandoffClaim.keep``: keep this answer's KV as ``conversation``,
        continuing the kept key ``continues`` when the server keeps one the router chose it for."""
        return KeepKey(scope=self.scope, conversation=self.conversation, continues=continues)


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _hash(key: bytes, *parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, key=key)
    for part in parts:
        h.update(part)
    return h.hexdigest()


def _one_prompt(prompt: Any) -> str | list[int] | None:
    """A completion's one prompt (a list of one is one), None for a list of several or another shape."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


def _units(endpoint: Endpoint, body: Mapping[str, Any]) -> tuple[bytes, list[bytes]] | None:
    """What h0 covers (canonical JSON) and the units, or None when the request has no units
    the router keys (several prompts, an unknown shape, more than :data:`MAX_UNITS`)."""
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or len(messages) > MAX_UNITS:
            return None
        preamble = {k: body[k] for k in CHAT_PREAMBLE if body.get(k) is not None}
        return _canonical(preamble), [_canonical(m) for m in messages]
    prompt = _one_prompt(body.get("prompt"))
    if isinstance(prompt, str):
        count = len(prompt) // TEXT_CHUNK
        if count > MAX_UNITS:
            return None
        return _canonical({"prompt": "text"}), [
            prompt[i * TEXT_CHUNK:(i + 1) * TEXT_CHUNK].encode("utf-8", "surrogatepass") for i in range(count)]
    if isinstance(prompt, list):
        count = len(prompt) // IDS_CHUNK
        if count > MAX_UNITS:
            return None
        return _canonical({"prompt": "ids"}), [_canonical(prompt[i * IDS_CHUNK:(i + 1) * IDS_CHUNK])
                                               for i in range(count)]
    return None


def chain(key: bytes, scope: str, preamble: bytes, units: Sequence[bytes]) -> list[str]:
    """The prefix keys h1..hn of ``units`` (h0 covers ``preamble`` within ``scope``)."""
    prev = _hash(key, scope.encode(), preamble)
    keys = []
    for unit in units:
        prev = _hash(key, prev.encode(), unit)
        keys.append(prev)
    return keys


def conversation_keys(key: bytes, tenant: str, endpoint: Endpoint, model: str,
                      body: Mapping[str, Any]) -> ConversationKeys | None:
    """The request's keys (``key``: :func:`secret`'s; ``model``: the served model), or None when
    it has none: no unit (no message; a prompt shorter than one chunk), several prompts, or
    more than :data:`MAX_UNITS` units."""
    found = _units(endpoint, body)
    if found is None or not found[1]:
        return None
    scope = _hash(key, _canonical([tenant, body.get("cache_salt"), model, endpoint.value]))
    keys = chain(key, scope, *found)
    return ConversationKeys(scope, {k: i for i, k in enumerate(keys, 1)}, keys[-1])
