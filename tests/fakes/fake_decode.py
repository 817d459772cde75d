"""The fake decode server: checks ``kv_transfer_params`` and slot limits (a ``HandoffClaim``
holds its slot as on the real server, the real :class:`SlotTable` behind it: 200 at the take,
at once or after a wait in its queue; then it waits for its result on the fake KV channel,
where the fake prefill sends it), streams ``tokens`` OpenAI SSE chunks ``token_delay`` seconds
apart, records cancels and disconnects; hold and fault knobs (see :class:`DecodeKnobs`).
``plain``: a plain vLLM as decode (no capabilities, the router counts its slots)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from decode_server.server.granted import GrantedSend
from decode_server.server.slots import SlotRefused, SlotTable
from pd_router.asgi import Receive, Scope, Send, read_body, respond
from pd_wire.decode import (
    CANCEL_PATH,
    CAPABILITIES_PATH,
    RESULT_PATH,
    CancelRequest,
    CancelResponse,
    DecodeCapabilities,
    DecodeRefusal,
    EngineFeatures,
    progress_line,
)
from pd_wire.errors import ErrorDetail
from pd_wire.handoff import PROTOCOL_VERSION, HandoffClaim, HandoffResult, PeerStatus, SlotWait
from tests.fakes.fake_common import FakeBase, error_body

FAKE_TOKEN_BASE = 1000  # the fake's output token i is this id + i (its progress lines)


class DecodeKnobs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = "tiny"
    plain: bool = False  # no capabilities endpoint (like vLLM)
    slots: int = 1  # (a plain one too: more at once are answered 429, as a full vLLM would queue them)
    protocol_version: int = PROTOCOL_VERSION
    peers: list[PeerStatus] = [PeerStatus(peer="prefill-0", state="ok")]
    # the KV endpoint it advertises; None: its own fake KV channel, where the fake prefill sends
    # the results that go with the KV (a line of HandoffResult JSON each, on a standing
    # connection, as the connector's Prefilled)
    kv_endpoint: str | None = None
    kv_timeout: float = 10.0  # a claim's wait for its result, then 504 as the real server's KV timeout
    ready: bool = True
    tokens: int = 8  # when the body has no max_tokens
    token_delay: float = 0.0
    hold: bool = False  # each request waits for POST /fake/release before streaming
    # "status" | "mid_stream" (after fail_after tokens; an answer resumed here does not) | "no_done" |
    # "error_event" (after fail_after tokens, its error event or refusal with fail_status; not resumed ones)
    fail: str | None = None
    fail_status: int = 500
    fail_after: int = 2
    max_tokens: int | None = None  # larger max tokens are a 400 before any slot, as the real server's context
    max_seq_len: int = 4096  # the context it advertises (a router refuses a max_tokens no prompt fits beside)
    release_lag: float = 0.0  # seconds between the end of a sequence and its slot being free again
    busy: bool = False  # answer 429 to every request (slots taken outside the router's count)
    # a posted result is read and never answered, until the router gives up on the call (as a
    # decode node whose link went down after its slot was granted)
    result_silent: bool = False
    engine: str = "reference"
    # what /v1/pd/capabilities advertises (by default what the reference engine does)
    kept: list[str] = []  # the conversation keys /v1/pd/capabilities says it keeps
    features: EngineFeatures = EngineFeatures(logprobs=True, penalties=True, logit_bias=True, min_p=True, seed=True,
                                             structured_output=True)


class FakeDecode(FakeBase[DecodeKnobs]):
    def __init__(self, **knobs: Any) -> None:
        super().__init__()
        self.knobs = DecodeKnobs(**knobs)
        self._held: dict[str, asyncio.Event] = {}  # hold mode: waiting requests, oldest first
        self._permits = 0  # releases that came before the request they were meant for
        self._permits_for: set[str] = set()  # releases by request id that came before it was held
        self._cancel: dict[str, asyncio.Event] = {}
        self._by_handoff: dict[str, str] = {}  # handoff id -> request id, of the requests running here
        self._swapped: set[str] = set()  # handoff ids whose slot a swap took (their answer is a 499)
        self._results: dict[str, asyncio.Event] = {}  # handoff id -> set once its result came with the KV
        self._kv_server: asyncio.Server | None = None
        self._table: SlotTable | None = None
        # an in-process test may set it: awaited before each streamed token (its index), to
        # pace the stream by what the test observes instead of by the clock
        self.token_gate: Callable[[int], Awaitable[None]] | None = None

    @property
    def slots(self) -> SlotTable | None:
        """The slot table (made on first use, with the slots of that moment); None when plain."""
        if self.knobs.plain:
            return None
        if self._table is None:
            self._table = SlotTable(self.knobs.slots, 1024)
        return self._table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or await self._control(scope, receive, send):
            return
        k, path = self.knobs, scope["path"]
        if path == "/fake/release":
            self._release(json.loads(await read_body(scope, receive, 1 << 20) or b"{}"))
            return await respond(send, 200, b"{}")
        if path in ("/health", "/ready"):
            return await respond(
                send,
                200 if (k.ready or path == "/health") else 503,
                b'{"status": "ok"}' if k.ready else b'{"status": "loading"}',
            )
        if path == "/v1/models":
            return await respond(send, 200, self._models())
        if path == CAPABILITIES_PATH and not k.plain:
            caps = DecodeCapabilities(
                protocol_version=k.protocol_version,
                model=k.model,
                engine=k.engine,
                slots=k.slots,
                # (as the real server: its slot table's count, the slots taken and not given back)
                busy_slots=self.slots.busy if self.slots is not None else len(self.records.active),
                max_seq_len=k.max_seq_len,
                num_mtp=1,
                kv_endpoint=k.kv_endpoint or await self._kv_channel(scope["server"][0]),
                layout_fingerprint="fake",
                peers=k.peers,
                features=k.features,
                share_clock=dict(self.slots.share_clock) if self.slots is not None else {},
                kept=k.kept,
            )
            return await respond(send, 200, caps.model_dump_json().encode())
        if path == CANCEL_PATH and not k.plain:
            req = CancelRequest.model_validate_json(await read_body(scope, receive, 1 << 20))
            self.records.cancels.append(req.request_id)
            self.records.cancel_handoffs.append(req.handoff_id or req.request_id)
            event = self._cancel.get(req.request_id)
            if self._by_handoff.get(req.handoff_id or req.request_id) != req.request_id:
                event = None  # as the real server: another attempt's handoff under that request id is left alone
            if event is not None:
                event.set()
            if self.slots is not None:
                self.slots.cancel(req.handoff_id or req.request_id)
            body = CancelResponse(request_id=req.request_id, cancelled=event is not None)
            return await respond(send, 200, body.model_dump_json().encode())
        if path == RESULT_PATH and not k.plain:  # a claim's result, posted by the router (as the real server)
            raw = await read_body(scope, receive, 1 << 24)
            result = HandoffResult.model_validate_json(raw)
            self.records.posted.append(json.loads(raw))
            if k.result_silent:
                while (await receive())["type"] != "http.disconnect":  # until the router gives up on the call
                    pass
                return
            if result.handoff_id not in self._by_handoff:
                return await respond(send, 404, error_body(f"no request waits for {result.handoff_id}", 404))
            self._result_event(result.handoff_id).set()
            return await respond(send, 204, b"")
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return await respond(send, 404, error_body("not found", 404))
        await self._generate(scope, receive, send, path)

    def _replaced(self, handoff_id: str) -> None:
        """A swap took this decode request's slot: it no longer holds it, and its answer ends
        (a 499, as the real server's aborted job answers)."""
        rid = self._by_handoff.get(handoff_id, "")
        event = self._cancel.get(rid)
        if event is not None:
            self.records.active.discard(rid)
            self._swapped.add(handoff_id)
            event.set()

    async def _take(self, table: SlotTable, handoff_id: str, rid: str, wait: SlotWait | None, kv_first: bool,
                    receive: Receive) -> bool:
        """The request's slot (as the real server: now, or after a claim's wait in the queue);
        False when the caller went away first. Refusals raised (:class:`SlotRefused`)."""
        if wait is not None:
            self.records.queued_claims.append(handoff_id)
            if wait.replaces is not None:
                self.records.swaps.append(wait.replaces)
        job = _FakeJob(self, rid, handoff_id)
        taken = table.take(handoff_id, job, wait, kv_first)
        return isinstance(taken, int) or await table.granted_unless(taken, receive())  # as the real server

    async def _generate(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        k, rec = self.knobs, self.records
        rid = self._rid(scope)
        body = json.loads(await read_body(scope, receive, 1 << 26))
        entry = {"request_id": rid, "path": path, "body": body, "t": time.monotonic()}
        params = body.get("kv_transfer_params")
        # a decode request standing in the queue for its request (claim.wait) is recorded when it
        # is answered 429 or its result came: a grant its router no longer needed (stale, swapped)
        # never served that request here
        queued = isinstance(params, dict) and params.get("wait") is not None
        if not queued:
            rec.requests.append(entry)
        problem = self._check(body, rid)
        if problem:
            rec.errors.append(problem)
            return await respond(send, 400, error_body(problem))
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            # as the real decode server: an invalid client field is the client's 400 (not a fake error)
            return await respond(send, 400, error_body(f"invalid max tokens {limit!r}"))
        if limit is not None and k.max_tokens is not None and limit > k.max_tokens:
            return await respond(send, 400, error_body(f"max tokens {limit} over this decode server's {k.max_tokens}"))
        table, handoff_id = self.slots, body["kv_transfer_params"].get("handoff_id", rid)
        claim = "result" in body["kv_transfer_params"]
        wait = body["kv_transfer_params"].get("wait")
        if k.busy or (table is None and len(rec.active) >= k.slots):
            rec.busy.append(rid)  # as the real decode server: 429 until a slot is back
            if queued:
                rec.requests.append(entry)
            rec.requests[-1]["busy"] = True
            return await respond(send, 429, error_body("all decode slots are busy; retry later", 429))
        if table is not None:
            try:
                taken = await self._take(table, handoff_id, rid, SlotWait.model_validate(wait) if wait else None,
                                         not claim, receive)
            except SlotRefused as exc:
                err = exc.error()
                if queued:
                    rec.requests.append({**entry, "busy": exc.reason != "duplicate", "queued": True})
                else:
                    rec.requests[-1]["busy"] = exc.reason != "duplicate"
                    if exc.reason != "duplicate":
                        rec.busy.append(rid)
                return await respond(send, err.status, error_body(exc.message, err.status))
            if not taken:  # the caller went away while it waited
                return
        if claim:  # as the real decode server: 200 once the slot is taken
            send = GrantedSend(send, [(b"content-type", b"text/event-stream" if body.get("stream")
                                       else b"application/json")])
            await send.start(table.free if table is not None else 0)
            rec.granted_first.append(rid)
        if k.fail == "status":
            self._ended(rid, handoff_id)
            return await respond(send, k.fail_status, error_body("fake decode failure", k.fail_status))
        cancel = self._cancel[rid] = asyncio.Event()
        self._by_handoff[handoff_id] = rid
        rec.active.add(rid)
        rec.max_active = max(rec.max_active, len(rec.active))
        watch = asyncio.ensure_future(receive())  # completes when the client goes away
        try:
            if rid in rec.claims and not await self._result_came(body, rid, cancel, watch, send):
                return
            if queued:
                rec.requests.append({**entry, "t": time.monotonic(), "queued": True})
            if k.hold and not await self._hold(rid, cancel, watch):
                return
            await self._emit(send, path, body, rid, cancel, watch)
        finally:
            watch.cancel()
            self._cancel.pop(rid, None)
            self._by_handoff.pop(handoff_id, None)
            if k.release_lag:  # like an engine thread that hands the slot back a little later
                asyncio.get_running_loop().call_later(k.release_lag, self._ended, rid, handoff_id)
            else:
                self._ended(rid, handoff_id)

    async def _kv_channel(self, host: str) -> str:
        """The fake KV channel's address, on ``host`` (this server's; listening from the first
        call, on this server's loop: in its network namespace when it has one)."""
        if self._kv_server is None:
            fake = self

            class _Lines(asyncio.Protocol):
                buf = b""

                def data_received(self, data: bytes) -> None:
                    *lines, self.buf = (self.buf + data).split(b"\n")
                    for line in lines:
                        fake._result_event(HandoffResult.model_validate_json(line).handoff_id).set()

            self._kv_server = await asyncio.get_running_loop().create_server(_Lines, host, 0)
        address = self._kv_server.sockets[0].getsockname()
        return f"{address[0]}:{address[1]}"

    def _result_event(self, handoff_id: str) -> asyncio.Event:
        return self._results.setdefault(handoff_id, asyncio.Event())

    async def _result_came(self, body: dict[str, Any], rid: str, cancel: asyncio.Event, watch: asyncio.Future[Any],
                           send: Send) -> bool:
        """A claim waits for its result as the real server does for KV and result: False when
        cancelled, the client left (recorded) or the wait ran out (answered 504)."""
        handoff_id = body["kv_transfer_params"]["handoff_id"]
        came = asyncio.ensure_future(self._result_event(handoff_id).wait())
        stop = asyncio.ensure_future(cancel.wait())
        try:
            await asyncio.wait([came, stop, watch], timeout=self.knobs.kv_timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            came.cancel()
            stop.cancel()
            self._results.pop(handoff_id, None)
        if came.done() and not came.cancelled():
            return True
        if watch.done():
            self.records.disconnects.append(rid)
            self.records.closed_claims.append(handoff_id)
        elif handoff_id in self._swapped:
            self._swapped.discard(handoff_id)
            await respond(send, 499, error_body("fake decode: the slot went to the swap replacing it", 499))
        elif not cancel.is_set():
            await respond(send, 504, error_body("fake decode: no KV and result within kv_timeout", 504))
        return False

    def _ended(self, rid: str, handoff_id: str) -> None:
        self.records.active.discard(rid)
        if self.slots is not None:
            self.slots.release(handoff_id, "job")

    def _release(self, what: dict[str, Any]) -> None:
        """``{"request_id": id}`` releases that held request, ``{"n": n}`` the n oldest."""
        if "request_id" in what:
            gate = self._held.pop(what["request_id"], None)
            if gate is not None:
                gate.set()
            else:  # not held yet (a claim still waiting for its result): it goes on when it is
                self._permits_for.add(what["request_id"])
            return
        for _ in range(what.get("n", 1)):
            if self._held:
                self._held.pop(next(iter(self._held))).set()
            else:
                self._permits += 1

    async def _hold(self, rid: str, cancel: asyncio.Event, watch: asyncio.Future[Any]) -> bool:
        """Wait for a release; False if cancelled or the client left first."""
        if rid in self._permits_for:
            self._permits_for.discard(rid)
            return True
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
            result: HandoffResult | HandoffClaim = (HandoffClaim.model_validate(params) if "result" in params
                                                    else HandoffResult.model_validate(params))
        except ValidationError as exc:
            return f"decode body: bad kv_transfer_params: {exc}"
        if isinstance(result, HandoffClaim):  # the first token came with the KV (not here: nothing to wait for)
            self.records.claims.append(rid)
        if result.handoff_id != rid and not result.handoff_id.startswith(rid + "#"):
            return f"decode body: handoff_id {result.handoff_id} is not X-Request-Id {rid} or a retry's ({rid}#N)"
        if body.get("logprobs") and (result.result == "with_kv" if isinstance(result, HandoffClaim)
                                     else result.prefill_logprobs is None):
            return "decode body: logprobs asked, no prefill_logprobs"
        return None

    async def _emit(
        self,
        send: Send,
        path: str,
        body: dict[str, Any],
        rid: str,
        cancel: asyncio.Event,
        watch: asyncio.Future[Any],
    ) -> None:
        k = self.knobs
        n = body.get("max_completion_tokens") or body.get("max_tokens") or k.tokens
        chat = path == "/v1/chat/completions"
        stream = bool(body.get("stream"))
        params = body.get("kv_transfer_params") or {}
        # a claim asking for progress: token i is id FAKE_TOKEN_BASE + i, its line ends its write; a
        # resumed one goes on after the output it was given
        progress = bool(params.get("progress"))
        first = len((params.get("resume") or {}).get("output_token_ids") or ())
        if not stream and progress:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            for i in range(first, n):
                if k.fail == "mid_stream" and i == k.fail_after and not first:  # (a resumed answer goes on)
                    raise ConnectionAbortedError("fake decode: dying mid-answer")
                if k.fail == "error_event" and i == k.fail_after and not first:  # the server's own refusal
                    refusal = DecodeRefusal(status=k.fail_status, error=ErrorDetail(
                        message="fake decode: engine failure", type="engine_error", code=k.fail_status))
                    await send({"type": "http.response.body", "body": refusal.event(), "more_body": False})
                    return
                if i > first and k.token_delay:
                    await asyncio.wait([watch], timeout=k.token_delay)
                if watch.done():
                    self.records.disconnects.append(rid)
                    return
                await send({"type": "http.response.body", "body": progress_line([FAKE_TOKEN_BASE + i]),
                            "more_body": True})
            text = "".join(f"t{i} " for i in range(n))
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, **({"message": message} if chat else {"text": text}), "finish_reason": "length"}
            out = {"id": f"cmpl-{rid}", "object": "chat.completion" if chat else "text_completion", "created": 0,
                   "model": k.model, "choices": [choice],
                   "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}}
            await send({"type": "http.response.body", "body": json.dumps(out).encode(), "more_body": False})
            return
        if not stream:
            if k.fail == "mid_stream":  # the answer's head, then the connection drops
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")]})
                raise ConnectionAbortedError("fake decode: dying mid-answer")
            text = "".join(f"t{i} " for i in range(n))
            if k.token_delay:
                await asyncio.wait([watch], timeout=k.token_delay * n)
                if watch.done():
                    self.records.disconnects.append(rid)
                    return
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "length"}
            )
            out = {
                "id": f"cmpl-{rid}",
                "object": "chat.completion" if chat else "text_completion",
                "created": 0,
                "model": k.model,
                "choices": [choice],
                "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
            }
            return await respond(send, 200, json.dumps(out).encode())
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = (
            f'data: {{"id": "cmpl-{rid}", "object": "{obj}", "created": 0, "model": "{k.model}", "choices": ['
        )
        piece = (
            '{{"index": 0, "delta": {{"content": "t{} "}}, "finish_reason": {}}}]}}\n\n'
            if chat
            else '{{"index": 0, "text": "t{} ", "finish_reason": {}}}]}}\n\n'
        )
        t0 = time.monotonic()
        for i in range(first, n):
            if k.fail == "mid_stream" and i == k.fail_after and not first:  # (a resumed answer goes on)
                raise ConnectionAbortedError("fake decode: dying mid-stream")
            if k.fail == "error_event" and i == k.fail_after and not first:  # its own failure, as the real one
                error = {"error": {"message": "fake decode: engine failure", "type": "engine_error", "param": None,
                                   "code": k.fail_status}}
                await send({"type": "http.response.body", "body": b"data: " + json.dumps(error).encode()
                            + b"\n\ndata: [DONE]\n\n", "more_body": False})
                return
            wait = t0 + i * k.token_delay - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if self.token_gate is not None:
                await self.token_gate(i)
            if watch.done():
                self.records.disconnects.append(rid)
                return
            if cancel.is_set():
                return
            chunk = (head + piece.format(i, '"length"' if i == n - 1 else "null")).encode()
            if progress and i < n - 1:
                chunk += progress_line([FAKE_TOKEN_BASE + i])
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        tail = b""
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
            tail = (
                b"data: "
                + json.dumps(
                    {
                        "id": f"cmpl-{rid}",
                        "object": obj,
                        "created": 0,
                        "model": k.model,
                        "choices": [],
                        "usage": usage,
                    }
                ).encode()
                + b"\n\n"
            )
        if k.fail != "no_done":
            tail += b"data: [DONE]\n\n"
        if progress and n > first:
            tail += progress_line([FAKE_TOKEN_BASE + n - 1])
        await send({"type": "http.response.body", "body": tail, "more_body": False})


class _FakeJob:
    """What the slot table holds of a fake request (:class:`decode_server.server.slots.SlotJob`)."""

    def __init__(self, fake: FakeDecode, request_id: str, handoff_id: str) -> None:
        self.fake, self.request_id, self.handoff_id = fake, request_id, handoff_id
        self.keep = None  # a fake decode server keeps no KV

    def replaced(self) -> None:
        self.fake._replaced(self.handoff_id)

    def abort(self, reason: str) -> bool:
        event = self.fake._cancel.get(self.request_id)
        if event is not None:
            event.set()
        return event is not None
