"""KV reuse across turns, the router's part (issue 62; docs/router.md, "Which decode server a
conversation's next turn goes to"): the conversation keys (pd_router/request/keys.py), the
decode server keeping a prefix chosen first when it has a free slot (and only then), the
router's view of the kept keys (probes and clean answers), the prefill affinity, and the
``keep`` a decode request's claim carries."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from pd_router.fleet.backends import Backends, PrefillBackend
from pd_router.fleet.kept import KeptKeys, PrefillAffinity
from pd_router.request.keys import IDS_CHUNK, MAX_UNITS, TEXT_CHUNK, conversation_keys, secret
from pd_router.slots.pool import SlotHooks, SlotPool
from pd_router.tenants import DEFAULT_TENANT
from pd_wire.decode import DecodeCapabilities
from pd_wire.handoff import PROTOCOL_VERSION, KeepKey, PeerStatus
from pd_wire.requests import Endpoint
from tests.fakes.scripted_slots import ScriptedRequest, ScriptedServers
from tests.metrics import metric_sum
from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(30)
KEY = secret("decode-api-key")
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
TURN1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list the files"}]
TURN2 = [*TURN1,
         {"role": "assistant", "content": None,
          "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "a.txt b.txt"}]


def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "tools": TOOLS, **extra}


def keys_of(body: dict[str, Any], tenant: str = "t1", endpoint: Endpoint = Endpoint.CHAT, model: str = MODEL,
            key: bytes = KEY):
    found = conversation_keys(key, tenant, endpoint, model, body)
    assert found is not None
    return found


# ---- the keys ---------------------------------------------------------------------------------

def test_keys_are_stable_across_calls_and_routers_and_keyed_by_the_decode_api_key() -> None:
    one = keys_of(chat(TURN1))
    # another router (another process: the secret derived again from the same decode API key)
    other = conversation_keys(secret("decode-api-key"), "t1", Endpoint.CHAT, MODEL, chat([dict(m) for m in TURN1]))
    assert other == one and one.keep() == KeepKey(scope=one.scope, conversation=one.conversation)
    assert len(one.prefixes) == len(TURN1) and one.prefixes[one.conversation] == len(TURN1)
    # key order inside a message is not the conversation's
    reordered = [{"content": m["content"], "role": m["role"]} for m in TURN1]
    assert keys_of(chat(reordered)) == one
    assert keys_of(chat(TURN1), key=secret("another key")).conversation != one.conversation
    assert keys_of(chat(TURN1), key=secret(None)).conversation != one.conversation


def test_keys_differ_per_tenant_cache_salt_model_and_endpoint() -> None:
    base = keys_of(chat(TURN1))
    others = [keys_of(chat(TURN1), tenant="t2"), keys_of(chat(TURN1, cache_salt="s")),
              keys_of(chat(TURN1), model="other")]
    assert len({base.scope, *(o.scope for o in others)}) == 4
    assert all(o.conversation not in base.prefixes for o in others)
    both = chat(TURN1, prompt="x" * TEXT_CHUNK)  # (each endpoint keys its own field)
    assert keys_of(both).scope == base.scope != keys_of(both, endpoint=Endpoint.COMPLETIONS).scope
    # what is rendered before the messages is part of every key
    assert keys_of(chat(TURN1, tools=[])).conversation != base.conversation
    assert keys_of(chat(TURN1, chat_template_kwargs={"enable_thinking": False})).conversation != base.conversation


def test_a_chat_next_turn_holds_the_turn_before() -> None:
    turn1, turn2 = keys_of(chat(TURN1)), keys_of(chat(TURN2))
    assert turn2.prefixes[turn1.conversation] == len(TURN1) and turn2.conversation != turn1.conversation
    assert turn2.scope == turn1.scope
    # an earlier message changed: a conversation of its own
    edited = [TURN2[0], {"role": "user", "content": "list the dirs"}, *TURN2[2:]]
    assert turn1.conversation not in keys_of(chat(edited)).prefixes


@pytest.mark.parametrize("kind", ["text", "ids"])
def test_a_completion_next_turn_holds_the_turn_before(kind: str) -> None:
    if kind == "text":
        prompt1: Any = "".join(chr(ord("a") + i % 26) for i in range(2 * TEXT_CHUNK + 17))
        prompt2: Any = prompt1 + " the answer" + " the next question" * 30
        units1 = len(prompt1) // TEXT_CHUNK
    else:
        prompt1 = list(range(2 * IDS_CHUNK + 5))
        prompt2 = prompt1 + [7, 8, 9] + list(range(100))
        units1 = len(prompt1) // IDS_CHUNK
    turn1 = keys_of({"prompt": prompt1}, endpoint=Endpoint.COMPLETIONS)
    turn2 = keys_of({"prompt": prompt2}, endpoint=Endpoint.COMPLETIONS)
    assert len(turn1.prefixes) == units1 == 2  # whole chunks only
    assert turn2.prefixes[turn1.conversation] == units1 and len(turn2.prefixes) > units1
    assert keys_of({"prompt": [prompt1]}, endpoint=Endpoint.COMPLETIONS) == turn1  # a list of one is one prompt
    assert turn1.conversation not in keys_of({"prompt": prompt1[1:]}, endpoint=Endpoint.COMPLETIONS).prefixes


def test_requests_without_keys() -> None:
    long = "x" * (2 * TEXT_CHUNK)
    for body in ({"prompt": [long, long]},  # several prompts
                 {"prompt": "x" * (TEXT_CHUNK - 1)},  # no whole unit
                 {"prompt": list(range(IDS_CHUNK - 1))},
                 {"prompt": "x" * (TEXT_CHUNK * (MAX_UNITS + 1))}):  # past the bound
        assert conversation_keys(KEY, "t", Endpoint.COMPLETIONS, MODEL, body) is None, body
    assert conversation_keys(KEY, "t", Endpoint.CHAT, MODEL, {"messages": []}) is None
    assert conversation_keys(KEY, "t", Endpoint.CHAT, MODEL,
                             {"messages": [{"role": "user", "content": "x"}] * (MAX_UNITS + 1)}) is None
    assert conversation_keys(KEY, "t", Endpoint.COMPLETIONS, MODEL, {"prompt": "x" * TEXT_CHUNK}) is not None


# ---- the router's view of what a decode server keeps --------------------------------------------

def test_a_probe_sent_before_an_answer_ended_does_not_erase_its_key() -> None:
    a, b, c, d = (f"{i:032x}" for i in range(4))
    kept = KeptKeys()
    kept.probed([a, b], sent_at=1.0, limit=4)
    assert kept.keys == [a, b]
    kept.record(c, continues=a, when=3.0, limit=4)  # an answer continued a's KV and kept c
    assert kept.keys == [c, b]
    kept.probed([a, b, d], sent_at=2.0, limit=4)  # sent before that answer ended: stale about it
    assert kept.keys == [c, b, d]
    kept.probed([b, d], sent_at=3.5, limit=4)  # sent just after: the server may not have freed that slot yet
    assert kept.keys == [c, b, d]
    kept.probed([b, d], sent_at=4.0, limit=4)  # sent a grace after: the server's word
    assert kept.keys == [b, d]
    for i in range(6):  # at most ``limit`` (the slots), the most recent first
        kept.record(f"{i + 10:032x}", None, 5.0 + i, limit=2)
    assert kept.keys == [f"{15:032x}", f"{14:032x}"]


def test_prefill_affinity_is_bounded_least_recently_used() -> None:
    aff = PrefillAffinity(limit=2)
    aff.record("a" * 32, "http://p0")
    aff.record("b" * 32, "http://p1")
    assert aff.server({"a" * 32: 1}) == "http://p0"  # used: b is now the least recent
    aff.record("c" * 32, "http://p1")
    assert len(aff) == 2 and aff.server({"b" * 32: 1}) is None and aff.server({"a" * 32: 1}) == "http://p0"
    aff.record("d" * 32, "http://p2")
    # the longest recorded prefix wins
    assert aff.server({"a" * 32: 1, "d" * 32: 2}) == "http://p2"


# ---- the choices ----------------------------------------------------------------------------------

def _decode_backends(n: int, slots: int = 1) -> Backends:
    b = Backends.from_urls(("http://p",), tuple(f"http://d{i}" for i in range(n)), None, True)
    b.prefill[0].healthy, b.prefill[0].models = True, frozenset({"m"})
    for d in b.decode:
        d.healthy, d.models = True, frozenset({"m"})
        d.capabilities = DecodeCapabilities(
            protocol_version=PROTOCOL_VERSION, model="m", engine="reference", slots=slots, busy_slots=0,
            max_seq_len=8, num_mtp=0, kv_endpoint="h:1", layout_fingerprint="f",
            peers=[PeerStatus(peer="p", state="ok")])
    b.refresh()
    return b


def test_pick_decode_prefers_the_free_server_keeping_the_longest_prefix() -> None:
    b = _decode_backends(3, slots=2)
    d0, d1, d2 = b.decode
    turn1, turn2 = keys_of(chat(TURN1)), keys_of(chat(TURN2))
    shorter = keys_of(chat(TURN1[:1]))
    d0.free_slots = 2  # the usual choice: the most free slots
    d1.free_slots = d2.free_slots = 1
    assert b.choose_decode("m", turn2.prefixes) == (d0, "none")
    d2.kept.record(shorter.conversation, None, 1.0, 2)
    d1.kept.record(turn1.conversation, None, 1.0, 2)
    assert b.choose_decode("m", turn2.prefixes) == (d1, "kept_server_free")  # the longest match
    assert b.pick_decode("m") is d0  # a request without keys: unchanged
    d1.free_slots = 0  # busy: the next longest, still free
    assert b.choose_decode("m", turn2.prefixes) == (d2, "kept_server_free")
    d2.free_slots = 0  # every keeping server busy: the usual choice, no wait
    assert b.choose_decode("m", turn2.prefixes) == (d0, "kept_server_busy")
    d1.draining = True  # a server not accepting keeps nothing that counts
    d2.healthy = False
    assert b.choose_decode("m", turn2.prefixes) == (d0, "none")


async def test_the_first_decode_request_goes_to_the_keeping_server_and_the_queue_order_stays() -> None:
    b = _decode_backends(2)
    servers, outcomes = ScriptedServers(), []
    pool = SlotPool(b, 64, 30.0, "scripted", SlotHooks(affinity=outcomes.append))
    turn1, turn2 = keys_of(chat(TURN1)), keys_of(chat(TURN2))
    b.decode[1].kept.record(turn1.conversation, None, 1.0, 1)
    request = ScriptedRequest(servers, "r1", time.perf_counter())
    request.prefixes = turn2.prefixes  # type: ignore[assignment]
    taking = asyncio.ensure_future(pool.take("m", request))
    for _ in range(10):
        await asyncio.sleep(0)
    assert [(c.url, c.wait_s) for c in servers.calls] == [("d1", 0.0)]  # d0, listed first, ties otherwise
    servers.calls[0].grant()
    assert (await taking).backend is b.decode[1] and outcomes == ["kept_server_free"]
    # every slot taken, one request waiting: a later request keeping a prefix queues behind it
    for d in b.decode:
        d.free_slots = 0
    first = ScriptedRequest(servers, "early", 10.0)
    later = ScriptedRequest(servers, "late", 11.0)
    later.prefixes = turn2.prefixes  # type: ignore[assignment]
    waits = [asyncio.ensure_future(pool.take("m", r, 30.0)) for r in (first, later)]
    for _ in range(10):
        await asyncio.sleep(0)
    assert {c.handoff_id for c in servers.open()} == {"early"}  # the standing requests are the head's
    assert outcomes == ["kept_server_free"]  # no pick at once while requests wait here
    for task in waits:
        task.cancel()
    await asyncio.gather(*waits, return_exceptions=True)


def _prefill_backends(n: int, slack: float) -> Backends:
    b = Backends([PrefillBackend(f"http://p{i}:1") for i in range(n)], [], prefill_slack=slack)
    for p in b.prefill:
        p.healthy, p.models = True, frozenset({MODEL})
    return b


@pytest.mark.parametrize("policy", ["least-loaded", "round-robin"])
def test_prefill_affinity_within_the_slack(policy: str) -> None:
    b = _prefill_backends(3, slack=2)
    b.policy = policy  # type: ignore[assignment]
    p0, p1, p2 = b.prefill
    turn1, turn2 = keys_of(chat(TURN1)), keys_of(chat(TURN2))
    assert b.choose_prefill(MODEL, prefer=turn2.prefixes)[1] == "none"
    b.prefill_affinity.record(turn1.conversation, p1.url)
    p0.in_flight, p1.in_flight, p2.in_flight = 1, 3, 5  # p1: the least load + 2
    assert b.choose_prefill(MODEL, prefer=turn2.prefixes) == (p1, "kept_server_free")
    p1.in_flight = 4  # past the slack: the usual policy
    chosen, outcome = b.choose_prefill(MODEL, prefer=turn2.prefixes)
    assert outcome == "kept_server_busy" and (chosen is p0 or policy == "round-robin")
    p1.in_flight = 1
    assert b.choose_prefill(MODEL, exclude=p1, prefer=turn2.prefixes)[1] == "kept_server_busy"  # not eligible
    b.prefill_slack = 0
    assert b.choose_prefill(MODEL, prefer=turn2.prefixes) == (p1, "kept_server_free")  # a tie is within 0


# ---- through the router -------------------------------------------------------------------------

def _decode_claims(rig, i: int) -> list[dict[str, Any]]:
    return [r["body"]["kv_transfer_params"] for r in rig.records(rig.decodes[i])["requests"]]


def test_the_claim_carries_keep_and_the_next_turn_goes_to_the_keeping_server(make_rig) -> None:
    rig = make_rig(n_decode=2)
    body1 = {"model": MODEL, "messages": TURN1, "max_tokens": 4}
    body2 = {"model": MODEL, "messages": TURN2, "max_tokens": 4}
    # the router's keys: no decode API key, the default tenant
    turn1 = conversation_keys(secret(None), DEFAULT_TENANT, Endpoint.CHAT, MODEL, body1)
    turn2 = conversation_keys(secret(None), DEFAULT_TENANT, Endpoint.CHAT, MODEL, body2)
    assert turn1 is not None and turn2 is not None
    rig.config(rig.decodes[1], kept=[turn1.conversation])  # d1 keeps turn 1 (d0, listed first, wins ties)
    d1 = rig.state.backends.decode[1]
    rig.wait(lambda: d1.kept.keys == [turn1.conversation], what="the probe's kept keys")
    resp = httpx.post(rig.url + "/v1/chat/completions", json=body2, timeout=10)
    assert resp.status_code == 200, resp.text
    assert _decode_claims(rig, 0) == []
    (claim,) = _decode_claims(rig, 1)
    assert claim["keep"] == {"scope": turn2.scope, "conversation": turn2.conversation,
                             "continues": turn1.conversation}
    assert metric_sum(rig.url, "pd_router_decode_affinity_total", outcome="kept_server_free") == 1
    assert metric_sum(rig.url, "pd_router_prefill_affinity_total", outcome="none") == 1
    # the clean answer: the router's view has turn 2 kept there, turn 1 continued (until the next probe)
    # and its prefill server recorded: the third turn's prefill follows it
    assert rig.state.backends.prefill_affinity.server(turn2.prefixes) == rig.prefills[0].url
    body3 = {**body2, "messages": [*TURN2, {"role": "assistant", "content": "two files"},
                                   {"role": "user", "content": "thanks"}]}
    assert httpx.post(rig.url + "/v1/chat/completions", json=body3, timeout=10).status_code == 200
    assert metric_sum(rig.url, "pd_router_prefill_affinity_total", outcome="kept_server_free") == 1
    rig.assert_no_leaks()


def test_a_clean_answer_is_recorded_as_kept_on_its_server(make_rig) -> None:
    rig = make_rig(n_decode=2, probe_interval=30)  # no probe after the start: the router's own record
    body1 = {"model": MODEL, "messages": TURN1, "max_tokens": 4}
    body2 = {"model": MODEL, "messages": TURN2, "max_tokens": 4}
    turn1 = conversation_keys(secret(None), DEFAULT_TENANT, Endpoint.CHAT, MODEL, body1)
    assert turn1 is not None
    # turn 1 on d1 (d0 has no free slot as the router counts it)
    d0, d1 = rig.state.backends.decode
    d0.free_slots = 0
    assert httpx.post(rig.url + "/v1/chat/completions", json=body1, timeout=10).status_code == 200
    (claim1,) = _decode_claims(rig, 1)
    assert "continues" not in claim1["keep"] and d1.kept.keys == [turn1.conversation]
    rig.wait(lambda: not rig.records(rig.decodes[1])["active"], what="turn 1's slot free at d1")
    d0.free_slots = 1
    assert httpx.post(rig.url + "/v1/chat/completions", json=body2, timeout=10).status_code == 200
    claim2 = _decode_claims(rig, 1)[-1]
    assert claim2["keep"]["continues"] == turn1.conversation and _decode_claims(rig, 0) == []
    assert d1.kept.keys == [claim2["keep"]["conversation"]]  # turn 1's KV became turn 2's
    rig.assert_no_leaks()


def test_no_keep_for_a_list_of_prompts(make_rig) -> None:
    rig = make_rig()
    prompt = "x" * (TEXT_CHUNK + 1)
    for body in ({"prompt": prompt}, {"prompt": [prompt, prompt + "y"]}):
        resp = httpx.post(rig.url + "/v1/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=10)
        assert resp.status_code == 200, resp.text
    claims = _decode_claims(rig, 0)
    assert len(claims) == 3 and "keep" in claims[0] and not any("keep" in c for c in claims[1:])
    rig.assert_no_leaks()
