"""The decode server's HTTP layer: OpenAI endpoints over a decode engine and the KV
receiver. Start with :func:`create_app`; :mod:`.generation` holds the request
lifecycle (one abort path), :mod:`.sequence` the token -> text logic."""

from decode_server.server.app import AppConfig, DecodeState, create_app
from decode_server.server.errors import ApiError
from decode_server.server.glm import GlmChatParser, ToolCall, parse_tool_call
from decode_server.server.sequence import Delta, SequenceProcessor, StopSpec, TokenLogprob
from decode_server.server.stops import StopStringMatcher
from decode_server.server.text import GenerationDefaults, IncrementalDetokenizer, TextTokenizer

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
