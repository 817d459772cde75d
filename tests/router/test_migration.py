"""An answer whose decode server is lost after it began goes on on another decode server
(issue 49), against the fake servers: the progress lines stripped, the tokens so far sent to the
resuming server, the prompt's and the output's ids prefilled, one answer to the client. (The real
stack, the network-namespace hosts and the seeded sampling: tests/e2e/test_migration.py,
tests/multinode/test_migration_netns.py.)"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from pd_router.request.trail import Trail, server_error
from pd_wire.decode import progress_line
from tests.fakes.fake_backends import FAKE_PROMPT_IDS
from tests.fakes.fake_decode import FAKE_TOKEN_BASE
from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)
TOKENS = 8
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": TOKENS}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS}


def _events(text: str) -> list[str]:
    return [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]


def _texts(events: list[str], chat: bool) -> list[str]:
    out = []
    for e in events[:-1]:
        choice = json.loads(e)["choices"][0]
        out.append(choice["delta"]["content"] if chat else choice["text"])
    return out


def _claims(rig) -> list[dict]:
    return [r["body"]["kv_transfer_params"] for b in rig.decodes for r in rig.records(b)["requests"]]


def _metric(rig, text: str) -> float:
    for line in httpx.get(rig.url + "/metrics").text.splitlines():
        if line.startswith(text + " "):
            return float(line.split()[-1])
    return 0.0


# ---- the progress lines ------------------------------------------------------------------------
def test_the_trail_passes_whole_writes_and_keeps_their_tokens_whatever_the_reads():
    """Progress lines end each write: a write passes once its line came, however the bytes were
    split; text that looks like a line inside an event is text; the bytes after the last line
    are held (a write a lost server never finished) until the answer ends."""
    writes = [b'data: {"t":"a: pd-tokens 9"}\n\n' + progress_line([1, 2]), progress_line([]),
              b"data: {\"t\":\"b\"}\n\n" + progress_line([3]), b"data: [DONE]\n\n" + progress_line([4])]
    stream = b"".join(writes)
    for cut in range(1, 12):  # every split of the stream into reads of `cut` bytes
        trail = Trail()
        passed = b"".join(trail.feed(stream[i:i + cut]) for i in range(0, len(stream), cut))
        assert passed == b'data: {"t":"a: pd-tokens 9"}\n\ndata: {"t":"b"}\n\ndata: [DONE]\n\n'
        assert trail.tokens == [1, 2, 3, 4] and trail.steps == 4 and trail.rest() == b""
    trail = Trail()
    assert trail.feed(writes[0] + b'data: {"t":"half') == b'data: {"t":"a: pd-tokens 9"}\n\n'
    assert trail.tokens == [1, 2] and trail.rest() == b'data: {"t":"half'


def test_only_a_servers_own_failure_in_its_last_event_is_a_loss():
    def event(code: int) -> bytes:
        return b'data: {"error": {"message": "m", "type": "t", "code": %d}}\n\ndata: [DONE]\n\n' % code

    assert server_error(event(500)) == "m"
    assert server_error(event(503)) == "m"
    assert server_error(event(400)) is None
    assert server_error(b"data: [DONE]\n\n") is None


# ---- a lost decode server ----------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_whose_decode_server_dies_goes_on_on_another(make_rig, chat):
    """Both fakes die after 3 tokens of a new answer (a resumed one goes on): the client's
    stream is every token once, in order, no error; the resuming server got the 3 tokens and
    the original prompt's length and last token; prefill got the prompt's ids (/tokenize) and
    the output's after them; the move is counted; nothing leaks."""
    rig = make_rig(n_decode=2, decode={"fail": "mid_stream", "fail_after": 3})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    resp = httpx.post(rig.url + path, json={**(CHAT if chat else COMPLETION), "stream": True}, timeout=20)
    assert resp.status_code == 200
    events = _events(resp.text)
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
    assert "".join(_texts(events, chat)) == "".join(f"t{i} " for i in range(TOKENS))
    assert len({json.loads(e)["id"] for e in events[:-1]}) == 1
    claims = _claims(rig)
    assert len(claims) == 2 and "resume" not in claims[0] and claims[0]["progress"]
    assert claims[1]["resume"] == {"output_token_ids": [FAKE_TOKEN_BASE + i for i in range(3)],
                                   "prompt_tokens": len(FAKE_PROMPT_IDS), "context_token_id": FAKE_PROMPT_IDS[-1],
                                   "prompt_token_ids": FAKE_PROMPT_IDS}
    assert claims[1]["created"] == claims[0]["created"] and claims[1]["handoff_id"] != claims[0]["handoff_id"]
    prefill = rig.records(rig.prefills[0])["requests"]
    assert [r["path"] for r in prefill] == [path, "/tokenize", "/v1/completions"]
    assert prefill[2]["body"]["prompt"] == FAKE_PROMPT_IDS + [FAKE_TOKEN_BASE + i for i in range(3)]
    assert prefill[2]["body"]["kv_transfer_params"]["result_with_kv"] is True
    assert _metric(rig, 'pd_router_migrations_total{outcome="resumed",reason="connection_lost"}') == 1
    assert _metric(rig, "pd_router_migration_seconds_count") == 1
    rig.assert_no_leaks()


def test_an_answer_not_streamed_is_whole_from_the_server_that_resumed_it(make_rig):
    rig = make_rig(n_decode=2, decode={"fail": "mid_stream", "fail_after": 3})
    resp = httpx.post(rig.url + "/v1/completions", json=COMPLETION, timeout=20)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "".join(f"t{i} " for i in range(TOKENS))
    assert ": pd-tokens" not in resp.text
    assert _claims(rig)[1]["resume"]["output_token_ids"] == [FAKE_TOKEN_BASE + i for i in range(3)]
    rig.assert_no_leaks()


def test_a_silent_decode_server_is_left_after_the_stall_deadline(make_rig):
    """The first answer's server stops after 3 tokens and says nothing more (its connection
    open): after --stall-timeout the answer goes on on the other server."""
    rig = make_rig(n_decode=2, stall_timeout=0.5)
    stopped, never = threading.Event(), threading.Event()

    async def gate(i: int) -> None:
        if i == 3 and not stopped.is_set():
            stopped.set()
            await asyncio.to_thread(never.wait, 30)

    for d in rig.decodes:
        d.app.token_gate = gate
    try:
        resp = httpx.post(rig.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=20)
        events = _events(resp.text)
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
        assert "".join(_texts(events, False)) == "".join(f"t{i} " for i in range(TOKENS))
        assert _metric(rig, 'pd_router_migrations_total{outcome="resumed",reason="stalled"}') == 1
    finally:
        never.set()
    rig.assert_no_leaks()


def test_with_no_server_to_move_to_or_no_move_allowed_the_stream_ends_with_its_error_event(make_rig):
    """One decode server, lost: the error event of before, saying why the answer did not move;
    --max-migrations 0: the same, without trying."""
    for settings, why in (({}, "moving the answer to another decode server failed"),
                          ({"max_migrations": 0}, "not moved to another decode server")):
        rig = make_rig(decode={"fail": "mid_stream", "fail_after": 3}, **settings)
        resp = httpx.post(rig.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=20)
        events = _events(resp.text)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "bad_upstream_response" and why in error["message"], error
        assert "".join(_texts(events[:-1], False)) == "t0 t1 t2 "
        outcome = "limit" if settings else "failed"
        assert _metric(rig, f'pd_router_migrations_total{{outcome="{outcome}",reason="connection_lost"}}') == 1
        rig.assert_no_leaks()


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("status", [500, 400])
def test_a_decode_servers_own_failure_moves_the_answer_and_the_requests_does_not(make_rig, stream, status):
    """The server ends the answer with its own failure (a 5xx error event, or the refusal of an
    answer not streamed): the answer moves; a 4xx is the request's own: relayed as it is."""
    rig = make_rig(n_decode=2, decode={"fail": "error_event", "fail_after": 3, "fail_status": status})
    resp = httpx.post(rig.url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=20)
    moved = _metric(rig, 'pd_router_migrations_total{outcome="resumed",reason="error_event"}')
    if status >= 500:
        assert resp.status_code == 200, resp.text
        text = "".join(_texts(_events(resp.text), False)) if stream else resp.json()["choices"][0]["text"]
        assert text == "".join(f"t{i} " for i in range(TOKENS)) and moved == 1
    else:
        assert moved == 0
        if stream:
            assert json.loads(_events(resp.text)[-2])["error"]["code"] == 400
        else:
            assert resp.status_code == 400, resp.text
    rig.assert_no_leaks()
