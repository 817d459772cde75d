"""The decode-server HTTP contract: what a decode server serves and its clients (the
router, the local launcher) read. Wire types only: this module imports pydantic,
:mod:`pd_wire.errors` and :mod:`pd_wire.handoff`, nothing else.

A decode server speaks the OpenAI API itself:

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` take the client's
  original body plus ``kv_transfer_params`` (the router's :class:`pd_wire.handoff.HandoffClaim`,
  sent before the prefill: its slot is held by this request, see "Slots" below; or a
  :class:`pd_wire.handoff.HandoffResult` from a client that prefilled elsewhere) and answer
  exactly as an OpenAI server would (SSE when ``stream`` is true, else one JSON body; errors
  OpenAI-shaped). The router relays these bytes unchanged. The request id travels in the
  ``X-Request-Id`` header on both legs.
* ``GET  {CAPABILITIES_PATH}`` -> :class:`DecodeCapabilities` (ours only; a server
  answering 404 here, e.g. plain vLLM, is treated as having ``--decode-slots`` slots).
* ``POST {CANCEL_PATH}`` with :class:`CancelRequest` -> :class:`CancelResponse`:
  stop the generation of that request's handoff (``handoff_id``, default the request id)
  and answer once its slot and KV are free; with no generation under that handoff, take
  its decode request out of the queue and free the handoff in the KV receiver
  (idempotent; ``cancelled`` says whether a generation was stopped).
* ``GET /health`` (liveness) and ``GET /ready`` (engine loaded, KV receiver listening).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pd_wire.errors import ErrorBody, ErrorDetail
from pd_wire.handoff import PeerStatus

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
    features: EngineFeatures = Field(default_factory=EngineFeatures)
    sampling_defaults: SamplingDefaults = Field(default_factory=SamplingDefaults)
    share_clock: dict[int, float] = Field(default_factory=dict, description="per priority class, the largest "
                                          "fair-share tag this server granted a slot to (SlotWait.share): the "
                                          "routers' common virtual clock")
    kept: list[str] = Field(default_factory=list, max_length=1024, description="the conversation keys "
                            "(pd_wire.handoff.KeepKey.conversation) of the sequences whose KV this server keeps "
                            "in its free slots, at most one per slot: a request continuing one of them reuses "
                            "its KV there")


# ---- slots ----------------------------------------------------------------------------------
# A decode request whose ``kv_transfer_params`` is a HandoffClaim holds its slot itself: it
# takes a free slot when it arrives, or 429 at once when none is free or requests wait in the
# queue (they came first). With ``HandoffClaim.wait`` (:class:`pd_wire.handoff.SlotWait`) it
# waits in the server's queue instead, in arrival order across routers (closing it leaves the
# queue): 429 when its wait runs out or the queue is full. 409 when its handoff id is held or
# queued here already, 503 draining. Taken, the server answers at once: status 200 and its
# headers, before the KV lands; the router learns that the server is alive and the slot is the
# request's, and sends the prefill. The slot is held while the request is open: the client
# closing it frees the slot. A refusal that comes after the 200 (no KV within the server's KV
# timeout, a prompt too long for the decode server, the engine failing before the first token)
# is the whole body, one SSE event ``event: pd-error`` whose data is a :class:`DecodeRefusal`:
# the status and OpenAI error body the server would have answered. After the first token,
# failures are the OpenAI error events of any stream. ``SlotWait.replaces`` may name a granted
# decode request of the caller's: that request's answer ends (a ``pd-error`` 499) and its slot
# is handed on to whoever waits longest (a swap).
REFUSAL_EVENT = b"event: pd-error\ndata: "
# on that 200: the server's free slots after this grant, a hint for the router's choice of
# where to send its next request; an integer
FREE_SLOTS_HEADER = "X-PD-Free-Slots"
FREE_SLOTS_FIELD = FREE_SLOTS_HEADER.lower().encode()  # as raw HTTP headers (ASGI, httptools) carry its name


# A decode request whose claim asks for ``progress`` ends each write of its answer with an SSE
# comment line naming the output token ids that write's text and events stand for, one write
# per engine step at least (a step whose tokens add no text, or whose tokens were all past the
# end, still gets its line): ``: pd-tokens 12,345\n``. Bytes after the last line are a write
# not yet whole, or the end of the answer (an error event). In a JSON answer (not streamed)
# the lines come before the JSON body. The caller strips them (pd_router.request.trail).
PROGRESS_PREFIX = b": pd-tokens "


def progress_line(token_ids: list[int]) -> bytes:
    return PROGRESS_PREFIX + ",".join(map(str, token_ids)).encode() + b"\n"


def progress_ids(line: bytes) -> list[int]:
    """The token ids of one progress line (its prefix and newline included or not); ValueError
    for a malformed one."""
    body = line[len(PROGRESS_PREFIX):] if line.startswith(PROGRESS_PREFIX) else line
    body = body.strip()
    return [int(t) for t in body.split(b",")] if body else []


class DecodeRefusal(BaseModel):
    """A refusal after the 200 of a decode request holding its slot (see above)."""

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
