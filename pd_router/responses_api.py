"""``POST /v1/responses``, the minimal non-stateful subset, mapped onto chat completions.

Accepted: ``model``, ``input`` (a string, or a list of messages whose content is a string
or ``input_text`` parts), ``instructions`` (a system message first), ``max_output_tokens``,
``temperature``, ``top_p``, ``stream``; ``store`` is accepted and nothing is stored. Refused
with a 400 naming the field: ``previous_response_id``, ``conversation``, ``tools`` and any
other input item than a text message. The request becomes a chat completion body (the rest
of the path is the chat route's: slot, prefill, decode, release); the chat answer becomes a
``response`` object, and a chat stream the Responses API's events (``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` per delta, then the ``.done`` events and
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut it).
An error answer before the stream began is relayed as it is (OpenAI error shape); after, it
ends the stream with an ``error`` event.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pd_router.api import json_object
from pd_router.asgi import SSE, Message, Send
from pd_router.errors import InvalidRequest
from pd_wire.limits import MAX_CONTENT_PARTS, MAX_INT32, MAX_MESSAGES


class InputText(BaseModel):
    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: str


class InputMessage(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[InputText], Field(max_length=MAX_CONTENT_PARTS)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(min_length=1)
    input: str | Annotated[list[InputMessage], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None

    def chat_body(self) -> dict[str, Any]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        messages += [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in items]
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        for name, value in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p)):
            if value is not None:
                body[name] = value
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


_REFUSED = ("previous_response_id", "conversation", "tools", "background", "prompt")


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


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


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputMessage]
    usage: Usage | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = False
    tool_choice: Literal["none"] = "none"
    tools: list[Any] = Field(default_factory=list)
    error: None = None


def parse(raw: bytes) -> ResponsesRequest:
    body = json_object(raw)
    for name in _REFUSED:
        if body.get(name) not in (None, [], ""):
            raise InvalidRequest(f"{name} is not supported: this server implements the non-stateful text subset "
                                 "of the Responses API", param=name)
    try:
        return ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise InvalidRequest(f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


class Translator:
    """Wraps the chat route's ASGI ``send``: the chat answer goes out as a Responses API answer."""

    def __init__(self, send: Send, req: ResponsesRequest) -> None:
        self._send = send
        self._req = req
        self._id = f"resp_{uuid.uuid4().hex}"
        self._msg_id = f"msg_{uuid.uuid4().hex}"
        self._created = int(time.time())
        self._passthrough = False
        self._body = bytearray()
        self._pending = bytearray()
        self._seq = 0
        self._text: list[str] = []
        self._finish: str | None = None
        self._usage: Usage | None = None
        self._closed = False
        self._start: Message = {}

    def _response(self, text: str, finish: str | None, usage: Usage | None, done: bool) -> Response:
        cut = finish == "length"
        status: Literal["in_progress", "completed", "incomplete"] = (
            "in_progress" if not done else "incomplete" if cut else "completed")
        item_status: Literal["in_progress", "completed", "incomplete"] = status
        content = [OutputText(text=text)] if done else []
        return Response(id=self._id, created_at=self._created, status=status, model=self._req.model,
                        output=[OutputMessage(id=self._msg_id, status=item_status, content=content)] if done else [],
                        usage=usage, incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
                        instructions=self._req.instructions, max_output_tokens=self._req.max_output_tokens,
                        temperature=self._req.temperature, top_p=self._req.top_p)

    @staticmethod
    def _usage_of(usage: Any) -> Usage | None:
        if not isinstance(usage, dict):
            return None
        prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        return Usage(input_tokens=prompt, output_tokens=completion, total_tokens=prompt + completion)

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
            self._pending += data
            while b"\n\n" in self._pending:
                event, _, rest = bytes(self._pending).partition(b"\n\n")
                self._pending[:] = rest
                await self._chat_event(event)
            if not more and not self._closed:
                await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _answer(self) -> None:
        chat = json.loads(bytes(self._body))
        choice = (chat.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") or ""
        answer = self._response(text, choice.get("finish_reason"), self._usage_of(chat.get("usage")), True)
        # json's escapes: the echoed instructions may hold a lone surrogate, which pydantic's JSON refuses
        body = json.dumps(answer.model_dump(mode="json")).encode()
        headers = [(k, v) for k, v in self._start["headers"] if k != b"content-length"]
        await self._send({**self._start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def _event(self, kind: str, **fields: Any) -> None:
        data = json.dumps({"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1
        await self._send({"type": "http.response.body", "body": f"event: {kind}\ndata: {data}\n\n".encode(),
                          "more_body": True})

    def _part(self, text: str) -> dict[str, Any]:
        return OutputText(text=text).model_dump()

    async def _started(self) -> None:
        pending = self._response("", None, None, False).model_dump(mode="json")
        await self._event("response.created", response=pending)
        await self._event("response.in_progress", response=pending)
        item = OutputMessage(id=self._msg_id, status="in_progress", content=[]).model_dump()
        await self._event("response.output_item.added", output_index=0, item=item)
        await self._event("response.content_part.added", output_index=0, content_index=0, item_id=self._msg_id,
                          part=self._part(""))

    async def _chat_event(self, event: bytes) -> None:
        text = event.decode("utf-8", "replace").strip()
        if not text.startswith("data:") or self._closed:
            return
        payload = text[5:].strip()
        if payload == "[DONE]":
            return await self._finished()
        chunk = json.loads(payload)
        if "error" in chunk:
            self._closed = True
            err = chunk["error"]
            await self._event("error", code=str(err.get("code")), message=err.get("message", ""),
                              param=err.get("param"))
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if chunk.get("usage"):
            self._usage = self._usage_of(chunk["usage"])
        for choice in chunk.get("choices") or []:
            delta = (choice.get("delta") or {}).get("content")
            if delta:
                self._text.append(delta)
                await self._event("response.output_text.delta", output_index=0, content_index=0,
                                  item_id=self._msg_id, delta=delta, logprobs=[])
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]

    async def _finished(self) -> None:
        text = "".join(self._text)
        await self._event("response.output_text.done", output_index=0, content_index=0, item_id=self._msg_id,
                          text=text, logprobs=[])
        await self._event("response.content_part.done", output_index=0, content_index=0, item_id=self._msg_id,
                          part=self._part(text))
        final = self._response(text, self._finish, self._usage, True).model_dump(mode="json")
        await self._event("response.output_item.done", output_index=0, item=final["output"][0])
        await self._event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                          response=final)
        self._closed = True
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})
