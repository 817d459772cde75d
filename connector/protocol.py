"""Wire types shared by the router, the prefill connector and the decode server.

This module is the single definition of every message that crosses a process
boundary on the KV handoff path. It imports only pydantic, so the scheduler side
of the connector (running inside stock vLLM) and the router can import it without
torch or NIXL.

Flow of ``kv_transfer_params`` for one request::

    router  --HandoffTarget-->  vLLM prefill (TileRTConnector reads it)
    vLLM    --HandoffResult-->  router (in the prefill HTTP response)
    router  --HandoffResult (+ prefill_logprobs)-->  decode server

The KV bytes themselves travel connector -> decode server over NIXL; the control
messages of that channel (hello/welcome/admit/...) are defined here too, by the
connector issue.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PROTOCOL_VERSION = 1

HandoffStatus = Literal["sent", "failed"]


class HandoffTarget(BaseModel):
    """What the router puts in the prefill request's ``kv_transfer_params``.

    The connector only handles requests that carry both fields.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    handoff_id: str = Field(min_length=1, max_length=256)
    kv_endpoint: str = Field(description="host:port of the decode server's KV control endpoint")


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
    # choices[0].logprobs of the prefill response, verbatim (chat or completions
    # shape), for the first generated token; set by the router, None otherwise.
    prefill_logprobs: dict[str, Any] | None = None
