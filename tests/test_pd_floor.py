"""bench/pd_floor.py, the floor bench/router_overhead.py measures the router against: it
speaks the router's protocol to the fakes (the decode request first, holding its slot, then
the prefill on its 200 with the first token going with the KV) and relays the decode answer
byte for byte, several requests in turn on one client connection."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.pd_floor import start
from tests.fakes.fake_backends import FakeDecode, FakePrefill, ServerThread
from tests.procs import free_port

pytestmark = pytest.mark.timeout(60)


async def _two_requests(prefill: int, decode: int) -> list[bytes]:
    floor = await start(0, ("127.0.0.1", prefill), ("127.0.0.1", decode))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", floor.sockets[0].getsockname()[1])
        answers = []
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hello"})):
            raw = json.dumps({"model": "tiny", "max_tokens": 3, "stream": True,
                              "stream_options": {"include_usage": True}, **body}).encode()
            writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(raw), raw))
            answer = b""
            while not answer.endswith(b"\r\n0\r\n\r\n"):  # the chunked answer's end, on a kept-alive connection
                data = await asyncio.wait_for(reader.read(65536), 10)
                assert data, answer
                answer += data
            answers.append(answer)
        writer.close()
        return answers
    finally:
        floor.close()


def _through_the_floor() -> tuple[list[bytes], FakePrefill, FakeDecode]:
    """Two requests through the floor in front of a fresh fake prefill and fake decode."""
    prefill_app, decode_app = FakePrefill(model="tiny"), FakeDecode(model="tiny", slots=1)
    prefill, decode = ServerThread(prefill_app, free_port()).start(), ServerThread(decode_app, free_port()).start()
    try:
        return asyncio.run(_two_requests(prefill.port, decode.port)), prefill_app, decode_app
    finally:
        prefill.stop()
        decode.stop()


def test_the_minimal_pd_relay_takes_the_slot_then_prefills_and_relays_the_decode_answer():
    """The decode request takes the slot and is answered 200 at once; the prefill (its result
    with the KV) follows that 200; the decode answer is relayed as the decode server sent it."""
    answers, prefill_app, decode_app = _through_the_floor()
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        assert answer.count(b'"choices": [{') == 3  # the decode server's token events, as it sent them
        assert b"data: [DONE]" in answer
    # (the fake prefill answers 400 to a body not rewritten as the router's)
    assert not prefill_app.records.errors and not decode_app.records.errors
    assert all(r["body"]["kv_transfer_params"]["result_with_kv"] for r in prefill_app.records.requests)
    assert len(decode_app.records.claims) == 2 and decode_app.records.closed_claims == []
    assert len(decode_app.records.granted_first) == 2
    handoffs = [r["body"]["kv_transfer_params"]["handoff_id"] for r in prefill_app.records.requests]
    assert [r["body"]["kv_transfer_params"]["handoff_id"] for r in decode_app.records.requests] == handoffs
    for sent, prefilled in zip(decode_app.records.requests, prefill_app.records.requests, strict=True):
        assert sent["t"] < prefilled["t"]
