"""The chat route's answer as a ``/v1/responses`` answer, as vLLM's Responses serving gives it.

The output items come in vLLM's order: a ``reasoning`` item (the message's reasoning), a
``message`` (its content), then a ``function_call`` per tool call (its ``call_id`` the chat
tool call's id). ``status`` is ``incomplete`` (``incomplete_details.reason``
``max_output_tokens``) when the answer was cut by the token bound, else ``completed``.

Streamed, the chat deltas drive vLLM's state machine: each delta is reasoning, content or a
tool call; a change of kind (or a tool call of another index) closes the open item (its
``.done`` events and ``response.output_item.done``) and opens the next
(``response.output_item.added``, and ``response.content_part.added`` for reasoning and
content); reasoning and content deltas are ``response.reasoning_text.delta`` /
``response.output_text.delta``, a tool call's argument text
``response.function_call_arguments.delta``. The stream opens with ``response.created`` and
``response.in_progress`` and ends with ``response.completed`` carrying the whole response
(its status ``incomplete`` when cut, as vLLM sends it), each event ``event: TYPE`` with a
``sequence_number`` from 0, no ``[DONE]``. An error answer before the stream began is
relayed as it is (OpenAI's error shape); after, it ends the stream with an ``error`` event.
"""

from __future__ import annotations

import json
import time
import uuid
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, Field

from pd_router.apis.responses import ResponsesRequest
from pd_router.asgi import SSE, Message, Send, StreamTranslator

Status = Literal["in_progress", "completed", "incomplete"]


def _uid() -> str:
    return uuid.uuid4().hex


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOut(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Status | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class MessageOut(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputText]


class FunctionCallOut(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status
    namespace: str | None = None  # a namespace tool's function (the model called <namespace>__<name>)


OutputItem = ReasoningOut | MessageOut | FunctionCallOut


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of_chat(cls, usage: Any) -> Usage | None:
        if not isinstance(usage, dict):
            return None
        prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        details = usage.get("completion_tokens_details")
        reasoning = int(details.get("reasoning_tokens") or 0) if isinstance(details, dict) else 0
        return cls(input_tokens=prompt, output_tokens=completion, total_tokens=prompt + completion,
                   input_tokens_details=InputTokensDetails(),
                   output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning))


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    """The ``response`` object, with the request's settings echoed as vLLM echoes them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    model: str
    output: list[OutputItem]
    usage: Usage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    text: Any = None
    reasoning: Any = None
    previous_response_id: str | None = None
    background: bool = False
    service_tier: str = "auto"
    truncation: str | None = "disabled"
    user: str | None = None


def _call_name(flat: str, names: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """A call's ``name`` and ``namespace`` fields, from the name the model called."""
    namespace, name = names.get(flat, (None, flat))
    return {"name": name, "namespace": namespace}


def _items_of_message(message: dict[str, Any], names: dict[str, tuple[str, str]]) -> list[OutputItem]:
    items: list[OutputItem] = []
    reasoning = message.get("reasoning")
    if reasoning:
        items.append(ReasoningOut(id=f"rs_{_uid()}", content=[ReasoningText(text=reasoning)]))
    content = message.get("content")
    if content:
        items.append(MessageOut(id=f"msg_{_uid()}", status="completed", content=[OutputText(text=content)]))
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        items.append(FunctionCallOut(id=f"fc_{_uid()}", call_id=call.get("id") or f"call_{_uid()}",
                                     arguments=fn.get("arguments") or "", status="completed",
                                     **_call_name(fn.get("name") or "", names)))
    return items


class _Kind(Enum):
    NONE = 0
    REASONING = 1
    CONTENT = 2
    TOOL_CALL = 3


class Translator(StreamTranslator):
    """Wraps the chat route's ASGI ``send``: the chat answer goes out as a Responses API answer."""

    def __init__(self, send: Send, req: ResponsesRequest) -> None:
        super().__init__(send)
        self._req = req
        self._names = req.call_names()
        self._id = f"resp_{_uid()}"
        self._created = int(time.time())
        self._passthrough = False
        self._body = bytearray()
        self._seq = 0
        self._start: Message = {}
        # the stream's state: the open item, and the items done
        self._kind = _Kind.NONE
        self._item_id = ""
        self._text = ""
        self._call: tuple[str, str, int | None] | None = None  # (call_id, name, index) of the open call
        self._items: list[OutputItem] = []
        self._finish: str | None = None
        self._usage: Usage | None = None

    def response(self, output: list[OutputItem], finish: str | None, usage: Usage | None,
                 status: Status | None = None) -> Response:
        req = self._req
        cut = finish == "length"
        return Response(
            id=self._id, created_at=self._created, model=req.model, output=output, usage=usage,
            status=status or ("incomplete" if cut else "completed"),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut and status is None else None,
            instructions=req.instructions, metadata=req.metadata, max_output_tokens=req.max_output_tokens,
            max_tool_calls=req.max_tool_calls, temperature=req.temperature, top_p=req.top_p,
            top_logprobs=req.top_logprobs, parallel_tool_calls=req.parallel_tool_calls is not False,
            tool_choice=req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump(),
            tools=[t.model_dump(exclude_none=True) for t in req.tools],
            text=req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else None,
            reasoning=req.reasoning.model_dump(exclude_none=True) if req.reasoning is not None else None,
            service_tier=req.service_tier, truncation=req.truncation, user=(req.model_extra or {}).get("user"))

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if message["status"] != 200:
                self._passthrough = True
                await self._send(message)
            elif self._req.stream:
                await self._send({**message, "headers": [(k, v) for k, v in message["headers"]
                                                         if k not in (b"content-type", b"content-length")]
                                  + [(b"content-type", SSE)]})
                await self._started()
            else:
                self._start = message
            return
        data = message.get("body", b"")
        more = message.get("more_body", False)
        if self._passthrough:
            await self._send(message)
        elif not self._req.stream:
            self._body += data
            if not more:
                await self._answer()
        else:
            await self._relay(data, more)

    async def _answer(self) -> None:
        chat = json.loads(bytes(self._body))
        choice = (chat.get("choices") or [{}])[0]
        finish = choice.get("finish_reason")
        answer = self.response(_items_of_message(choice.get("message") or {}, self._names), finish,
                               Usage.of_chat(chat.get("usage")))
        # json's escapes: the echoed instructions may hold a lone surrogate, which pydantic's JSON refuses
        body = json.dumps(answer.model_dump(mode="json")).encode()
        headers = [(k, v) for k, v in self._start["headers"] if k != b"content-length"]
        await self._send({**self._start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    # ---- the stream ----

    async def _event(self, kind: str, **fields: Any) -> None:
        data = json.dumps({"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1
        await self._send({"type": "http.response.body", "body": f"event: {kind}\ndata: {data}\n\n".encode(),
                          "more_body": True})

    async def _started(self) -> None:
        pending = self.response([], None, None, status="in_progress").model_dump(mode="json")
        await self._event("response.created", response=pending)
        await self._event("response.in_progress", response=pending)

    async def _chat_event(self, event: bytes) -> None:
        text = event.decode("utf-8", "replace").strip()
        if not text.startswith("data:") or self._closed:
            return
        payload = text[5:].strip()
        if payload == "[DONE]":
            return await self._finished()
        chunk = json.loads(payload)
        if "error" in chunk:
            err = chunk["error"]
            await self._event("error", code=str(err.get("code")), message=err.get("message", ""),
                              param=err.get("param"))
            return await self._end()
        if chunk.get("usage"):
            self._usage = Usage.of_chat(chunk["usage"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning")
            if reasoning is not None:
                await self._delta(_Kind.REASONING, reasoning)
            if delta.get("content"):
                await self._delta(_Kind.CONTENT, delta["content"])
            for call in delta.get("tool_calls") or []:
                await self._tool_call(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]

    async def _delta(self, kind: _Kind, text: str) -> None:
        if self._kind is not kind:
            await self._close()
            await self._open(kind)
        self._text += text
        name = "response.reasoning_text.delta" if kind is _Kind.REASONING else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind is _Kind.REASONING else {"logprobs": []}
        await self._event(name, item_id=self._item_id, output_index=len(self._items), content_index=0, delta=text,
                          **extra)

    async def _tool_call(self, call: dict[str, Any]) -> None:
        fn = call.get("function")
        if not isinstance(fn, dict):
            return
        index = call.get("index")
        if self._kind is not _Kind.TOOL_CALL or (self._call is not None and index is not None
                                                 and self._call[2] is not None and index != self._call[2]):
            await self._close()
            self._kind, self._item_id, self._text = _Kind.TOOL_CALL, f"fc_{_uid()}", ""
            self._call = (call.get("id") or f"call_{_uid()}", fn.get("name") or "", index)
            item = FunctionCallOut(id=self._item_id, call_id=self._call[0], arguments="", status="in_progress",
                                   **_call_name(self._call[1], self._names))
            await self._event("response.output_item.added", output_index=len(self._items), item=item.model_dump())
        arguments = fn.get("arguments")
        if arguments:
            self._text += arguments
            await self._event("response.function_call_arguments.delta", item_id=self._item_id,
                              output_index=len(self._items), delta=arguments)

    async def _open(self, kind: _Kind) -> None:
        self._kind, self._text = kind, ""
        index = len(self._items)
        if kind is _Kind.REASONING:
            self._item_id = f"rs_{_uid()}"
            item: dict[str, Any] = ReasoningOut(id=self._item_id, status="in_progress").model_dump()
            part: dict[str, Any] = {"text": "", "type": "reasoning_text"}
        else:
            self._item_id = f"msg_{_uid()}"
            item = MessageOut(id=self._item_id, status="in_progress", content=[]).model_dump()
            part = OutputText(text="", logprobs=[]).model_dump()
        await self._event("response.output_item.added", output_index=index, item=item)
        await self._event("response.content_part.added", output_index=index, item_id=self._item_id, content_index=0,
                          part=part)

    async def _close(self) -> None:
        kind, index, text = self._kind, len(self._items), self._text
        item: OutputItem
        if kind is _Kind.REASONING:
            part = ReasoningText(text=text)
            await self._event("response.reasoning_text.done", item_id=self._item_id, output_index=index,
                              content_index=0, text=text)
            await self._event("response.content_part.done", item_id=self._item_id, output_index=index,
                              content_index=0, part=part.model_dump())
            item = ReasoningOut(id=self._item_id, content=[part], status="completed")
        elif kind is _Kind.CONTENT:
            out = OutputText(text=text)
            await self._event("response.output_text.done", item_id=self._item_id, output_index=index,
                              content_index=0, text=text, logprobs=[])
            await self._event("response.content_part.done", item_id=self._item_id, output_index=index,
                              content_index=0, part=out.model_dump())
            item = MessageOut(id=self._item_id, status="completed", content=[out] if text else [])
        elif kind is _Kind.TOOL_CALL and self._call is not None:
            call_id, name, _ = self._call
            fields = _call_name(name, self._names)
            await self._event("response.function_call_arguments.done", item_id=self._item_id, output_index=index,
                              arguments=text, name=fields["name"])
            item = FunctionCallOut(id=self._item_id, call_id=call_id, arguments=text, status="completed", **fields)
        else:
            return
        await self._event("response.output_item.done", output_index=index, item=item.model_dump())
        self._items.append(item)
        self._kind, self._call = _Kind.NONE, None

    async def _finished(self) -> None:
        await self._close()
        final = self.response(list(self._items), self._finish, self._usage).model_dump(mode="json")
        await self._event("response.completed", response=final)
        await self._end()
