"""``n > 1`` and a completion's list of prompts: one PD request per choice, one answer.

A KV handoff carries one sequence, so a request for several choices runs as one request per
choice through the usual path (``serve_one``: the edge's
:meth:`~pd_router.request.accept.CompletionHandler._serve`; each takes its own decode slot, runs
its own prefill and decode, and gives its slot back whatever happens). The choices of
a completion whose ``prompt`` is a list of prompts (strings or token-id lists) times ``n``
are indexed as vLLM indexes them: prompt p's sample s is choice ``p * n + s``. Each choice's
request has its one prompt, no ``n`` and, when the client set a ``seed``, ``seed + s`` (as
vLLM seeds the n children of a request; every prompt is a request of its own there). Their
answers are merged: one JSON body whose choices carry their ``index`` and whose usage counts
each prompt once and the completion tokens of all choices; or one SSE stream whose chunks
carry their choice's ``index`` and the first choice's ``id``, with one usage chunk (when
asked) and one ``[DONE]`` at the end. A failure of any choice before the answer began fails
the request (the others are cancelled and give their slots back); after it began, the
stream ends with the error event. A request's choices are bounded by ``--max-choices``
and by what the router can run at once (the model's decode slots plus ``--max-queue``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pd_router.apis.completions import parse_request
from pd_router.asgi import SSE, Message, respond
from pd_router.errors import InvalidRequest, RouterError
from pd_router.request.context import RequestContext
from pd_router.request.stages import Stage
from pd_wire.requests import Endpoint, OpenAIRequest

if TYPE_CHECKING:
    from pd_router.state import RouterState

# serves one request (one choice) whole: its own slot, prefill and decode; its slot back
ServeOne = Callable[[RequestContext, dict[str, Any], OpenAIRequest], Awaitable[None]]

_DONE = "[DONE]"


def choices_wanted(body: dict[str, Any]) -> int:
    """The client's ``n`` (1 when absent); validated by the decode check when it is not an int > 1."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def prompts(endpoint: Endpoint, body: dict[str, Any]) -> list[Any] | None:
    """A completion's prompts when ``prompt`` is a list of more than one (strings or token-id
    lists; a list of token ids is one prompt); None for one prompt (a list of one is served as
    vLLM serves it, one request). A 400 for a list that mixes kinds."""
    prompt = body.get("prompt")
    if endpoint is not Endpoint.COMPLETIONS or not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None  # one prompt, as token ids
    if all(isinstance(p, str) for p in prompt) or all(
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        return list(prompt)
    raise InvalidRequest("prompt: a string, a list of strings, a list of token ids or a list of token-id lists",
                         param="prompt")


def choice_bodies(state: RouterState, endpoint: Endpoint, body: dict[str, Any],
                  model: str) -> list[dict[str, Any]] | None:
    """Each choice's request (choice ``p * n + s``: prompt p, sample s), or None for a request
    of one choice. Their number (prompts x ``n``) is checked against the router's bounds
    (:func:`check_count`) before any of them is made."""
    n = choices_wanted(body)
    many = prompts(endpoint, body)
    if many is None and n == 1:
        return None
    check_count(state, model, (len(many) if many is not None else 1) * n, n)
    out = []
    for prompt in many if many is not None else [body.get("prompt")]:
        for s in range(n):
            sub = sub_body(body, s)
            if many is not None:
                sub["prompt"] = prompt
            out.append(sub)
    return out


def check_count(state: RouterState, model: str, count: int, n: int) -> None:
    """A 400 when ``count`` choices (prompts x ``n``) are more than ``--max-choices`` or than the
    router can run at once (the model's decode slots plus ``--max-queue``)."""
    asked = f"{count // n} prompts x n={n}" if count != n else f"n={n}"
    param = "n" if count == n else "prompt"
    limit = state.settings.max_choices
    if count > limit:
        raise InvalidRequest(f"{asked} is {count} choices; this router serves at most {limit} per request "
                             "(--max-choices): each choice is a prefill and a decode of its own", param=param)
    room = state.settings.max_queue + sum(b.slots for b in state.backends.decode if b.serves(model))
    if count > room:
        raise InvalidRequest(f"{asked} is more than this router can run at once ({room:g}: the decode slots of "
                             f"model {model!r} plus --max-queue); each choice takes a decode slot",
                             param=param)


def sub_body(body: dict[str, Any], i: int) -> dict[str, Any]:
    """Sample i's request: no ``n``; the client's seed + i."""
    out = {k: v for k, v in body.items() if k != "n"}
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        out["seed"] = seed + i
    return out


@dataclass(eq=False)
class _Merge:
    """The n answers as they arrive; what is sent to the client, under one lock."""

    ctx: RequestContext
    stream: bool
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    bodies: dict[int, bytearray] = field(default_factory=dict)
    usage: dict[int, dict[str, Any]] = field(default_factory=dict)
    error: bytes | None = None  # the first SSE error event a choice's stream ended with
    chunk_id: str | None = None
    template: dict[str, Any] | None = None  # id/object/created/model of the first chunk (for the usage chunk)

    def send_for(self, i: int) -> Any:
        pending = bytearray()
        self.bodies[i] = bytearray()

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                if message["status"] != 200:  # an error answer: its body is the error (ctx.fail)
                    self.bodies[i] = bytearray()
                return
            data = message.get("body", b"")
            if not self.stream:
                self.bodies[i] += data
                return
            pending.extend(data)
            while b"\n\n" in pending:
                event, _, rest = bytes(pending).partition(b"\n\n")
                pending[:] = rest
                await self._event(i, event)

        return send

    async def _event(self, i: int, event: bytes) -> None:
        text = event.decode("utf-8", "replace").strip()
        if not text.startswith("data:"):
            return
        payload = text[5:].strip()
        if payload == _DONE:
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            self.error = self.error or (b"data: " + payload.encode() + b"\n\n")
            return
        if self.chunk_id is None:
            self.chunk_id = chunk.get("id")
            self.template = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
        chunk["id"] = self.chunk_id
        if not chunk.get("choices"):
            if chunk.get("usage"):
                self.usage[i] = chunk["usage"]
            return
        for choice in chunk["choices"]:
            choice["index"] = i
        await self.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    async def write(self, data: bytes, more: bool = True) -> None:
        ctx = self.ctx
        async with self.lock:
            if ctx.finished:
                return
            if not ctx.started:
                await ctx.send({"type": "http.response.start", "status": 200,
                                "headers": [(b"content-type", SSE), (b"cache-control", b"no-cache"),
                                            (b"x-request-id", ctx.request_id.encode())]})
                ctx.started, ctx.status = True, 200
            if not more:
                ctx.finished = True
            await ctx.send({"type": "http.response.body", "body": data, "more_body": more})


def merged_usage(usages: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Each prompt counted once (the first of its ``n`` samples), the completion tokens of every choice summed."""
    prompt = sum(int(u.get("prompt_tokens") or 0) for u in usages[::n])
    completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def merged_answer(answers: list[dict[str, Any]], n: int) -> dict[str, Any]:
    out = dict(answers[0])
    choices = []
    for i, answer in enumerate(answers):
        for choice in answer.get("choices") or []:
            choices.append({**choice, "index": i})
    out["choices"] = choices
    usages = [a["usage"] for a in answers if isinstance(a.get("usage"), dict)]
    if len(usages) == len(answers):
        out["usage"] = merged_usage(usages, n)
    return out


async def serve(state: RouterState, ctx: RequestContext, body: dict[str, Any], request: OpenAIRequest,
                bodies: list[dict[str, Any]], serve_one: ServeOne) -> None:
    """Run the choices of ``body`` (``bodies``, from :func:`choice_bodies`, which checked their number;
    each by ``serve_one``) and answer the client with their merge."""
    count, n = len(bodies), choices_wanted(body)
    merge = _Merge(ctx, bool(request.stream))
    keeps = prompts(ctx.endpoint, body) is None  # the KV of a choice of a list of prompts is not kept
    subs = []
    for i, sub_dict in enumerate(bodies):
        raw = json.dumps(sub_dict).encode()
        sub_dict, sub_request = parse_request(ctx.endpoint, raw)
        sub = RequestContext(ctx.endpoint, f"{ctx.request_id[:240]}~n{i}", ctx.start, merge.send_for(i), raw=raw,
                             trace=ctx.trace, tenant=ctx.tenant, priority=ctx.priority, keeps=keeps)
        subs.append((sub, sub_dict, sub_request))
    tasks = [asyncio.ensure_future(serve_one(sub, sub_dict, sub_request)) for sub, sub_dict, sub_request in subs]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each gives its slot back
        ctx.stage = next((s.stage for s, _, _ in subs if s.stage != Stage.DECODE), Stage.DECODE)
        raise
    ctx.stage = Stage.DECODE
    if merge.stream:
        if merge.error is not None:
            await merge.write(merge.error + b"data: [DONE]\n\n", more=False)
            ctx.status, ctx.error_type = 502, "upstream_error"
            return
        if len(merge.usage) == count and merge.template is not None:
            usage = merged_usage([merge.usage[i] for i in range(count)], n)
            await merge.write(b"data: " + json.dumps({**merge.template, "choices": [], "usage": usage}).encode()
                              + b"\n\n")
        await merge.write(b"data: [DONE]\n\n", more=False)
        return
    try:
        answers = [json.loads(bytes(merge.bodies[i])) for i in range(count)]
    except ValueError as exc:
        raise RouterError(f"a choice's answer is not JSON: {exc}") from None
    ctx.status, ctx.finished = 200, True
    await respond(ctx.send, 200, json.dumps(merged_answer(answers, n)).encode(), b"application/json",
                  [(b"x-request-id", ctx.request_id.encode())])

