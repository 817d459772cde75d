"""Request bodies of the decode server's OpenAI endpoints: the client's original OpenAI
request plus ``kv_transfer_params`` (a :class:`connector.protocol.HandoffResult`). Unknown
fields are accepted and ignored, as the router forwards the client's body untouched.

The models live in :mod:`pd_wire.requests`, which the router shares (it refuses
what this server would refuse before prefill runs); fields this server cannot honour are
rejected there, with a 400 naming the parameter."""

from __future__ import annotations

from pd_wire.requests import (
    MAX_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
    DecodeRequest,
    Endpoint,
    StreamOptions,
)

__all__ = ["MAX_LOGPROBS", "ChatCompletionRequest", "CompletionRequest", "DecodeRequest", "Endpoint", "StreamOptions"]
