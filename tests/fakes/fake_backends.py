"""Fake prefill and decode servers speaking the router's contract, for router tests
and bench/router_overhead.py.

Both are raw ASGI apps, served on real loopback sockets either in-process
(:class:`ServerThread`, one uvicorn per thread) or as subprocesses
(``python -m tests.fakes.fake_backends prefill|decode --port P ...``). Their knobs
are changed and their records read over HTTP (``POST /fake/config``, ``GET
/fake/records``, ``POST /fake/release``), so a test drives them the same way in both
modes.

FakePrefill checks the router's prefill rewrite (FACTS.md §1) and answers 400 naming
the violation; FakeDecode checks ``kv_transfer_params`` and slot limits and streams
``tokens`` OpenAI SSE chunks ``token_delay`` seconds apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from pydantic import BaseModel, ConfigDict, ValidationError

from connector.protocol import PROTOCOL_VERSION, HandoffResult, HandoffTarget
from pd_router.asgi import Receive, Scope, Send, read_body, respond
from pd_router.contract import CANCEL_PATH, CAPABILITIES_PATH, CancelRequest, CancelResponse, \
    DecodeCapabilities, PeerStatus


def _error(message: str, status: int = 400) -> bytes:
    return json.dumps({"error": {"message": message, "type": "fake_error", "param": None, "code": status}}).encode()


async def _wait_or_disconnect(receive: Receive, delay: float) -> bool:
    """Sleep ``delay`` s; False if the client disconnected first."""
    watch = asyncio.ensure_future(receive())
    try:
        done, _ = await asyncio.wait({watch}, timeout=delay)
        return not (done and watch.result()["type"] == "http.disconnect")
    finally:
        watch.cancel()


class PrefillKnobs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = "tiny"
    delay: float = 0.0
    healthy: bool = True
    fail: str | None = None  # "status" | "handoff_failed" | "bad_json" | "no_params"
    fail_status: int = 400
    fail_body: str = '{"error": {"message": "prompt too long", "type": "BadRequestError", "param": null, "code": 400}}'


class DecodeKnobs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = "tiny"
    plain: bool = False  # no capabilities endpoint (like vLLM)
    slots: int = 1
    protocol_version: int = PROTOCOL_VERSION
    peers: list[PeerStatus] = [PeerStatus(peer="prefill-0", state="ok")]
    kv_endpoint: str = "127.0.0.1:1"
    ready: bool = True
    tokens: int = 8  # when the body has no max_tokens
    token_delay: float = 0.0
    hold: bool = False  # each request waits for POST /fake/release before streaming
    fail: str | None = None  # "status" | "mid_stream" | "no_done"
    fail_status: int = 500
    fail_after: int = 2


@dataclass
class Records:
    requests: list[dict[str, Any]] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    disconnects: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # contract violations seen
    active: set[str] = field(default_factory=set)
    max_active: int = 0

    def dump(self) -> dict[str, Any]:
        return {"requests": self.requests, "cancels": self.cancels, "disconnects": self.disconnects,
                "errors": self.errors, "active": sorted(self.active), "max_active": self.max_active}


class _FakeBase:
    knobs: BaseModel

    def __init__(self) -> None:
        self.records = Records()

    def _rid(self, scope: Scope) -> str:
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                return v.decode()
        self.records.errors.append("request without X-Request-Id")
        return "?"

    async def _control(self, scope: Scope, receive: Receive, send: Send) -> bool:
        path = scope["path"]
        if path == "/fake/config":
            update = json.loads(await read_body(scope, receive, 1 << 20) or b"{}")
            self.knobs = type(self.knobs).model_validate({**self.knobs.model_dump(), **update})
        elif path == "/fake/records":
            await respond(send, 200, json.dumps(self.records.dump()).encode())
            return True
        elif path == "/fake/reset":
            self.records = Records()
        else:
            return False
        await respond(send, 200, b"{}")
        return True

    def _models(self) -> bytes:
        model = self.knobs.model  # type: ignore[attr-defined]
        return json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]}).encode()


class FakePrefill(_FakeBase):
    def __init__(self, **knobs: Any) -> None:
        super().__init__()
        self.knobs = PrefillKnobs(**knobs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or await self._control(scope, receive, send):
            return
        k, path = self.knobs, scope["path"]
        if path == "/health":
            return await respond(send, 200 if k.healthy else 503, b"{}")
        if path == "/v1/models":
            return await respond(send, 200, self._models())
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return await respond(send, 404, _error("not found", 404))
        rid = self._rid(scope)
        body = json.loads(await read_body(scope, receive, 1 << 26))
        self.records.requests.append({"request_id": rid, "path": path, "body": body})
        problem = self._check(path, body)
        if problem:
            self.records.errors.append(problem)
            return await respond(send, 400, _error(problem))
        self.records.active.add(rid)
        try:
            if k.delay and not await _wait_or_disconnect(receive, k.delay):
                self.records.disconnects.append(rid)
                return
            if k.fail == "status":
                return await respond(send, k.fail_status, k.fail_body.encode())
            if k.fail == "bad_json":
                return await respond(send, 200, b"{not json")
            await respond(send, 200, json.dumps(self._answer(path, body, rid)).encode())
        finally:
            self.records.active.discard(rid)

    @staticmethod
    def _check(path: str, body: dict[str, Any]) -> str | None:
        if body.get("stream") is not False:
            return "prefill body: stream must be false"
        if "stream_options" in body or "min_tokens" in body:
            return "prefill body: stream_options/min_tokens must be dropped"
        limits = [body[k] for k in ("max_tokens", "max_completion_tokens") if k in body]
        if not limits or any(v != 1 for v in limits):
            return f"prefill body: max tokens must be 1, got {limits}"
        if path == "/v1/completions" and "max_completion_tokens" in body:
            return "prefill body: max_completion_tokens on /v1/completions"
        if not isinstance(body.get("kv_transfer_params"), dict):
            return "prefill body: no kv_transfer_params"
        return None

    def _answer(self, path: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
        params = body["kv_transfer_params"]
        if params.get("do_remote_decode"):  # vLLM NIXL convention (plain decode)
            kv: dict[str, Any] = {"do_remote_prefill": True, "remote_engine_id": "fake-engine",
                                  "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 1}
        else:
            target = HandoffTarget.model_validate(params)
            kv = HandoffResult(handoff_id=target.handoff_id, kv_endpoint=target.kv_endpoint,
                               num_prompt_tokens=5, first_token_id=7, last_prompt_token_id=3,
                               status="failed" if self.knobs.fail == "handoff_failed" else "sent",
                               error="fake handoff failure" if self.knobs.fail == "handoff_failed" else None
                               ).model_dump()
            kv["remote_prefill_cached_tokens"] = 0  # vLLM adds keys of its own
        wants = body.get("logprobs")
        logprobs = {"content": [{"token": "t7", "logprob": -0.5, "top_logprobs": []}]} if wants else None
        if path == "/v1/chat/completions":
            choice = {"index": 0, "message": {"role": "assistant", "content": "t7"}, "logprobs": logprobs,
                      "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": "t7", "logprobs": logprobs, "finish_reason": "length"}
        answer = {"id": f"cmpl-{rid}", "object": "chat.completion" if "chat" in path else "text_completion",
                  "model": self.knobs.model, "choices": [choice],
                  "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
        if self.knobs.fail != "no_params":
            answer["kv_transfer_params"] = kv
        return answer


class FakeDecode(_FakeBase):
    def __init__(self, **knobs: Any) -> None:
        super().__init__()
        self.knobs = DecodeKnobs(**knobs)
        self._held: dict[str, asyncio.Event] = {}  # hold mode: waiting requests, oldest first
        self._permits = 0  # releases that came before the request they were meant for
        self._cancel: dict[str, asyncio.Event] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or await self._control(scope, receive, send):
            return
        k, path = self.knobs, scope["path"]
        if path == "/fake/release":
            self._release(json.loads(await read_body(scope, receive, 1 << 20) or b"{}"))
            return await respond(send, 200, b"{}")
        if path in ("/health", "/ready"):
            return await respond(send, 200 if (k.ready or path == "/health") else 503,
                                 b'{"status": "ok"}' if k.ready else b'{"status": "loading"}')
        if path == "/v1/models":
            return await respond(send, 200, self._models())
        if path == CAPABILITIES_PATH and not k.plain:
            caps = DecodeCapabilities(protocol_version=k.protocol_version, model=k.model, engine="reference",
                                      slots=k.slots, busy_slots=len(self.records.active), max_seq_len=4096,
                                      num_mtp=1, kv_endpoint=k.kv_endpoint, layout_fingerprint="fake",
                                      peers=k.peers)
            return await respond(send, 200, caps.model_dump_json().encode())
        if path == CANCEL_PATH and not k.plain:
            req = CancelRequest.model_validate_json(await read_body(scope, receive, 1 << 20))
            self.records.cancels.append(req.request_id)
            event = self._cancel.get(req.request_id)
            if event is not None:
                event.set()
            body = CancelResponse(request_id=req.request_id, cancelled=event is not None)
            return await respond(send, 200, body.model_dump_json().encode())
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return await respond(send, 404, _error("not found", 404))
        await self._generate(scope, receive, send, path)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        k, rec = self.knobs, self.records
        rid = self._rid(scope)
        body = json.loads(await read_body(scope, receive, 1 << 26))
        rec.requests.append({"request_id": rid, "path": path, "body": body, "t": time.monotonic()})
        problem = self._check(body, rid)
        if problem:
            rec.errors.append(problem)
            return await respond(send, 400, _error(problem))
        if len(rec.active) >= (k.slots if not k.plain else 1 << 30):
            rec.errors.append(f"slot limit {k.slots} exceeded by {rid}")
            return await respond(send, 503, _error("all slots busy", 503))
        if k.fail == "status":
            return await respond(send, k.fail_status, _error("fake decode failure", k.fail_status))
        cancel = self._cancel[rid] = asyncio.Event()
        rec.active.add(rid)
        rec.max_active = max(rec.max_active, len(rec.active))
        watch = asyncio.ensure_future(receive())  # completes when the client goes away
        try:
            if k.hold and not await self._hold(rid, cancel, watch):
                return
            await self._emit(send, path, body, rid, cancel, watch)
        finally:
            watch.cancel()
            rec.active.discard(rid)
            self._cancel.pop(rid, None)

    def _release(self, what: dict[str, Any]) -> None:
        """``{"request_id": id}`` releases that held request, ``{"n": n}`` the n oldest."""
        if "request_id" in what:
            self._held.pop(what["request_id"]).set()
            return
        for _ in range(what.get("n", 1)):
            if self._held:
                self._held.pop(next(iter(self._held))).set()
            else:
                self._permits += 1

    async def _hold(self, rid: str, cancel: asyncio.Event, watch: asyncio.Future[Any]) -> bool:
        """Wait for a release; False if cancelled or the client left first."""
        if self._permits:
            self._permits -= 1
            return True
        gate = self._held[rid] = asyncio.Event()
        waits = [asyncio.ensure_future(gate.wait()), asyncio.ensure_future(cancel.wait())]
        await asyncio.wait([*waits, watch], return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        self._held.pop(rid, None)
        if gate.is_set():
            return True
        if watch.done():
            self.records.disconnects.append(rid)
        return False

    def _check(self, body: dict[str, Any], rid: str) -> str | None:
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            return "decode body: no kv_transfer_params"
        if self.knobs.plain:
            return None if params.get("do_remote_prefill") else "decode body: not vLLM's kv_transfer_params"
        try:
            result = HandoffResult.model_validate(params)
        except ValidationError as exc:
            return f"decode body: bad kv_transfer_params: {exc}"
        if result.handoff_id != rid:
            return f"decode body: handoff_id {result.handoff_id} != X-Request-Id {rid}"
        if body.get("logprobs") and result.prefill_logprobs is None:
            return "decode body: logprobs asked, no prefill_logprobs"
        return None

    async def _emit(self, send: Send, path: str, body: dict[str, Any], rid: str, cancel: asyncio.Event,
                    watch: asyncio.Future[Any]) -> None:
        k = self.knobs
        n = body.get("max_completion_tokens") or body.get("max_tokens") or k.tokens
        chat = path == "/v1/chat/completions"
        stream = bool(body.get("stream"))
        if not stream:
            text = "".join(f"t{i} " for i in range(n))
            if k.token_delay:
                await asyncio.wait([watch], timeout=k.token_delay * n)
                if watch.done():
                    self.records.disconnects.append(rid)
                    return
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            out = {"id": f"cmpl-{rid}", "object": "chat.completion" if chat else "text_completion",
                   "created": 0, "model": k.model, "choices": [choice],
                   "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}}
            return await respond(send, 200, json.dumps(out).encode())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = f'data: {{"id": "cmpl-{rid}", "object": "{obj}", "created": 0, "model": "{k.model}", "choices": ['
        piece = ('{{"index": 0, "delta": {{"content": "t{} "}}, "finish_reason": {}}}]}}\n\n' if chat else
                 '{{"index": 0, "text": "t{} ", "finish_reason": {}}}]}}\n\n')
        t0 = time.monotonic()
        for i in range(n):
            if k.fail == "mid_stream" and i == k.fail_after:
                raise ConnectionAbortedError("fake decode: dying mid-stream")
            wait = t0 + i * k.token_delay - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if watch.done():
                self.records.disconnects.append(rid)
                return
            if cancel.is_set():
                return
            chunk = head + piece.format(i, '"length"' if i == n - 1 else "null")
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        tail = b""
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
            tail = b"data: " + json.dumps({"id": f"cmpl-{rid}", "object": obj, "created": 0, "model": k.model,
                                           "choices": [], "usage": usage}).encode() + b"\n\n"
        if k.fail != "no_done":
            tail += b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})


class ServerThread:
    """An ASGI app on 127.0.0.1:port, served by uvicorn in its own thread and loop."""

    def __init__(self, app: Any, port: int, loop: str = "asyncio") -> None:
        self.app, self.port = app, port
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=port, loop=loop, http="httptools",
                                log_level="warning", access_log=False, lifespan="auto")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"uvicorn-{port}")

    def start(self, timeout: float = 20.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="fake prefill/decode servers for router tests and benches")
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--knobs", default="{}", help="JSON object of PrefillKnobs/DecodeKnobs fields")
    args = parser.parse_args(argv)
    knobs = json.loads(args.knobs)
    app = FakePrefill(**knobs) if args.role == "prefill" else FakeDecode(**knobs)
    uvicorn.run(app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools", log_level="warning",
                access_log=False, lifespan="off")


if __name__ == "__main__":
    main()
