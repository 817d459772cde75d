"""The decode server's HTTP layer: OpenAI endpoints over a decode engine and the KV
receiver. Start with :func:`create_app`; :mod:`.generation` holds the request
lifecycle (one abort path), :mod:`.sequence` the token -> text logic.

The public names below are imported on first use (PEP 562): importing one submodule does
not load the app and FastAPI."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from decode_server.server.api_errors import ApiError
    from decode_server.server.app import create_app
    from decode_server.server.glm import GlmChatParser, ToolCall, parse_tool_call
    from decode_server.server.sequence import Delta, SequenceProcessor, StopSpec, TokenLogprob
    from decode_server.server.state import AppConfig, DecodeState
    from decode_server.server.stops import StopStringMatcher
    from decode_server.server.text import GenerationDefaults, IncrementalDetokenizer, TextTokenizer

_EXPORTS = {
    "ApiError": "decode_server.server.api_errors",
    "AppConfig": "decode_server.server.state",
    "DecodeState": "decode_server.server.state",
    "Delta": "decode_server.server.sequence",
    "GenerationDefaults": "decode_server.server.text",
    "GlmChatParser": "decode_server.server.glm",
    "IncrementalDetokenizer": "decode_server.server.text",
    "SequenceProcessor": "decode_server.server.sequence",
    "StopSpec": "decode_server.server.sequence",
    "StopStringMatcher": "decode_server.server.stops",
    "TextTokenizer": "decode_server.server.text",
    "TokenLogprob": "decode_server.server.sequence",
    "ToolCall": "decode_server.server.glm",
    "create_app": "decode_server.server.app",
    "parse_tool_call": "decode_server.server.glm",
}
__all__ = [
    "ApiError",
    "AppConfig",
    "DecodeState",
    "Delta",
    "GenerationDefaults",
    "GlmChatParser",
    "IncrementalDetokenizer",
    "SequenceProcessor",
    "StopSpec",
    "StopStringMatcher",
    "TextTokenizer",
    "TokenLogprob",
    "ToolCall",
    "create_app",
    "parse_tool_call",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'decode_server.server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
