"""The decode-server HTTP contract: what a decode server serves and its clients (the
router, the local launcher) read. Wire types only: this module imports pydantic,
:mod:`pd_wire.errors` and :mod:`pd_wire.handoff`, nothing else.

A decode server speaks the OpenAI API itself:

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` take the client's
  original body plus ``kv_transfer_params`` (a :class:`pd_wire.handoff.HandoffResult`)
  and answer exactly as an OpenAI server would (SSE when ``stream`` is true, else
  one JSON body; errors OpenAI-shaped). The router relays these bytes unchanged.
  The request id travels in the ``X-Request-Id`` header on both legs.
* ``GET  {CAPABILITIES_PATH}`` -> :class:`DecodeCapabilities` (ours only; a server
  answering 404 here, e.g. plain vLLM, is treated as having ``--decode-slots`` slots).
* ``POST {CANCEL_PATH}`` with :class:`CancelRequest` -> :class:`CancelResponse`:
  stop the generation of that request id and answer once its slot and KV are free;
  with no generation under that id, free the handoff (``handoff_id``, default the
  request id) in the KV receiver (idempotent; ``cancelled`` says whether a generation
  was stopped).
* ``GET /health`` (liveness) and ``GET /ready`` (engine loaded, KV receiver listening).

A decode request whose ``kv_transfer_params`` is a :class:`pd_wire.handoff.HandoffClaim`
with ``grant_first`` holds its slot itself (no lease was asked for it, see "Slots held by
the decode request" below).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pd_wire.errors import ErrorBody, ErrorDetail
from pd_wire.handoff import PeerStatus, SlotWait

CAPABILITIES_PATH = "/v1/pd/capabilities"
# the result of a claim whose result is "posted" (HandoffClaim.result): a HandoffResult as the
# router completed it from vLLM's answer (prefill_logprobs, prompt_token_ids); 204 once the request
# waiting under that handoff has it, 404 when none waits here (or its KV never came), 400 invalid
RESULT_PATH = "/v1/pd/result"
CANCEL_PATH = "/v1/pd/cancel"
REQUEST_ID_HEADER = "X-Request-Id"


class EngineFeatures(BaseModel):
    """What a decode engine honours beyond temperature / top-p / top-k sampling, as its
    decode server advertises it (``DecodeCapabilities.features``). One flag per request
    feature; a request needing one that is false is refused with a 400 by
    :func:`pd_wire.requests.unsupported`, in the router before prefill and in
    the decode server itself. A new feature is a new flag, false by default (so an older
    server that does not send it is taken not to support it)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    logprobs: bool = Field(default=False, description="per-token logprobs (logprobs / top_logprobs)")
    penalties: bool = Field(default=False, description="presence_penalty, frequency_penalty, repetition_penalty")
    logit_bias: bool = False
    min_p: bool = False
    seed: bool = Field(default=False, description="a per-request seed (reproducible sampling); without it a "
                       "seed is accepted only for greedy requests, where it changes nothing")
    structured_output: bool = Field(default=False, description="grammar-constrained decoding: response_format "
                                    "json_object / json_schema, tool_choice required or a named function")


class SamplingDefaults(BaseModel):
    """The checkpoint's ``generation_config.json`` sampling defaults the decode server applies
    to a field the request leaves unset (as vLLM's ``--generation-config auto`` does); None:
    the request's value or vLLM's neutral one."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


class DecodeCapabilities(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    protocol_version: int
    model: str
    engine: str = Field(description="'reference' or 'tilert'")
    slots: int = Field(ge=1, description="concurrent sequences; 1 for TileRT")
    busy_slots: int = Field(ge=0)
    kv_busy_slots: int = Field(default=0, ge=0, description="KV receive slots holding a handoff (admitted, "
                               "complete or being injected)")
    max_seq_len: int = Field(ge=1)
    num_mtp: int = Field(ge=0)
    kv_endpoint: str = Field(description="host:port of the KV control endpoint (HandoffTarget.kv_endpoint)")
    layout_fingerprint: str
    peers: list[PeerStatus] = Field(default_factory=list)
    lease_ttl_s: float | None = Field(default=None, description="the server grants slot leases (LEASE_PATH) "
                                      "lasting this long unless renewed; None: it does not (count slots locally)")
    features: EngineFeatures = Field(default_factory=EngineFeatures)
    sampling_defaults: SamplingDefaults = Field(default_factory=SamplingDefaults)


# ---- slots held by the decode request ------------------------------------------------------
# A claim with ``grant_first`` takes a free slot when the request arrives (or finds the slot its
# KV took, when the prefill's admission came first), as a request without a lease does: 429 at
# once when no slot is free or requests wait in the lease queue (they came first). Taken, the
# server answers at once: status 200 and its headers, before the KV lands; the router learns
# that the server is alive and the slot is held. The slot is held while the request is open:
# the client closing it frees the slot (no lease, no renewal). A refusal that comes after the
# 200 (no KV within the server's KV timeout, a prompt too long for the decode server, the
# engine failing before the first token) is the whole body, one SSE event ``event: pd-error``
# whose data is a :class:`DecodeRefusal`: the status and OpenAI error body the server would
# have answered. After the first token, failures are the OpenAI error events of any stream.
# With ``HandoffClaim.wait`` (:class:`pd_wire.handoff.SlotWait`) a claim that finds no free
# slot waits in the server's queue as a lease request does (arrival order across routers,
# closing it leaves the queue): 429 when its wait runs out or the queue is full, 409 when its
# handoff id is held or queued, 503 draining; its 200 comes at the grant. Its ``replaces`` may
# name a lease or a granted decode request of the caller's: that request's answer ends (a
# ``pd-error`` 499) and its slot is handed on as a lease's is.
REFUSAL_EVENT = b"event: pd-error\ndata: "
# on that 200: the server's free slots after this grant (as LeaseGrant.free), a hint for the router's
# choice of where to send its next request; an integer
FREE_SLOTS_HEADER = "X-PD-Free-Slots"
FREE_SLOTS_FIELD = FREE_SLOTS_HEADER.lower().encode()  # as raw HTTP headers (ASGI, httptools) carry its name


class DecodeRefusal(BaseModel):
    """A refusal after the 200 of a slot held by its request (see above)."""

    model_config = ConfigDict(frozen=True)

    status: int = Field(ge=400, le=599)
    error: ErrorDetail = Field(description="the OpenAI error object the status would have carried")

    def error_body(self) -> bytes:
        return ErrorBody(error=self.error).model_dump_json().encode()

    def event(self) -> bytes:
        return REFUSAL_EVENT + self.model_dump_json().encode() + b"\n\n"

    @classmethod
    def of_event(cls, data: bytes) -> DecodeRefusal | None:
        """The refusal a body holds, None when the body is not one."""
        if not data.startswith(REFUSAL_EVENT):
            return None
        return cls.model_validate_json(data[len(REFUSAL_EVENT):].strip())


class CancelRequest(BaseModel):
    model_config = ConfigDict(frozen=True)

    request_id: str = Field(min_length=1)
    handoff_id: str | None = Field(default=None, min_length=1, description="the attempt's handoff; "
                                   "default: the request id")


class CancelResponse(BaseModel):
    model_config = ConfigDict(frozen=True)

    request_id: str
    cancelled: bool


# ---- decode slot leases --------------------------------------------------------------------
# The decode server owns its slots; a router holds one by a lease from before prefill until
# the generation ends (docs/architecture.md, "Decode slot leases"). The lease id is the
# attempt's handoff id (HandoffTarget.handoff_id): the KV that prefill pushes under that id
# and the generation request that names it in kv_transfer_params land on the leased slot.
#
# * ``POST {LEASE_PATH}`` with :class:`LeaseRequest` -> :class:`LeaseGrant` (200), or an
#   OpenAI-shaped 429 (no free slot within ``wait_s``, or the queue is full; Retry-After), 409
#   (the id is already leased or queued here), 503 (not ready, draining). A request that
#   finds no free slot waits in the server's queue for at most ``wait_s``, ordered by its
#   arrival at its router (``arrived_at`` on the router's clock, put on the server's clock with
#   the smallest ``receipt - sent_at`` seen from that holder); closing the connection leaves
#   the queue. ``replaces``: a lease the caller holds here and gives back as this request joins
#   the queue, in one step (a router's standing request granted for a request it already
#   served elsewhere passes to the request now at the head of its queue: the slot goes to
#   whoever waits longest here, this request included); with ``wait_s`` 0 the request is
#   granted that slot at once or refused at once (429), never left in the queue.
# * ``POST {LEASE_RENEW_PATH}`` with :class:`LeaseIds` -> :class:`LeaseRenewed`.
# * ``POST {LEASE_RELEASE_PATH}`` with :class:`LeaseIds` -> :class:`LeaseReleased`: ends the
#   leases (and takes queued requests of those ids out of the queue); idempotent. A lease
#   also ends when the generation bound to it ends, when the cancel endpoint names its
#   handoff, and when it is not renewed within ``ttl_s``.
LEASE_PATH = "/v1/pd/lease"
LEASE_RENEW_PATH = "/v1/pd/lease/renew"
LEASE_RELEASE_PATH = "/v1/pd/lease/release"
LEASE_ID = Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")


class LeaseRequest(SlotWait):
    model_config = ConfigDict(frozen=True)

    lease_id: str = LEASE_ID


class LeaseGrant(BaseModel):
    model_config = ConfigDict(frozen=True)

    lease_id: str
    slot: int = Field(ge=0)
    ttl_s: float = Field(gt=0, description="the lease ends unless renewed within this")
    free: int = Field(ge=0, description="free slots left after this grant")
    queued: int = Field(ge=0, description="requests waiting in this server's queue")


class LeaseIds(BaseModel):
    model_config = ConfigDict(frozen=True)

    lease_ids: list[str] = Field(max_length=4096)


class LeaseRenewed(BaseModel):
    model_config = ConfigDict(frozen=True)

    ttl_s: float
    unknown: list[str] = Field(description="ids with no live lease here (expired, ended or never granted)")


class LeaseReleased(BaseModel):
    model_config = ConfigDict(frozen=True)

    released: int = Field(ge=0, description="leases and queued requests ended by this call")
    free: int = Field(ge=0)
