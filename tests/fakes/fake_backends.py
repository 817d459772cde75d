"""Fake prefill and decode servers speaking the router's contract, for router tests
and bench/router_overhead.py.

Both are raw ASGI apps, served on real loopback sockets either in-process
(:class:`ServerThread`, one uvicorn per thread) or as subprocesses
(``python -m tests.fakes.fake_backends prefill|decode --port P ...``). Their knobs
are changed and their records read over HTTP (``POST /fake/config``, ``GET
/fake/records``, ``POST /fake/release``), so a test drives them the same way in both
modes.

FakePrefill checks the router's prefill rewrite (docs/facts.md §1) and answers 400 naming
the violation; FakeDecode checks ``kv_transfer_params`` and slot limits and streams
``tokens`` OpenAI SSE chunks ``token_delay`` seconds apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from typing import Any

import uvicorn
from pydantic import BaseModel, ConfigDict

from pd_router.asgi import Receive, Scope, Send, read_body, respond
from pd_wire.handoff import HandoffResult, HandoffTarget
from tests.fakes.fake_common import FakeBase, error_body, wait_or_disconnect, wait_or_event
from tests.fakes.fake_decode import DecodeKnobs, FakeDecode

FAKE_PROMPT_IDS = [11, 12, 13, 14, 3]  # what the fake prefill's /tokenize answers (5 tokens, the last 3)

__all__ = ["DecodeKnobs", "FakeDecode", "FakePrefill", "PrefillKnobs", "ServerThread", "main"]


class PrefillKnobs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = "tiny"
    delay: float = 0.0
    healthy: bool = True
    hold_health: int = 0  # the next N GET /health are held: answered only after a later one
    fail: str | None = None  # "status" | "handoff_failed" | "bad_json" | "no_params"
    fail_times: int | None = None  # fail only the next N requests (None: all)
    handoff_reason: str | None = None  # HandoffResult.reason of "handoff_failed" (e.g. "busy")
    running: float | None = None  # vLLM's load gauges on /metrics (None: no /metrics, like a non-vLLM server)
    waiting: float = 0.0
    hold_answer: bool = False  # after sending the result with the KV, answer only on POST /fake/release
    fail_status: int = 400
    fail_body: str = (
        '{"error": {"message": "prompt too long", "type": "BadRequestError", "param": null, "code": 400}}'
    )


class FakePrefill(FakeBase[PrefillKnobs]):
    def __init__(self, **knobs: Any) -> None:
        super().__init__()
        self.knobs = PrefillKnobs(**knobs)
        self._health_released = asyncio.Event()  # set by an answered /health: the held ones answer then
        self._kv_channels: dict[str, asyncio.StreamWriter] = {}  # KV endpoint -> standing connection
        self._answers_released = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or await self._control(scope, receive, send):
            return
        k, path = self.knobs, scope["path"]
        if path == "/health":
            return await self._health(receive, send)
        if path == "/fake/release":  # the answers held back (hold_answer) go out
            self._answers_released.set()
            self._answers_released = asyncio.Event()
            return await respond(send, 200, b"{}")
        if path == "/v1/models":
            return await respond(send, 200, self._models())
        if path == "/metrics" and k.running is not None:
            return await respond(send, 200, self._load_metrics(), b"text/plain; version=0.0.4")
        if path == "/tokenize":  # every prompt is FAKE_PROMPT_IDS (its 5 tokens; the last is the handoff's)
            self.records.requests.append({"request_id": self._rid(scope), "path": path, "t": time.monotonic(),
                                          "body": json.loads(await read_body(scope, receive, 1 << 26))})
            return await respond(send, 200, json.dumps({"count": 5, "tokens": FAKE_PROMPT_IDS}).encode())
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return await respond(send, 404, error_body("not found", 404))
        rid = self._rid(scope)
        body = json.loads(await read_body(scope, receive, 1 << 26))
        traceparent = next((v.decode() for k, v in scope["headers"] if k == b"traceparent"), None)
        self.records.requests.append({"request_id": rid, "path": path, "body": body, "traceparent": traceparent,
                                      "t": time.monotonic()})
        problem = self._check(path, body)
        if problem:
            self.records.errors.append(problem)
            return await respond(send, 400, error_body(problem))
        self.records.active.add(rid)
        try:
            if k.delay and not await wait_or_disconnect(receive, k.delay):
                self.records.disconnects.append(rid)
                return
            fail = k.fail
            if fail is not None and k.fail_times is not None:
                if k.fail_times <= 0:
                    fail = None
                else:
                    self.knobs = k.model_copy(update={"fail_times": k.fail_times - 1})
            if fail == "status":
                return await respond(send, k.fail_status, k.fail_body.encode())
            if fail == "bad_json":
                return await respond(send, 200, b"{not json")
            answer = self._answer(path, body, rid, fail)
            await self._send_with_kv(body, answer)
            if k.hold_answer:  # still in records.active meanwhile
                if not await wait_or_event(receive, self._answers_released):
                    self.records.disconnects.append(rid)
                    return
            await respond(send, 200, json.dumps(answer).encode())
        finally:
            self.records.active.discard(rid)

    async def _send_with_kv(self, body: dict[str, Any], answer: dict[str, Any]) -> None:
        """``result_with_kv``: the result to the fake decode server's KV channel at the target's
        endpoint, one line on a standing connection, as the connector sends Prefilled (not
        when the handoff failed)."""
        params, result = body["kv_transfer_params"], answer.get("kv_transfer_params")
        if not params.get("result_with_kv") or not isinstance(result, dict) or result.get("status") == "failed":
            return
        endpoint = params["kv_endpoint"]
        try:
            writer = self._kv_channels.get(endpoint)
            if writer is None or writer.is_closing():
                host, _, port = endpoint.rpartition(":")
                _, writer = await asyncio.open_connection(host, int(port))
                self._kv_channels[endpoint] = writer
            writer.write(json.dumps(result).encode() + b"\n")
        except OSError as exc:  # as a lost Prefilled: the decode server's wait runs out
            self.records.errors.append(f"prefill: result not delivered to {endpoint}: {exc}")

    async def _health(self, receive: Receive, send: Send) -> None:
        """``hold_health``: this answer waits until a later /health is answered (or its client leaves)."""
        if self.knobs.hold_health > 0:
            self.knobs = self.knobs.model_copy(update={"hold_health": self.knobs.hold_health - 1})
            self.records.health.append("held")
            if not await wait_or_event(receive, self._health_released):
                return
        else:
            self.records.health.append("answered")
            self._health_released.set()
            self._health_released = asyncio.Event()
        await respond(send, 200 if self.knobs.healthy else 503, b"{}")

    def _load_metrics(self) -> bytes:
        k, labels = self.knobs, f'{{engine="0",model_name="{self.knobs.model}"}}'
        return (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} {k.running}\n"
                f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{labels} {k.waiting}\n").encode()

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

    def _answer(self, path: str, body: dict[str, Any], rid: str, fail: str | None) -> dict[str, Any]:
        params = body["kv_transfer_params"]
        if params.get("do_remote_decode"):  # vLLM NIXL convention (plain decode)
            kv: dict[str, Any] = {
                "do_remote_prefill": True,
                "remote_engine_id": "fake-engine",
                "remote_block_ids": [1, 2],
                "remote_host": "127.0.0.1",
                "remote_port": 1,
            }
        else:
            target = HandoffTarget.model_validate(params)
            prompt = body.get("prompt")  # a resumed prefill's: the prompt's ids and the output's
            ids = prompt if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt) else ()
            kv = HandoffResult(
                handoff_id=target.handoff_id,
                kv_endpoint=target.kv_endpoint,
                num_prompt_tokens=len(ids) or 5,
                first_token_id=7,
                last_prompt_token_id=3,
                status="failed" if fail == "handoff_failed" else "sent",
                error="fake handoff failure" if fail == "handoff_failed" else None,
                reason=self.knobs.handoff_reason if fail == "handoff_failed" else None,
            ).model_dump()
            kv["remote_prefill_cached_tokens"] = 0  # vLLM adds keys of its own
        wants = body.get("logprobs")
        logprobs = {"content": [{"token": "t7", "logprob": -0.5, "top_logprobs": []}]} if wants else None
        if path == "/v1/chat/completions":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": "t7"},
                "logprobs": logprobs,
                "finish_reason": "length",
            }
        else:
            choice = {"index": 0, "text": "t7", "logprobs": logprobs, "finish_reason": "length"}
        answer = {
            "id": f"cmpl-{rid}",
            "object": "chat.completion" if "chat" in path else "text_completion",
            "model": self.knobs.model,
            "choices": [choice],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }
        if fail != "no_params":
            answer["kv_transfer_params"] = kv
        return answer


class ServerThread:
    """An ASGI app on 127.0.0.1:port (or ``host``), served by uvicorn in its own thread and loop."""

    def __init__(self, app: Any, port: int, loop: str = "asyncio", server: uvicorn.Server | None = None,
                 host: str = "127.0.0.1", netns: str | None = None) -> None:
        """``server``: a server already configured for ``app`` on ``host``:``port`` (the
        router's own, with its HTTP limits and drain); default a plain uvicorn one.
        ``netns``: serve from inside that network namespace (a node of tests/nodes.py): the
        thread enters it before it makes its sockets."""
        self.app, self.port = app, port
        self.url = f"http://{host}:{port}"
        if server is None:
            config = uvicorn.Config(
                app,
                host=host,
                port=port,
                loop=loop,
                http="httptools",
                log_level="warning",
                access_log=False,
                lifespan="auto",
            )
            server = uvicorn.Server(config)
        self.server = server

        def run() -> None:
            if netns is not None:
                from tests.nodes import enter_netns

                enter_netns(netns)
            self.server.run()

        self.thread = threading.Thread(target=run, daemon=True, name=f"uvicorn-{port}")

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
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        lifespan="off",
    )


if __name__ == "__main__":
    main()
