"""The chat route's answer as an Anthropic Messages answer, as vLLM 0.32's Messages serving gives it.

A ``message`` holds, in order, a ``thinking`` block (the chat message's reasoning, with a
random ``signature``), a ``text`` block (its content), then a ``tool_use`` block per tool call
(``input`` its parsed arguments); an answer with none of them holds one empty ``text`` block.
``stop_reason``: ``max_tokens`` when cut by the bound; else ``tool_use`` when a tool was called
(its arguments complete), ``stop_sequence`` (with ``stop_sequence``) for a stop string,
``end_turn`` otherwise. ``usage`` is the chat usage's ``prompt_tokens`` and
``completion_tokens``. Fields that are null are left out, as vLLM leaves them out.

Streamed, each chat chunk drives vLLM's state machine: ``message_start`` (its usage the first
chunk's), then a content block per run of one kind (``content_block_start``, its
``content_block_delta`` events: ``thinking_delta``, ``text_delta`` or ``input_json_delta``, and
``content_block_stop``; a thinking block ends with a ``signature_delta``); text that comes while
a tool call is open is held and sent as a text block after it. The final usage chunk gives
``message_delta`` (stop reason and usage), ``[DONE]`` ``message_stop``; each event is
``event: TYPE``. An error answer before the stream began is turned into Anthropic's error
shape (``{"type": "error", "error": {"type", "message"}}``, the status kept); after, the
stream ends with an ``error`` event.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel

from pd_router.asgi import SSE, Message, Send, StreamTranslator

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorBody(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail


def error_body(status: int, openai_body: bytes) -> bytes:
    """An OpenAI-shaped error body (the chat route's) in Anthropic's shape."""
    try:
        parsed = json.loads(openai_body)
        message = str(parsed["error"]["message"]) if isinstance(parsed, dict) else str(parsed)
    except (ValueError, KeyError, TypeError):
        message = openai_body.decode("utf-8", "replace")
    return ErrorBody(error=ErrorDetail(type=error_type(status), message=message)).model_dump_json().encode()


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int

    @classmethod
    def of_chat(cls, usage: Any) -> Usage:
        if not isinstance(usage, dict):
            return cls(input_tokens=0, output_tokens=0)
        return cls(input_tokens=int(usage.get("prompt_tokens") or 0),
                   output_tokens=int(usage.get("completion_tokens") or 0))


def stop_reason(finish: str | None, stop: Any, tool_used: bool,
                tool_complete: bool) -> tuple[StopReason | None, str | None]:
    """The chat finish reason as Anthropic's ``(stop_reason, stop_sequence)``: the bound wins;
    complete tool calls are ``tool_use`` even when a stop string ended them; a stop string (the
    chat ``stop_reason`` a string) is ``stop_sequence``."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _signature() -> str:
    return uuid.uuid4().hex


def message_of_chat(chat: dict[str, Any]) -> dict[str, Any]:
    """The ``message`` answer of a chat completion."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls), bool(calls))
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": _signature()})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in calls:
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                        "input": json.loads(fn.get("arguments") or "{}")})
    answer: dict[str, Any] = {"id": chat.get("id"), "type": "message", "role": "assistant",
                              "content": content or [{"type": "text", "text": ""}], "model": chat.get("model"),
                              "stop_reason": reason, "stop_sequence": sequence,
                              "usage": Usage.of_chat(chat.get("usage")).model_dump()}
    return {k: v for k, v in answer.items() if v is not None}


class Translator(StreamTranslator):
    """Wraps the chat route's ASGI ``send``: the chat answer goes out as a Messages API answer,
    an error in Anthropic's shape. ``stream``: the request's (set once it is parsed; an error
    before that is answered whole)."""

    def __init__(self, send: Send) -> None:
        super().__init__(send)
        self.stream = False
        self._error = False
        self._start: Message = {}
        self._body = bytearray()
        # the stream's state
        self._first = True
        self._index = 0  # the next block's index
        self._kind: str | None = None  # the open block's type
        self._tool_id: str | None = None  # the open tool_use block's call id
        self._held: list[str] = []  # text that came while a tool call was open
        self._ids: dict[int, str] = {}  # a tool call's index -> its id
        self._finish: str | None = None
        self._stop: Any = None
        self._tool_used = False
        self._args: list[str] = []  # the last tool call's argument text

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if message["status"] != 200:
                self._error = True
                self._start = message
            elif self.stream:
                await self._send({**message, "headers": [(k, v) for k, v in message["headers"]
                                                         if k not in (b"content-type", b"content-length")]
                                  + [(b"content-type", SSE)]})
            else:
                self._start = message
            return
        data = message.get("body", b"")
        more = message.get("more_body", False)
        if self._error or not self.stream:
            self._body += data
            if not more:
                await self._answer()
            return
        await self._relay(data, more)

    async def _answer(self) -> None:
        if self._error:
            body = error_body(self._start["status"], bytes(self._body))
        else:  # json's escapes: a lone surrogate in the text stays an escape
            body = json.dumps(message_of_chat(json.loads(bytes(self._body)))).encode()
        headers = [(k, v) for k, v in self._start["headers"] if k != b"content-length"]
        await self._send({**self._start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    # ---- the stream ----

    def _event(self, kind: str, **fields: Any) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()

    async def _out(self, events: list[bytes]) -> None:
        if events:
            await self._send({"type": "http.response.body", "body": b"".join(events), "more_body": True})

    async def _chat_event(self, event: bytes) -> None:
        text = event.decode("utf-8", "replace").strip()
        if not text.startswith("data:") or self._closed:
            return
        payload = text[5:].strip()
        out: list[bytes] = []
        if payload == "[DONE]":
            out += self._flush()
            out.append(self._event("message_stop"))
            return await self._out(out)
        chunk = json.loads(payload)
        if "error" in chunk:
            err = chunk["error"] if isinstance(chunk["error"], dict) else {}
            code = str(err.get("code") or "")
            out.append(self._event("error", error={"type": error_type(int(code)) if code.isdigit() else "api_error",
                                                   "message": str(err.get("message", ""))}))
            await self._out(out)
            return await self._end()
        if self._first:
            self._first = False
            out.append(self._event("message_start", message={
                "id": chunk.get("id"), "type": "message", "role": "assistant", "content": [],
                "model": chunk.get("model"), "stop_reason": None, "stop_sequence": None,
                "usage": Usage.of_chat(chunk.get("usage")).model_dump()}))
        choices = chunk.get("choices") or []
        if not choices:  # the usage chunk: the message's end
            out += self._flush()
            reason, sequence = stop_reason(self._finish or "stop", self._stop, self._tool_used,
                                           self._tool_used and _is_json("".join(self._args)))
            out.append(self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                   usage=Usage.of_chat(chunk.get("usage")).model_dump()))
            return await self._out(out)
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self._finish, self._stop = choice["finish_reason"], choice.get("stop_reason")
        delta = choice.get("delta") or {}
        if delta.get("reasoning"):
            if self._kind != "thinking":
                out += self._flush()
                out.append(self._open({"type": "thinking", "thinking": ""}))
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if delta.get("content"):
            if self._kind == "tool_use":
                self._held.append(delta["content"])
            else:
                if self._kind != "text":
                    out += self._flush()
                    out.append(self._open({"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            out += self._tool_call(call)
        await self._out(out)

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        fn = call.get("function") or {}
        call_id = call.get("id")
        if call_id is not None:
            self._ids[call.get("index", 0)] = call_id
            if self._tool_id != call_id and fn.get("name") is not None:
                out += self._flush()
                self._tool_used, self._args = True, []
                out.append(self._open({"type": "tool_use", "id": call_id, "name": fn["name"], "input": {}}))
                self._tool_id = call_id
        else:
            call_id = self._ids.get(call.get("index", 0))
        if fn.get("arguments") and call_id is not None and self._tool_id == call_id:
            self._args.append(fn["arguments"])
            out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def _open(self, block: dict[str, Any]) -> bytes:
        self._kind = block["type"]
        return self._event("content_block_start", index=self._index, content_block=block)

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return self._event("content_block_delta", index=self._index, delta=delta)

    def _close(self) -> list[bytes]:
        if self._kind is None:
            return []
        out = []
        if self._kind == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": _signature()}))
        out.append(self._event("content_block_stop", index=self._index))
        self._kind, self._tool_id = None, None
        self._index += 1
        return out

    def _flush(self) -> list[bytes]:
        """Close the open block; text held while a tool call was open goes out as a text block."""
        held, self._held = "".join(self._held), []
        out = self._close()
        if held:
            out.append(self._open({"type": "text", "text": ""}))
            out.append(self._delta({"type": "text_delta", "text": held}))
            out += self._close()
        return out
