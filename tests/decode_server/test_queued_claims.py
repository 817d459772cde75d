"""A decode request that holds its slot itself and waits for it in the server's queue
(``HandoffClaim.wait``, protocol 7): the router's standing request for the head of its queue
is that request's decode request. Its 200 comes at the grant, in arrival order across
holders; a swap (``replaces``) hands a granted decode request's slot on at once; leaving
the queue leaves nothing behind (no slot, no KV tombstone)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from pd_wire.decode import RESULT_PATH, DecodeRefusal
from pd_wire.handoff import HandoffResult
from tests.decode_server.helpers import handoff, script_for
from tests.fakes.fake_engine import FakeEngineConfig
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(60)


def _claim(wait: dict[str, Any] | None = None, result: str = "with_kv") -> dict[str, Any]:
    claim: dict[str, Any] = {"handoff_id": f"h-{uuid.uuid4().hex[:12]}", "result": result}
    if wait is not None:
        claim["wait"] = {"holder": "router-a", "sent_at": time.monotonic(), "arrived_at": time.monotonic(), **wait}
    return claim


def _result(claim: dict[str, Any], first: int) -> HandoffResult:
    return HandoffResult.model_validate(handoff(first, num_prompt_tokens=7, handoff_id=claim["handoff_id"]))


class _Asker:
    """One decode request in a thread (http.client, so that :meth:`close` can cut its
    connection while it waits): ``granted`` once its status came, ``done`` at its end."""

    def __init__(self, srv, claim: dict[str, Any], max_tokens: int = 20, **fields: Any) -> None:
        self.claim = claim
        self.status: int | None = None
        self.body = b""
        self.granted = threading.Event()
        self.done = threading.Event()
        host, port = srv.url.removeprefix("http://").split(":")
        self._conn = http.client.HTTPConnection(host, int(port), timeout=30)
        self._conn.connect()
        self._fields = fields
        self._thread = threading.Thread(target=self._run, args=(max_tokens,), daemon=True)
        self._thread.start()

    def _run(self, max_tokens: int) -> None:
        try:
            self._conn.request("POST", "/v1/completions", json.dumps({
                "prompt": "x", "max_tokens": max_tokens, "kv_transfer_params": self.claim, **self._fields}),
                {"Content-Type": "application/json"})
            resp = self._conn.getresponse()
            self.status = resp.status
            self.granted.set()
            self.body = resp.read()
        except (OSError, http.client.HTTPException):
            pass
        finally:
            self.granted.set()
            self.done.set()

    def close(self) -> None:
        """Cut the connection (before the status came: the request leaves the queue)."""
        with contextlib.suppress(OSError):
            self._conn.sock.shutdown(socket.SHUT_RDWR)
        self.done.wait(15)
        self._conn.close()


def _free(srv) -> None:
    assert srv.receiver.held() == set(), f"KV receive slot still held: {srv.receiver.held()}"
    assert srv.state.slots.busy == 0 and srv.state.slots.queued == 0


def _hold_the_slot(srv) -> httpx.Response:
    resp = httpx.Client(timeout=30).send(httpx.Request("POST", srv.url + "/v1/completions", json={
        "prompt": "x", "kv_transfer_params": _claim()}), stream=True)
    assert resp.status_code == 200 and srv.state.slots.busy == 1
    return resp


def test_a_queued_claim_is_answered_200_when_its_slot_is_granted_then_decodes(make_server, tokenizer):
    first, rest = script_for(tokenizer, " and then some")
    srv = make_server(FakeEngineConfig(script=rest), slots=1)
    holder = _hold_the_slot(srv)
    queued = _Asker(srv, _claim({"wait_s": 20}))
    wait_until(lambda: srv.state.slots.queued == 1, 15, "the claim waits in the queue")
    assert not queued.granted.is_set()  # no 200 while it waits
    holder.close()  # the first request's client leaves: its slot goes to the waiter
    assert queued.granted.wait(15) and queued.status == 200
    assert srv.state.slots.busy == 1
    srv.receiver.prefilled(_result(queued.claim, first))  # the prefill, sent on the 200
    assert queued.done.wait(15)
    assert httpx.Response(200, content=queued.body).json()["choices"][0]["text"] == " and then some"
    srv.wait_idle()
    _free(srv)


def test_queued_claims_are_granted_in_order_of_arrival_at_their_router(make_server):
    srv = make_server(slots=1)
    holder = _hold_the_slot(srv)
    now = time.monotonic()
    later = _Asker(srv, _claim({"wait_s": 20, "arrived_at": now - 0.1, "sent_at": now}))
    wait_until(lambda: srv.state.slots.queued == 1, 15, "the later arrival waits")
    earlier = _Asker(srv, _claim({"wait_s": 20, "arrived_at": now - 0.5, "sent_at": now}))
    wait_until(lambda: srv.state.slots.queued == 2, 15, "the earlier arrival waits")
    holder.close()
    assert earlier.granted.wait(15) and earlier.status == 200
    assert not later.granted.is_set() and srv.state.slots.queued == 1
    earlier.close()
    srv.receiver.release(earlier.claim["handoff_id"])
    assert later.granted.wait(15) and later.status == 200
    later.close()
    wait_until(lambda: srv.state.slots.busy == 0, 15, "every slot freed")
    _free(srv)


def test_a_swap_hands_a_granted_claims_slot_to_the_next_request_at_once(make_server, tokenizer):
    """The router's standing decode request was granted for a request it served elsewhere: the
    next head's decode request names it in ``replaces`` and gets its slot at once; the stale
    request's answer ends (a ``pd-error`` 499), and nothing of it is left."""
    first, rest = script_for(tokenizer, " and then some")
    srv = make_server(FakeEngineConfig(script=rest), slots=1)
    stale = _Asker(srv, _claim({"wait_s": 20}))
    assert stale.granted.wait(15) and stale.status == 200
    head = _Asker(srv, _claim({"wait_s": 0, "replaces": stale.claim["handoff_id"]}))
    assert head.granted.wait(15) and head.status == 200
    assert stale.done.wait(15)
    refusal = DecodeRefusal.of_event(stale.body)
    assert refusal is not None and refusal.status == 499, stale.body
    assert srv.state.slots.busy == 1 and srv.state.slots.holders(head.claim["handoff_id"]) == {"job"}
    # no KV was sent for the stale one here: its release leaves no tombstone that would refuse its
    # KV when the same request (not served elsewhere, only overtaken) is granted here later
    assert stale.claim["handoff_id"] not in srv.receiver.tombstoned
    srv.receiver.prefilled(_result(head.claim, first))
    assert head.done.wait(15)
    assert httpx.Response(200, content=head.body).json()["choices"][0]["text"] == " and then some"
    srv.wait_idle()
    _free(srv)


def test_a_swap_refused_at_once_when_an_older_request_waits_there(make_server):
    """The slot handed on goes to whoever waits longest: an older arrival of another router
    gets it; the swap (no wait) is a 429 at once and leaves no place in the queue."""
    srv = make_server(slots=1)
    stale = _Asker(srv, _claim({"wait_s": 20}))
    assert stale.granted.wait(15) and stale.status == 200
    now = time.monotonic()
    older = _Asker(srv, _claim({"wait_s": 20, "holder": "router-b", "arrived_at": now - 5, "sent_at": now}))
    wait_until(lambda: srv.state.slots.queued == 1, 15, "the other router's request waits")
    head = _Asker(srv, _claim({"wait_s": 0, "arrived_at": now - 1, "replaces": stale.claim["handoff_id"]}))
    assert head.granted.wait(15) and head.status == 429
    assert older.granted.wait(15) and older.status == 200
    assert srv.state.slots.queued == 0
    older.close()
    wait_until(lambda: srv.state.slots.busy == 0, 15, "every slot freed")
    _free(srv)


def test_a_claim_leaving_the_queue_leaves_no_place_slot_or_kv_tombstone(make_server):
    srv = make_server(slots=1)
    holder = _hold_the_slot(srv)
    queued = _Asker(srv, _claim({"wait_s": 20}))
    wait_until(lambda: srv.state.slots.queued == 1, 15, "the claim waits in the queue")
    queued.close()
    wait_until(lambda: srv.state.slots.queued == 0, 15, "the claim left the queue")
    holder.close()
    wait_until(lambda: srv.state.slots.busy == 0, 15, "the held slot freed")
    assert queued.claim["handoff_id"] not in srv.receiver.release_calls  # its KV was never expected here
    _free(srv)


def test_a_queued_claims_wait_running_out_is_a_429(make_server):
    srv = make_server(slots=1)
    holder = _hold_the_slot(srv)
    resp = httpx.post(srv.url + "/v1/completions", timeout=30,
                      json={"prompt": "x", "kv_transfer_params": _claim({"wait_s": 0.2})})
    assert resp.status_code == 429 and resp.json()["error"]["type"] == "rate_limit_error", resp.text
    holder.close()
    wait_until(lambda: srv.state.slots.busy == 0, 15, "the held slot freed")
    _free(srv)


def test_a_claim_holding_its_slot_refused_at_once_leaves_no_kv_tombstone(make_server):
    """(Its prefill goes out only on a 200: a 429 gives back no KV, and a release would make the
    receiver refuse the KV of the same handoff when it asks again and is granted.)"""
    srv = make_server(slots=1)
    holder = _hold_the_slot(srv)
    claim = _claim()
    resp = httpx.post(srv.url + "/v1/completions", timeout=30, json={"prompt": "x", "kv_transfer_params": claim})
    assert resp.status_code == 429, resp.text
    assert claim["handoff_id"] not in srv.receiver.tombstoned
    holder.close()
    wait_until(lambda: srv.state.slots.busy == 0, 15, "the held slot freed")
    _free(srv)


# ---- a claim whose result the router posts (HandoffClaim.result "posted") -----------------------
def test_a_claim_whose_result_is_posted_decodes_with_the_prefills_logprobs(make_server, tokenizer):
    """A request whose decode needs vLLM's answer (here the first token's logprobs) holds its slot
    with its decode request too: 200 at the grant, then the router posts the result it read from
    vLLM's answer (RESULT_PATH), and the decode starts once KV and result are there."""
    first, rest = script_for(tokenizer, "hello world")
    srv = make_server(FakeEngineConfig(script=rest), slots=1)
    asker = _Asker(srv, _claim({"wait_s": 20}, result="posted"), logprobs=1)
    assert asker.granted.wait(15) and asker.status == 200
    handoff_id = asker.claim["handoff_id"]
    wait_until(lambda: handoff_id in srv.receiver.waits, 15, "the claim waits for KV and result")
    prefill_lp = {"tokens": ["hello"], "token_logprobs": [-0.125], "top_logprobs": [{"hello": -0.125}],
                  "text_offset": [0]}
    posted = httpx.post(srv.url + RESULT_PATH, timeout=10, content=HandoffResult.model_validate(
        handoff(first, handoff_id=handoff_id, prefill_logprobs=prefill_lp)).model_dump_json())
    assert posted.status_code == 204, posted.text
    assert asker.done.wait(15)
    lp = httpx.Response(200, content=asker.body).json()["choices"][0]["logprobs"]
    assert lp["tokens"][0] == "hello" and lp["token_logprobs"][0] == -0.125 and len(lp["tokens"]) == len(rest) + 1
    srv.wait_idle()
    _free(srv)


def test_a_result_posted_for_no_waiting_request_is_a_404(make_server):
    srv = make_server(slots=1)
    posted = httpx.post(srv.url + RESULT_PATH, timeout=10, content=HandoffResult.model_validate(
        handoff(5, handoff_id="nobody")).model_dump_json())
    assert posted.status_code == 404 and posted.json()["error"]["param"] == "handoff_id", posted.text
    with_kv = _Asker(srv, _claim({"wait_s": 20}))  # a claim whose result comes with the KV: not posted
    assert with_kv.granted.wait(15) and with_kv.status == 200
    wait_until(lambda: with_kv.claim["handoff_id"] in srv.receiver.waits, 15, "the claim waits for its KV")
    posted = httpx.post(srv.url + RESULT_PATH, timeout=10, content=HandoffResult.model_validate(
        handoff(5, handoff_id=with_kv.claim["handoff_id"])).model_dump_json())
    assert posted.status_code == 404, posted.text
    with_kv.close()
    wait_until(lambda: srv.state.slots.busy == 0, 15, "its slot freed")
    _free(srv)
