"""The KV channel's messages: connector sender <-> decode server receiver (the connector's
two halves: :mod:`connector.sender` and :mod:`connector.receiver`).

The single definition of every message on that channel. It imports only pydantic and
:mod:`pd_wire` (whose ``PROTOCOL_VERSION`` the handshake compares), so the scheduler side
of the connector (running inside stock vLLM) imports it without torch or NIXL. What the
router, vLLM and the decode server pass one another in ``kv_transfer_params`` is
:mod:`pd_wire.handoff`.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from pd_wire.handoff import HandoffResult

# --------------------------------------------------------------------------------------
# KV control channel (connector sender <-> decode server receiver).
#
# Frames are a 4-byte big-endian length followed by one JSON-encoded ControlMessage
# (see connector/control.py). The sender opens the connection and sends Hello; the
# receiver answers Welcome or Reject. Afterwards the sender sends Admit / Abort /
# Prefilled, the receiver answers Admitted / Refused / Aborted / Noted. KV bytes travel over the data
# transport (NIXL WRITEs into the receive buffer); each WRITE carries a LayersDone
# notification, and the receiver completes a handoff once every layer arrived.
# --------------------------------------------------------------------------------------


class PlaneSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    dtype: str
    bytes_per_token: int = Field(ge=0)
    bytes_per_page: int = Field(ge=0)
    page_tokens: int = Field(ge=0)


class LayoutFingerprint(BaseModel):
    """What both sides must agree on before any KV byte moves."""

    model_config = ConfigDict(frozen=True)

    profile: str
    num_layers: int = Field(ge=1, description="main + MTP layers")
    num_mtp_layers: int = Field(ge=0)
    planes: list[PlaneSpec]
    sender_world_size: int = Field(default=1, ge=1, description="informational: ranks sending layers")


# Fields compared by the handshake, in this order (sender_world_size is informational).
_COMPARED_PLANE_FIELDS = ("name", "dtype", "bytes_per_token", "bytes_per_page", "page_tokens")


def fingerprint_mismatch(expected: LayoutFingerprint, received: LayoutFingerprint) -> tuple[str, str, str] | None:
    """First differing field as ``(field, expected, received)``, or None when compatible."""
    for name in ("profile", "num_layers", "num_mtp_layers"):
        a, b = getattr(expected, name), getattr(received, name)
        if a != b:
            return name, str(a), str(b)
    if len(expected.planes) != len(received.planes):
        return ("planes", ",".join(p.name for p in expected.planes), ",".join(p.name for p in received.planes))
    for i, (pa, pb) in enumerate(zip(expected.planes, received.planes)):
        for name in _COMPARED_PLANE_FIELDS:
            a, b = getattr(pa, name), getattr(pb, name)
            if a != b:
                return f"planes[{i}].{name}", str(a), str(b)
    return None


def handshake_mismatch(*, decode_version: int, decode_transport: str, decode_fingerprint: LayoutFingerprint,
                       prefill_version: int, prefill_transport: str,
                       prefill_fingerprint: LayoutFingerprint) -> tuple[str, str, str] | None:
    """The one handshake check, made by the receiver on a Hello and by the senders on a
    Welcome: the first difference between what the decode side has (expected) and what the
    prefill side announces (received), as ``(field, expected, received)``: protocol
    version, data transport kind, then the layout fingerprint field by field. None: compatible."""
    if decode_version != prefill_version:
        return "protocol_version", str(decode_version), str(prefill_version)
    if decode_transport != prefill_transport:
        return "transport", decode_transport, prefill_transport
    return fingerprint_mismatch(decode_fingerprint, prefill_fingerprint)


# Authentication (protocol 3), before anything else on a connection when the receiver has a
# shared secret (connector/kv_auth.py): the sender sends AuthStart with a fresh nonce; the
# receiver answers AuthChallenge with its own fresh nonce and its proof; the sender checks it
# and answers AuthProof; the receiver answers AuthOk, or AuthFailed (then closes). Proofs are
# HMAC-SHA256 of both nonces under the secret, with a different label for each side.
_NONCE = Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")
_PROOF = Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")


class AuthStart(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: Literal["auth_start"] = "auth_start"
    nonce: str = _NONCE


class AuthChallenge(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: Literal["auth_challenge"] = "auth_challenge"
    nonce: str = _NONCE
    proof: str = _PROOF


class AuthProof(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: Literal["auth_proof"] = "auth_proof"
    proof: str = _PROOF


class AuthOk(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: Literal["auth_ok"] = "auth_ok"


class AuthFailed(BaseModel):
    """The receiver refused to authenticate this connection (it closes it); says what the
    sender must fix, never what was expected."""

    model_config = ConfigDict(frozen=True)

    type: Literal["auth_failed"] = "auth_failed"
    message: str


class Hello(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: Literal["hello"] = "hello"
    protocol_version: int
    agent_name: str = Field(min_length=1, max_length=256)
    fingerprint: LayoutFingerprint
    transport: str = Field(default="nixl", description="the sender's data transport kind")
    agent_metadata: str = Field(default="", description="base64 of the sender's agent metadata (for Revoked)")
    # Agents of one prefill instance share a group: its scheduler admits handoffs (control
    # only, no metadata), its workers' agents write them. Empty: a group of its own.
    group: str = Field(default="", max_length=256)


class Welcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: Literal["welcome"] = "welcome"
    protocol_version: int
    agent_name: str
    fingerprint: LayoutFingerprint
    transport: str = Field(description="the receiver's data transport kind ('nixl'); both sides must use the same")
    agent_metadata: str = Field(description="base64 of the receiver's transport agent metadata")
    buffer_descs: str = Field(description="base64 of the receive-buffer regions (see connector.transport)")
    max_tokens: int = Field(ge=1)
    slots: int = Field(ge=1)


class Reject(BaseModel):
    """A Hello the receiver cannot work with: which field and what the sender sent. What the
    receiver expected stays in its own log and capabilities (not told to whoever connects)."""

    model_config = ConfigDict(frozen=True)

    type: Literal["reject"] = "reject"
    field: str
    received: str
    message: str


class Admit(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: Literal["admit"] = "admit"
    handoff_id: str = Field(min_length=1, max_length=256)
    num_tokens: int = Field(ge=1)
    rank: int = Field(default=0, ge=0)
    # The sender's name for this try: an Abort naming it also cancels an Admit of that try
    # still unread (the sender gave up waiting for the answer, e.g. a stopped decode server).
    attempt: str = Field(default="", max_length=64)
    # The prompt's token ids as the decode server compares them with the sequence it keeps
    # (connector/prefix.py): the chained hashes of its full 64-token blocks, and its ids past
    # them. Empty: the sender offers no prefix (the whole KV is written).
    prefix: list[Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]] = Field(default_factory=list,
                                                                           max_length=16384)
    tail: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=63)


class Admitted(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: Literal["admitted"] = "admitted"
    handoff_id: str
    slot: int = Field(ge=0)
    # offsets[layer][plane]: byte offset of that plane of that layer from the start of
    # the receive buffer's first region; each plane holds exactly nbytes(num_tokens).
    offsets: list[list[int]]
    # The prompt's leading tokens whose KV the decode server keeps (a whole number of the
    # prefix's blocks, below num_tokens): the sender writes only each plane's bytes past them.
    reused: int = Field(default=0, ge=0)


RefusalReason = Literal["busy", "too_long", "unknown_peer", "duplicate", "cancelled"]
REFUSAL_REASONS: tuple[str, ...] = get_args(RefusalReason)


class Refused(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: Literal["refused"] = "refused"
    handoff_id: str
    reason: RefusalReason
    message: str


class Abort(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: Literal["abort"] = "abort"
    handoff_id: str
    reason: str
    attempt: str = Field(default="", max_length=64, description="only that try of the handoff (see Admit)")


class Aborted(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: Literal["aborted"] = "aborted"
    handoff_id: str
    known: bool = Field(description="whether the receiver still held that handoff")


class Prefilled(BaseModel):
    """Sender (vLLM's scheduler side) -> receiver, after the handoff's Admitted on the same
    connection, when vLLM finished the prefill: its :class:`~pd_wire.handoff.HandoffResult`
    (the first token, the prompt's last token, how the layers left). Sent only for a handoff
    whose target asked for it (``HandoffTarget.result_with_kv``): its decode request names
    only the handoff and starts once this and the last layer have landed."""

    model_config = ConfigDict(frozen=True)

    type: Literal["prefilled"] = "prefilled"
    result: HandoffResult
    attempt: str = Field(default="", max_length=64, description="the try that admitted it (see Admit)")


class Noted(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: Literal["noted"] = "noted"
    handoff_id: str
    known: bool = Field(description="whether the receiver held that handoff (else the result was dropped)")


ControlMessage = Annotated[
    AuthStart | AuthChallenge | AuthProof | AuthOk | AuthFailed
    | Hello | Welcome | Reject | Admit | Admitted | Refused | Abort | Aborted | Prefilled | Noted,
    Field(discriminator="type"),
]


class LayersDone(BaseModel):
    """Sender -> receiver, attached to a KV WRITE: these layers of that handoff have landed."""

    model_config = ConfigDict(frozen=True)

    type: Literal["layers_done"] = "layers_done"
    handoff_id: str
    layers: list[int]


class Revoked(BaseModel):
    """Receiver -> sender, a standalone transport notification: the receiver gave up on
    that handoff (timed out, stopped) and freed its slot; the sender must stop writing."""

    model_config = ConfigDict(frozen=True)

    type: Literal["revoked"] = "revoked"
    handoff_id: str
    reason: str


Notification = Annotated[LayersDone | Revoked, Field(discriminator="type")]
