"""The bounds on every count and size a client gives in a generation request: one
definition for the router (every API it serves) and the decode server.

Each is checked when the body is validated (:mod:`pd_wire.requests`), before anything
proportional to the client's number is built or allocated: a request past one is a 400
that names the field and its bound. What the body's size already bounds (its JSON text is
read only up to the router's ``--max-body-bytes``) is bounded here too where the work per
item is more than reading it: each stop string is looked for after every token, each
logit bias is a tensor entry, each tool is rendered into the prompt, each message and its
content parts are templated. The choices of one request (``n`` times a completion's
prompts) are the router's ``--max-choices``, checked from the two numbers before any
choice's request is made (:mod:`pd_router.request.fanout`); ``max_tokens`` is also checked against
the model's context (the decode servers' ``max_seq_len``) by the router before prefill,
and against the prompt's length by the decode server when the KV lands.

The numbers are generous for what clients send (coding agents send tens of tools and
hundreds of messages; OpenAI allows 4 stop strings and 128 tools) and small against what
one request may make the servers do. ``docs/reliability.md`` lists them.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

MAX_INT32 = 2**31 - 1  # the largest token count or token id any field may name
MAX_STOP_SEQUENCES = 64  # ``stop``: strings looked for after every token
MAX_STOP_CHARS = 1024  # the length of one stop string
MAX_STOP_TOKEN_IDS = 1024  # ``stop_token_ids``
MAX_LOGIT_BIAS = 1024  # ``logit_bias`` entries
MAX_TOOLS = 512  # ``tools`` (function definitions rendered into the prompt)
MAX_MESSAGES = 16384  # ``messages`` of a chat, ``input`` items of a response
MAX_CONTENT_PARTS = 1024  # parts of one message's content (and tool calls of one message)
MAX_PROMPT_TOKEN_IDS = 1 << 21  # one prompt given as token ids (2M; GLM-5.1's context is 200k)


def too_many(what: str, got: Sized, most: int) -> str | None:
    """The message of a list or map over its bound (None when within)."""
    count = len(got)
    return None if count <= most else f"at most {most} {what} (got {count})"


def content_parts_refusal(messages: list[Any]) -> str | None:
    """Why the first message whose content parts or tool calls are over their bound, or whose
    content parts are not objects (a list nested in a list: no API has one), is refused,
    starting with its place (``0.content``)."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        for key, what in (("content", "content parts"), ("tool_calls", "tool calls")):
            value = message.get(key)
            if not isinstance(value, list):
                continue
            if len(value) > MAX_CONTENT_PARTS:
                return f"{i}.{key}: at most {MAX_CONTENT_PARTS} {what} in one message (got {len(value)})"
            for j, part in enumerate(value):
                if isinstance(part, list):
                    return f"{i}.{key}.{j}: one of the {what} is a list, not an object"
    return None
