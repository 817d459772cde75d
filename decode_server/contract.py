"""The decode-server HTTP contract: what a decode server serves and its clients (the
router, the local launcher) read. Wire types only: this module imports pydantic and
:mod:`connector.protocol` (the KV handoff's wire types), nothing else of ours.

A decode server speaks the OpenAI API itself:

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` take the client's
  original body plus ``kv_transfer_params`` (a :class:`connector.protocol.HandoffResult`)
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
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from connector.protocol import PeerStatus

CAPABILITIES_PATH = "/v1/pd/capabilities"
CANCEL_PATH = "/v1/pd/cancel"
REQUEST_ID_HEADER = "X-Request-Id"


class EngineFeatures(BaseModel):
    """What a decode engine honours beyond temperature / top-p / top-k sampling, as its
    decode server advertises it (``DecodeCapabilities.features``). One flag per request
    feature; a request needing one that is false is refused with a 400 by
    :func:`decode_server.request_check.unsupported`, in the router before prefill and in
    the decode server itself. A new feature is a new flag, false by default (so an older
    server that does not send it is taken not to support it)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    logprobs: bool = Field(default=False, description="per-token logprobs (logprobs / top_logprobs)")
    penalties: bool = Field(default=False, description="presence_penalty, frequency_penalty, repetition_penalty")
    logit_bias: bool = False
    min_p: bool = False
    seed: bool = Field(default=False, description="a per-request seed (reproducible sampling); without it a "
                       "seed is accepted only for greedy requests, where it changes nothing")


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


class CancelRequest(BaseModel):
    model_config = ConfigDict(frozen=True)

    request_id: str = Field(min_length=1)
    handoff_id: str | None = Field(default=None, min_length=1, description="the attempt's handoff; "
                                   "default: the request id")


class CancelResponse(BaseModel):
    model_config = ConfigDict(frozen=True)

    request_id: str
    cancelled: bool
