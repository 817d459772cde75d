"""``kv_transfer_params``: what the router, vLLM's prefill (TileRTConnector) and the decode
server pass one another about a request's KV handoff, and the protocol version all three
must speak.

Flow for one request: the decode request goes first and holds its slot (its 200 is the
slot's take, at once or after a wait in the server's queue), then the prefill, with the
first token traveling with the KV (``HandoffTarget.result_with_kv``)::

    router  --HandoffClaim-->  decode server (200 once the slot is the request's; it waits for the KV)
    router  --HandoffTarget-->  vLLM prefill (TileRTConnector reads it)
    vLLM (the connector)  --HandoffResult-->  decode server (over the KV channel, Prefilled)
    vLLM    --HandoffResult-->  router (in the prefill HTTP response: failures and usage)

or, for a request whose decode needs the prefill's answer (its first token's logprobs, the
prompt's token ids), the result the router read from vLLM's answer, posted
(``HandoffClaim.result == "posted"``, :data:`pd_wire.decode.RESULT_PATH`). A client of the
decode server's own API that prefilled elsewhere sends a :class:`HandoffResult` instead.

The KV bytes travel connector -> decode server over NIXL; that channel's own messages
(hello, admit, prefilled, ...) are the connector's (:mod:`connector.protocol`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Version 11: every decode request holds its slot itself (a HandoffClaim; it may wait in the
# server's queue, HandoffClaim.wait, in the order of SlotWait.place: priority, fair share, arrival)
# and is the only way to hold one; its result comes with the KV (Prefilled) or is posted by the
# router (RESULT_PATH); its answer may report its tokens (HandoffClaim.progress) and continue a
# sequence cut elsewhere (HandoffClaim.resume); its server may keep its KV for the conversation's
# next turn (HandoffClaim.keep), whose Admit offers the prompt's prefix and writes only the KV
# past what the slot keeps (Admitted.reused). A router and a decode server of other versions
# refuse to pair (the router's probe, the decode server's 400). The versions before are in git's
# history of this line.
PROTOCOL_VERSION = 11

# "pending": admitted, the KV is on its way (the decode server waits for its last layer);
# "sent": every layer had landed when vLLM answered; "failed": see ``reason`` and ``error``.
HandoffStatus = Literal["sent", "pending", "failed"]
# Why a handoff failed, for the router to act on: "busy" (the decode server had no free
# KV receive slot: wait for a slot and try again), "too_long", "cancelled", "duplicate",
# "unknown_peer" (refusals at admission, :class:`Refused`), "unreachable" (no handshake,
# control channel or answer in time), "rejected" (the handshake found a mismatch),
# "transfer" (a WRITE failed or timed out), "internal".
FailureReason = Literal["busy", "too_long", "cancelled", "duplicate", "unknown_peer", "unreachable", "rejected",
                        "transfer", "internal"]


class HandoffTarget(BaseModel):
    """What the router puts in the prefill request's ``kv_transfer_params``.

    The connector only handles requests that carry both fields.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    handoff_id: str = Field(min_length=1, max_length=256)
    kv_endpoint: str = Field(description="host:port of the decode server's KV control endpoint")
    result_with_kv: bool = Field(default=False, description="send the HandoffResult (the first token) to the "
                                 "decode server over the KV control channel as vLLM finishes the prefill: the "
                                 "decode request is then a HandoffClaim")


class SlotWait(BaseModel):
    """How a decode request waits for its slot in the decode server's queue when no slot is
    free: ordered by ``priority`` (lower first), then ``share`` (its fair-share tag: lower
    first), then its arrival at its router, ``arrived_at`` on the router's monotonic clock put on
    the server's clock with the smallest ``receipt - sent_at`` seen from that ``holder``; closing
    the connection leaves the queue. The router chooses ``priority`` and ``share``
    (docs/router.md, "Who waits for a decode slot"); the server only orders by them."""

    model_config = ConfigDict(frozen=True)

    wait_s: float = Field(default=0.0, ge=0, le=3600, description="how long to wait in the queue (0: a free "
                          "slot now or a refusal)")
    holder: str = Field(default="", max_length=256, description="who asks (a router's name, unique per "
                        "process): its clock is one (arrived_at, sent_at)")
    arrived_at: float = Field(default=0.0, description="when the request came to its router (the holder's "
                              "monotonic clock, seconds): its place in the queue")
    sent_at: float = Field(default=0.0, description="when this request left the router (same clock)")
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1, description="the request's class in the queue: "
                          "lower is served sooner (the router's: the client's priority, or the class of a "
                          "request that waited past the router's aging bound)")
    share: float = Field(default=0.0, allow_inf_nan=False, description="the request's fair-share tag within its "
                         "class (start-time fair queuing over tenants, on the routers' common virtual clock): "
                         "lower is served sooner; equal tags go by arrival")
    tenant: str = Field(default="", max_length=64, description="whose request it is (the queue log's)")
    replaces: str | None = Field(default=None, min_length=1, max_length=256, description="the handoff id of "
                                 "another decode request of the caller's holding a slot on this server, given "
                                 "back once this request is queued: a swap (that request's answer ends, the "
                                 "slot goes to whoever waits longest, this request included; with wait_s 0 "
                                 "this request is granted that slot at once or refused at once, never queued)")


SHARE_CLOCK_CLASSES = 64  # priority classes whose share clock is kept (the most recently advanced)


def advance_share_clock(clock: dict[int, float], priority: int, share: float) -> None:
    """Move ``clock`` (per priority class, the largest :attr:`SlotWait.share` granted a slot: the
    routers' common virtual clock, ``DecodeCapabilities.share_clock``) to ``share`` if it is
    larger. A class starts at 0 (a router's first tags of a class are below it); only the
    :data:`SHARE_CLOCK_CLASSES` most recently advanced classes are kept."""
    if share > clock.get(priority, 0.0):
        clock.pop(priority, None)  # the most recently advanced class last: the first kept
        clock[priority] = share
        if len(clock) > SHARE_CLOCK_CLASSES:
            del clock[next(iter(clock))]


KEY_PATTERN = r"^[0-9a-f]{32}$"  # a 128-bit key as 32 lowercase hex digits


class KeepKey(BaseModel):
    """What a decode request says about the KV its decode server may keep after its answer and
    reuse for the next turn of the same conversation (docs/kv_reuse.md). Both keys are the
    router's, opaque to the decode server, which only compares them for equality: ``scope`` is
    whose KV it is (the tenant and ``cache_salt``), ``conversation`` what it is (the conversation
    so far, as the router sees it: its messages, or its prompt's text or token ids, in blocks).
    A kept sequence serves only a request of the same ``scope``; the match itself is settled on
    token ids by the KV channel (``connector.protocol.Admit.prefix``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scope: str = Field(pattern=KEY_PATTERN, description="the router's key of the tenant and cache_salt")
    conversation: str = Field(pattern=KEY_PATTERN, description="the router's key of the conversation so far: "
                              "a later turn's request holds it among its prefix keys")
    continues: str | None = Field(default=None, pattern=KEY_PATTERN, description="the kept conversation key "
                                  "(DecodeCapabilities.kept) the router chose this server for: the server takes "
                                  "the free slot keeping it, when one does")


class ResumeFrom(BaseModel):
    """A decode request that continues a sequence cut on another decode server (a migration):
    its KV is the prompt's and ``output_token_ids``' (prefilled again), and its answer goes on
    where the lost one's stopped, as one answer with it: the tokens so far run through the
    server's stop conditions, detokenizer and output parsers without being sent again, the
    engine chooses the token at the cut as the uninterrupted sequence would have, and ``usage``
    counts the original prompt and every output token once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    output_token_ids: list[int] = Field(default_factory=list, description="the output tokens the client's "
                                        "answer holds so far, in order (progress lines, "
                                        "pd_wire.decode.PROGRESS_PREFIX); may be empty")
    prompt_tokens: int = Field(ge=1, description="the original prompt's length")
    context_token_id: int = Field(ge=0, description="the original prompt's last token (the detokenizer's "
                                  "left context)")
    prompt_token_ids: list[int] | None = Field(default=None, description="the original prompt's ids (a "
                                               "repetition_penalty counts them)")


class HandoffClaim(BaseModel):
    """A decode request's ``kv_transfer_params`` when it goes before its prefill: it holds its
    slot itself (the decode server answers 200 as soon as the slot is the request's, before the
    KV lands, and puts a refusal that comes later in the body, pd_wire.decode.DecodeRefusal),
    then waits for the KV and the handoff's result, up to its KV timeout, and decodes as with a
    :class:`HandoffResult`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    protocol_version: int = PROTOCOL_VERSION
    handoff_id: str = Field(min_length=1, max_length=256)
    result: Literal["with_kv", "posted"] = Field(description="where the result comes from: the KV control "
                                                 "channel (with_kv), or the router once vLLM answered (posted: "
                                                 "POST pd_wire.decode.RESULT_PATH, with the first token's "
                                                 "logprobs and the prompt's ids when the decode needs them)")
    wait: SlotWait | None = Field(default=None, description="no free slot: the request waits in the server's "
                                  "queue (429 when the wait runs out or the queue is full); its 200 comes at "
                                  "the grant. None: a free slot now or 429")
    progress: bool = Field(default=False, description="the answer reports its output tokens: a progress line "
                           "(pd_wire.decode.progress_line) before every write from the first token on, and one "
                           "for every engine step, so that the caller knows the tokens its client has and "
                           "hears from the server at the engine's pace")
    created: int | None = Field(default=None, ge=0, description="the answer's ``created`` (the caller's, so "
                                "that a migrated answer keeps it); None: the server's clock")
    resume: ResumeFrom | None = None
    keep: KeepKey | None = Field(default=None, description="keep this sequence's KV after a clean end, for the "
                                 "conversation's next turn, and reuse a kept one of the same scope now; None: "
                                 "neither")


class HandoffResult(BaseModel):
    """What the connector returns from ``request_finished``; vLLM echoes it in the
    prefill HTTP response as ``kv_transfer_params`` and the router forwards it to
    the decode server (adding ``prefill_logprobs``). Unknown keys (vLLM adds some)
    are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    protocol_version: int = PROTOCOL_VERSION
    handoff_id: str = Field(min_length=1, max_length=256)
    kv_endpoint: str
    num_prompt_tokens: int = Field(ge=1)
    first_token_id: int = Field(ge=0)
    last_prompt_token_id: int = Field(ge=0)
    status: HandoffStatus
    error: str | None = None
    reason: FailureReason | None = Field(default=None, description="why, when status is 'failed'")
    # How the prefill's layers left: gathered as vLLM computed each one (save_kv_layer,
    # the CPU path) or all at the end of the step (wait_for_save, vLLM's CUDA path for
    # GLM-5.1); summed over tensor-parallel ranks. None when a rank has not reported.
    layers_early: int | None = Field(default=None, ge=0)
    layers_late: int | None = Field(default=None, ge=0)
    # choices[0].logprobs of the prefill response, verbatim (chat or completions
    # shape), for the first generated token; set by the router, None otherwise.
    prefill_logprobs: dict[str, Any] | None = None
    # The prompt's token ids (prefill's answer to return_token_ids), for a decode engine that
    # needs them (repetition_penalty counts prompt tokens); set by the router, None otherwise.
    prompt_token_ids: list[int] | None = None


class PeerStatus(BaseModel):
    """A prefill connector that performed the KV handshake with a decode server's receiver
    (reported by the decode server's capabilities, read by the router's readiness)."""

    model_config = ConfigDict(frozen=True)

    peer: str = Field(description="the connector's agent name")
    state: Literal["ok", "rejected"]
    reason: str | None = Field(default=None, description="why it was rejected")
