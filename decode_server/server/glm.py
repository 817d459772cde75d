"""GLM chat output parsing: ``<think>..</think>`` -> ``reasoning`` (vLLM 0.32's field) and
``<tool_call>..</tool_call>`` -> ``tool_calls``, incrementally over text deltas.

GLM-4.5..5 tool-call body: ``name<arg_key>k</arg_key><arg_value>v</arg_value>...``
(newlines between the parts allowed). Argument values are strings unless the tool's
JSON schema gives the parameter a non-string type, in which case they are read as JSON
when they parse. With reasoning on, generation starts inside the reasoning block (GLM
templates open ``<think>`` in the prompt), as vLLM's GLM parser does; with tool calls
parsed and no reasoning parser, a ``<think>..</think>`` block is dropped from the content
(tool calls in it still count), as vLLM's GLM-4.7 tool parser drops it. Special tokens
other than GLM's markers (:data:`pd_grammar.tool_calls.MARKERS`) never reach the parser: the detokenizer leaves
them out (:class:`decode_server.server.text.IncrementalDetokenizer`), as vLLM's parser
leaves them out of reasoning and content.

As vLLM's GLM-4.7 parser (checked on generated token streams by
tests/decode_server/test_glm_vs_vllm.py): a call whose name is not one of the request's
tools is dropped (neither a call nor text); the reasoning's trailing whitespace is
dropped; a call cut off by the end of generation
becomes a call with the arguments completed so far; streamed content is every text
outside the calls, while a whole (non-streamed) message with calls keeps only the text
before the first call, stripped (:meth:`GlmChatParser.message_content`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from decode_server.server.stops import partial_suffix_len
from pd_grammar.tool_calls import CALL_BEGIN, CALL_END, THINK_END, THINK_START

_ARG_RE = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

_REASONING, _CONTENT, _TOOL = "reasoning", "content", "tool"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@dataclass
class ChatPiece:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def _param_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, str]]:
    types: dict[str, dict[str, str]] = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        props = (fn.get("parameters") or {}).get("properties") or {}
        types[fn["name"]] = {k: str(v.get("type", "string")) for k, v in props.items() if isinstance(v, dict)}
    return types


def parse_tool_call(body: str, param_types: dict[str, dict[str, str]]) -> ToolCall | None:
    """One ``<tool_call>`` body -> a ToolCall, or None when it is not a call of one of the
    tools (``param_types``' names)."""
    text = body.strip()
    call_id = f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"  # vLLM's id shape
    cut = text.find("<arg_key>")
    name = (text if cut < 0 else text[:cut]).strip()
    if name not in param_types:
        return None
    types = param_types[name]
    args: dict[str, Any] = {}
    for key, value in _ARG_RE.findall(text):
        key = key.strip()
        args[key] = value
        if types.get(key, "string") != "string":
            try:
                args[key] = json.loads(value)
            except json.JSONDecodeError:
                pass
    return ToolCall(call_id, name, json.dumps(args, ensure_ascii=False))


class GlmChatParser:
    """Feed text deltas, get reasoning / content / complete tool calls back."""

    def __init__(self, reasoning: bool, tools: list[dict[str, Any]] | None) -> None:
        self._reasoning = reasoning
        self._tools_on = tools is not None
        self._types = _param_types(tools)
        self._state = _REASONING if reasoning else _CONTENT
        self._held = ""
        self._tool_body: list[str] = []
        self.num_tool_calls = 0
        self._text: list[str] = []  # all content, as generated
        self._lead: list[str] = []  # content before the first <tool_call>
        self._call_seen = False
        self._reasoning_ws = ""  # trailing whitespace of the reasoning so far (held back)
        self._nonws = False  # some content other than whitespace was streamed
        self._ws_held = ""  # whitespace-only content held back until then

    def message_content(self) -> str | None:
        """The content of the whole message (after :meth:`finish`), as vLLM's
        non-streaming GLM parser answers: with tool calls, the text before the first
        ``<tool_call>``, stripped; with only calls of unknown tools (dropped), the text around
        them; None when nothing but whitespace is left."""
        content = "".join(self._text)
        if not self._call_seen:
            return content
        if self.num_tool_calls:
            return "".join(self._lead).strip() or None
        return content if content.strip() else None

    def _markers(self) -> tuple[str, ...]:
        if self._state == _REASONING:
            return (THINK_START, THINK_END, CALL_BEGIN) if self._tools_on else (THINK_START, THINK_END)
        if self._state == _TOOL:
            return (CALL_END,)
        markers: tuple[str, ...] = (CALL_BEGIN,) if self._tools_on else ()
        return markers + ((THINK_START, THINK_END) if self._reasoning or self._tools_on else ())

    def feed(self, text: str) -> ChatPiece:
        piece = ChatPiece()
        buf = self._held + text
        self._held = ""
        while buf:
            markers = self._markers()
            hits = [(buf.find(m), m) for m in markers if m in buf]
            if not hits:
                keep = partial_suffix_len(buf, markers)
                self._emit(piece, buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep:]
                break
            pos, marker = min(hits)
            self._emit(piece, buf[:pos])
            self._transition(piece, marker)
            buf = buf[pos + len(marker):]
        piece.content = self._hold_whitespace(piece.content)
        return piece

    def _hold_whitespace(self, text: str, last: bool = False) -> str:
        """With tools, as vLLM streams: content that is only whitespace waits for some
        that is not (then goes out before it), and is dropped once a call began."""
        if not self._tools_on or self._nonws:
            return text
        if text.strip():
            self._nonws = True
            out, self._ws_held = self._ws_held + text, ""
            return out
        if self._call_seen:
            self._ws_held = ""
            return ""
        self._ws_held += text
        if last:
            out, self._ws_held = self._ws_held, ""
            return out
        return ""

    def finish(self) -> ChatPiece:
        """End of generation: held text is emitted; a tool call cut off is a call with the
        arguments completed so far (dropped when its name is not complete)."""
        piece = ChatPiece()
        held, self._held = self._held, ""
        if self._state == _TOOL:
            self._tool_body.append(held)
            self._transition(piece, CALL_END)
        else:
            self._emit(piece, held)
        piece.content = self._hold_whitespace(piece.content, last=True)
        return piece

    def _emit(self, piece: ChatPiece, text: str) -> None:
        if not text:
            return
        if self._state == _REASONING:  # trailing whitespace goes out only if more reasoning follows
            if not self._reasoning:
                return  # a thinking block without a reasoning parser: dropped
            text = self._reasoning_ws + text
            kept = text.rstrip()
            self._reasoning_ws = text[len(kept):]
            piece.reasoning += kept
        elif self._state == _TOOL:
            self._tool_body.append(text)
        else:
            piece.content += text
            self._text.append(text)
            if not self._call_seen:
                self._lead.append(text)

    def _transition(self, piece: ChatPiece, marker: str) -> None:
        if marker == THINK_START:
            self._state = _REASONING
        elif marker == THINK_END:
            self._state = _CONTENT
        elif marker == CALL_BEGIN:
            self._call_seen = True
            self._state = _TOOL
            self._tool_body = []
        elif marker == CALL_END:
            body = "".join(self._tool_body)
            self._tool_body = []
            self._state = _CONTENT
            call = parse_tool_call(body, self._types)
            if call is not None:  # else dropped, as vLLM drops a call of an unknown tool
                piece.tool_calls.append(call)
                self.num_tool_calls += 1

