"""decode_server/server/granted.py: the answer of a decode request holding its slot itself,
whose 200 went out at the take (the ASGI messages it passes, drops and rewrites)."""

from __future__ import annotations

import asyncio
from typing import Any

from decode_server.server.granted import GrantedSend
from pd_wire.decode import DecodeRefusal

HEAD = [(b"content-type", b"text/event-stream")]


def _run(*messages: dict[str, Any]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def go() -> None:
        granted = GrantedSend(send, HEAD)
        await granted.start(3)
        for message in messages:
            await granted(message)

    asyncio.run(go())
    return sent


def test_the_200_goes_first_and_the_answers_own_start_is_dropped():
    sent = _run({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]},
                {"type": "http.response.body", "body": b"data: x", "more_body": True},
                {"type": "http.response.body", "body": b""})
    # (the server's free slots after the grant in the 200's headers)
    assert sent == [{"type": "http.response.start", "status": 200, "headers": [*HEAD, (b"x-pd-free-slots", b"3")]},
                    {"type": "http.response.body", "body": b"data: x", "more_body": True},
                    {"type": "http.response.body", "body": b""}]


def test_a_refusal_becomes_the_bodys_one_pd_error_event():
    body = b'{"error": {"message": "no KV", "type": "kv_timeout", "param": null, "code": 504}}'
    sent = _run({"type": "http.response.start", "status": 504, "headers": []},
                {"type": "http.response.body", "body": body[:20], "more_body": True},
                {"type": "http.response.body", "body": body[20:]})
    assert len(sent) == 2 and "more_body" not in sent[1]
    refusal = DecodeRefusal.of_event(sent[1]["body"])
    assert refusal is not None and refusal.status == 504
    assert (refusal.error.type, refusal.error.message, refusal.error.code) == ("kv_timeout", "no KV", 504)


def test_a_refusal_whose_body_is_not_an_openai_error_keeps_its_text():
    sent = _run({"type": "http.response.start", "status": 500, "headers": []},
                {"type": "http.response.body", "body": b"Internal Server Error"})
    refusal = DecodeRefusal.of_event(sent[1]["body"])
    assert refusal is not None and refusal.status == 500 and refusal.error.message == "Internal Server Error"


def test_a_body_that_is_not_a_refusal_is_none():
    assert DecodeRefusal.of_event(b'data: {"choices": []}\n\n') is None
    assert DecodeRefusal.of_event(b'{"id": "cmpl-1"}') is None
