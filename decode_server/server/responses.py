"""OpenAI response bodies: SSE chunks and full JSON responses, for
``/v1/completions`` and ``/v1/chat/completions``.

A renderer consumes the :class:`~decode_server.server.sequence.Delta` of each
engine step; in streaming mode it returns the chunks to send, otherwise it only
accumulates, and :meth:`full` builds the one response body at the end.
"""

from __future__ import annotations

import json
import time
from typing import Any

from decode_server.server.glm import ChatPiece, GlmChatParser, ToolCall
from decode_server.server.request_plan import Plan
from decode_server.server.sequence import MIN_LOGPROB, Delta, TokenLogprob
from pd_wire.requests import Endpoint

DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


class _Renderer:
    object_full = ""
    object_chunk = ""
    id_prefix = ""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.id = f"{self.id_prefix}{plan.request_id}"
        self.created = plan.created if plan.created is not None else int(time.time())
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.completion_tokens = 0

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.object_chunk, "created": self.created, "model": self.plan.model,
                 "choices": [choice]}
        if self.plan.continuous_usage:
            chunk["usage"] = self.usage()
        return chunk

    def _note(self, delta: Delta) -> None:
        self.completion_tokens += len(delta.token_ids)
        if delta.finish_reason:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    def usage(self) -> dict[str, int]:
        return usage(self.plan.prompt_tokens, self.completion_tokens)

    def start(self) -> list[dict[str, Any]]:
        return []

    def end(self) -> list[dict[str, Any]]:
        """Chunks after the last delta (the usage chunk when asked for)."""
        if not self.plan.include_usage:
            return []
        return [{"id": self.id, "object": self.object_chunk, "created": self.created, "model": self.plan.model,
                 "choices": [], "usage": self.usage()}]


class CompletionRenderer(_Renderer):
    object_full = "text_completion"
    object_chunk = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        self._text: list[str] = []
        self._offset = 0
        self._logprobs: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                "text_offset": []}

    def _logprobs_of(self, entries: list[TokenLogprob]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(e.token)
            out["token_logprobs"].append(e.logprob)
            top = {e.token: e.logprob} if e.logprob is not None else {}
            top.update({t: lp for t, lp in e.top})
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(e.token)
        return out

    def add(self, delta: Delta) -> list[dict[str, Any]]:
        self._note(delta)
        self._text.append(delta.text)
        lp = self._logprobs_of(delta.logprobs) if delta.logprobs is not None else None
        if not self.plan.stream:
            if lp is not None:
                for key, values in lp.items():
                    self._logprobs[key].extend(values)
            return []
        if not (delta.text or delta.finish_reason or delta.logprobs):
            return []
        return [self._chunk({"index": 0, "text": delta.text, "logprobs": lp,
                             "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason})]

    def full(self) -> dict[str, Any]:
        choice = {"index": 0, "text": "".join(self._text),
                  "logprobs": self._logprobs if self.plan.logprobs is not None else None,
                  "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
        return {"id": self.id, "object": self.object_full, "created": self.created, "model": self.plan.model,
                "choices": [choice], "usage": self.usage()}


class ChatRenderer(_Renderer):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        self._parser = GlmChatParser(plan.reasoning, plan.tools) if (plan.reasoning or plan.tools) else None
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCall] = []
        self._lp: list[dict[str, Any]] = []

    @staticmethod
    def _logprobs_of(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        return [{"token": e.token, "logprob": MIN_LOGPROB if e.logprob is None else e.logprob,
                 "bytes": _bytes(e.token),
                 "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in e.top]}
                for e in entries]

    def _split(self, delta: Delta) -> ChatPiece:
        if self._parser is None:
            return ChatPiece(content=delta.text)
        piece = self._parser.feed(delta.text)
        if delta.finish_reason:
            tail = self._parser.finish()
            piece.reasoning += tail.reasoning
            piece.content += tail.content
            piece.tool_calls += tail.tool_calls  # a call cut off by the end
        return piece

    def _finish_reason(self, reason: str | None) -> str | None:
        """vLLM's finish reason beside tool calls: a stop with calls is ``tool_calls``, not for a
        named function; unstreamed, ``tool_calls`` whenever ``auto`` made calls (a cut one too)
        and whenever a ``required`` answer stopped."""
        choice = self.plan.tool_choice
        if reason is None or choice == "named":
            return reason
        if not self.plan.stream and ((choice == "auto" and self._calls) or (choice == "required" and reason == "stop")):
            return "tool_calls"
        return "tool_calls" if reason == "stop" and self._calls else reason

    def start(self) -> list[dict[str, Any]]:
        return [self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})]

    def add(self, delta: Delta) -> list[dict[str, Any]]:
        self._note(delta)
        piece = self._split(delta)
        first_call = len(self._calls)
        self._calls.extend(piece.tool_calls)
        lp = self._logprobs_of(delta.logprobs) if delta.logprobs is not None else None
        if not self.plan.stream:
            self._content.append(piece.content)
            self._reasoning.append(piece.reasoning)
            self._lp.extend(lp or [])
            return []
        if not (piece or delta.finish_reason or delta.logprobs):
            return []
        body: dict[str, Any] = {}
        if piece.reasoning:
            body["reasoning"] = piece.reasoning
        if piece.content or not (piece.reasoning or piece.tool_calls):
            body["content"] = piece.content
        calls = [c.to_openai(first_call + i) for i, c in enumerate(piece.tool_calls)]
        if self.plan.first_tool_call_only:  # as vLLM streams with parallel_tool_calls false
            calls = [c for c in calls if c["index"] == 0]
        if calls:
            body["tool_calls"] = calls
        return [self._chunk({"index": 0, "delta": body, "logprobs": {"content": lp} if lp is not None else None,
                             "finish_reason": self._finish_reason(delta.finish_reason),
                             "stop_reason": delta.stop_reason})]

    def full(self) -> dict[str, Any]:
        content: str | None = "".join(self._content)
        if self._parser is not None:
            content = self._parser.message_content()
        # no content: "" with a forced call, null beside tool calls or a reasoning block (as vLLM's GLM
        # parsers answer), else ""
        forced = self.plan.tool_choice in ("required", "named")
        message: dict[str, Any] = {"role": "assistant", "content": content or (
            "" if forced or not (self._calls or self.plan.reasoning) else None)}
        if self._parser is not None and self.plan.reasoning:
            message["reasoning"] = "".join(self._reasoning) or None
        if self._calls:
            calls = self._calls[:1] if self.plan.first_tool_call_only else self._calls
            message["tool_calls"] = [c.to_openai() for c in calls]
        choice = {"index": 0, "message": message,
                  "logprobs": {"content": self._lp} if self.plan.logprobs is not None else None,
                  "finish_reason": self._finish_reason(self.finish_reason), "stop_reason": self.stop_reason}
        return {"id": self.id, "object": self.object_full, "created": self.created, "model": self.plan.model,
                "choices": [choice], "usage": self.usage()}


def renderer_for(plan: Plan) -> CompletionRenderer | ChatRenderer:
    return ChatRenderer(plan) if plan.endpoint == Endpoint.CHAT else CompletionRenderer(plan)
