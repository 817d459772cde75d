"""The real decode server process (``python -m decode_server`` exactly as the stack starts
it) with the reference engine on the tiny model, fed by a real KVSender over NIXL with
KV from the reference prefill; the output must equal the reference engine run in-process
on the same KV. Each test runs against the server with its engine on a thread (the
default), then in a process of its own (``--engine-process``)."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer

from connector.layout import cpu_mla_layout
from connector.sender import KVSender
from decode_server.engine.base import SamplingParams
from decode_server.engine.reference import ReferenceEngine
from decode_server.reference import load_model, prefill
from pd_deploy.commands import VLLM_CPU_ENV, DecodeSpec, decode_server_argv
from pd_wire.decode import CAPABILITIES_PATH, PROGRESS_PREFIX, RESULT_PATH, progress_ids
from pd_wire.handoff import HandoffResult
from tests.decode_server.helpers import client
from tests.procs import free_port, server
from tests.reference.helpers import handoff_for, received

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["The decode server streams tokens", "Once upon a time", "hello"]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["thread", "process"])
def stack(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The server with its engine on a worker thread (the default), then in a process of its own."""
    port, kv_port = free_port(), free_port()
    spec = DecodeSpec(model=tiny_model_dir, port=port, kv_port=kv_port, slots=2, max_seq_len=256, num_mtp=1,
                      extra_args=("--kv-timeout", "3", "--engine-process" if request.param == "process"
                                  else "--no-engine-process"))
    log = tmp_path_factory.mktemp("decode") / "decode_server.log"
    url = f"http://127.0.0.1:{port}"
    with server(decode_server_argv(spec), log, ready_url=url + "/ready", timeout=180, env=VLLM_CPU_ENV) as proc:
        model = load_model(tiny_model_dir)
        caps = httpx.get(url + CAPABILITIES_PATH).json()
        layout = cpu_mla_layout(model.cfg.num_hidden_layers, 1, model.cfg.dtype)
        sender = KVSender(f"test-prefill-{uuid.uuid4().hex[:6]}", layout, max_tokens=256)
        try:
            sender.connect(caps["kv_endpoint"], timeout=20)
            yield {"url": url, "caps": caps, "model": model, "sender": sender, "proc": proc,
                   "tok": Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")), "dir": tiny_model_dir}
        finally:
            sender.close()


def _send_kv(stack: dict, handoff_id: str, kv: list[torch.Tensor]) -> None:
    h = stack["sender"].begin(stack["caps"]["kv_endpoint"], handoff_id, kv[0].shape[0], timeout=20)
    for layer, tensor in enumerate(kv):
        h.staging(layer)["kv"].copy_(tensor)
        h.post_layer(layer)
    assert h.wait(20) == "sent", h.error


def _reference_tokens(stack: dict, prompt_ids: list[int], first: int, kv: list[torch.Tensor]) -> list[int]:
    engine = ReferenceEngine(stack["dir"], slots=1, max_seq_len=256, num_mtp=1, model=stack["model"])
    session = engine.start(received("ref", kv), handoff_for(prompt_ids, first, "ref"),
                           SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    tokens = [first]
    try:
        while len(tokens) < NEW_TOKENS:
            tokens += [t.token_id for t in session.step()]
    finally:
        session.close()
    return tokens[:NEW_TOKENS]


def test_capabilities_and_handshake(stack):
    caps = stack["caps"]
    assert caps["engine"] == "reference" and caps["slots"] == 2 and caps["num_mtp"] == 1
    assert caps["model"] == stack["dir"].name
    peers = httpx.get(stack["url"] + CAPABILITIES_PATH).json()["peers"]
    assert any(p["peer"] == stack["sender"].agent_name and p["state"] == "ok" for p in peers)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_in_process_reference(stack, prompt):
    tok = stack["tok"]
    ids = tok.encode(prompt).ids
    out = prefill(stack["model"], ids)
    first = int(out.logits.argmax())
    expect = _reference_tokens(stack, ids, first, out.kv)
    hid = f"h-{uuid.uuid4().hex[:8]}"
    _send_kv(stack, hid, out.kv)
    kv_params = handoff_for(ids, first, hid).model_copy(update={"kv_endpoint": stack["caps"]["kv_endpoint"]})
    resp = httpx.post(stack["url"] + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_tokens_as_token_ids": True, "logprobs": 0, "kv_transfer_params": kv_params.model_dump()})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    got = [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]
    assert got == expect
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": NEW_TOKENS,
                             "total_tokens": len(ids) + NEW_TOKENS}


def test_chat_stream_with_kv_arriving_after_the_request(stack):
    tok = stack["tok"]
    ids = tok.encode("Tell me a story").ids
    out = prefill(stack["model"], ids)
    first = int(out.logits.argmax())
    expect = _reference_tokens(stack, ids, first, out.kv)
    hid = f"h-{uuid.uuid4().hex[:8]}"
    kv_params: HandoffResult = handoff_for(ids, first, hid)
    sender = threading.Timer(0.5, _send_kv, (stack, hid, out.kv))
    sender.start()
    chunks = list(client(stack["url"]).chat.completions.create(
        model=stack["dir"].name, messages=[{"role": "user", "content": "Tell me a story"}], stream=True,
        max_completion_tokens=NEW_TOKENS, temperature=0, stream_options={"include_usage": True},
        extra_body={"kv_transfer_params": kv_params.model_dump(), "ignore_eos": True}))
    sender.join()
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tok.decode(expect)
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS
    metrics = httpx.get(stack["url"] + "/metrics").text
    drafted = [line for line in metrics.splitlines() if line.startswith("decode_server_mtp_drafted_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0


def test_kv_timeout_then_slot_reusable(stack):
    kv_params = HandoffResult(handoff_id="never-sent", kv_endpoint=stack["caps"]["kv_endpoint"],
                              num_prompt_tokens=4, first_token_id=1, last_prompt_token_id=1, status="sent")
    resp = httpx.post(stack["url"] + "/v1/completions", timeout=60, headers={"X-Request-Id": "t1"},
                      json={"prompt": "x", "max_tokens": 4, "kv_transfer_params": kv_params.model_dump()})
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "kv_timeout"
    assert httpx.get(stack["url"] + CAPABILITIES_PATH).json()["busy_slots"] == 0


# ---- a sequence resumed from a cut (issue 49) -----------------------------------------------------
def _claim_writes(stack: dict, path: str, body: dict, claim: dict, ids: list[int], first: int,
                  kv: list[torch.Tensor], seen: dict | None = None) -> list[tuple[list[int], str, dict | None]]:
    """A streamed request holding its slot with ``claim`` (result posted, progress lines): its KV
    sent and its result posted once the slot is its; its writes as (token ids, text, the last
    event's choice). ``seen``: gets the answer's role chunks (counted) and its usage."""
    hid = claim["handoff_id"]
    opened, raw = threading.Event(), []

    def read() -> None:
        with httpx.stream("POST", stack["url"] + path, json={**body, "stream": True, "kv_transfer_params": claim},
                          timeout=60) as resp:
            assert resp.status_code == 200
            opened.set()
            raw.append(resp.read())

    reader = threading.Thread(target=read)
    reader.start()
    assert opened.wait(30), "the claim was not granted"
    _send_kv(stack, hid, kv)
    result = handoff_for(ids, first, hid).model_copy(update={"kv_endpoint": stack["caps"]["kv_endpoint"]})
    assert httpx.post(stack["url"] + RESULT_PATH, json=result.model_dump(), timeout=10).status_code == 204
    reader.join(60)
    writes: list[tuple[list[int], str, dict | None]] = []
    text, last = "", None
    for line in raw[0].split(b"\n"):
        if line.startswith(PROGRESS_PREFIX):
            writes.append((progress_ids(line), text, last))
            text, last = "", None
        elif line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if seen is not None:
                seen["roles"] = seen.get("roles", 0) + sum(
                    1 for c in event.get("choices") or () if (c.get("delta") or {}).get("role"))
                seen["usage"] = event.get("usage") or seen.get("usage")
            for choice in event.get("choices") or ():
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                last = choice
    return writes


def _finish(writes: list[tuple[list[int], str, dict | None]]) -> tuple[str, str]:
    last = [c for _, _, c in writes if c is not None][-1]
    return last["finish_reason"], last["stop_reason"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11, "presence_penalty": 0.5}])
def test_a_sequence_resumed_at_each_cut_goes_on_as_the_uninterrupted_one(stack, sampling, chat):
    """The uninterrupted answer's writes (each with its tokens, the progress lines), then the same
    request resumed after each write (its KV the prompt's and the output's so far): the resumed
    answer's writes are the uninterrupted one's after the cut, token for token and text for text
    (a stop string that spans writes, held text, the detokenizer's offsets); seeded sampling and
    penalties included; no second role chunk; usage counts the original prompt and every token once."""
    tok = stack["tok"]
    prompt = "Once upon a time"
    ids = tok.encode(prompt).ids
    out = prefill(stack["model"], ids)
    first = int(out.logits.argmax())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"model": stack["dir"].name, "max_tokens": 40, "ignore_eos": True, **sampling,
            **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})}
    whole = _claim_writes(stack, path, base, {"handoff_id": f"u-{uuid.uuid4().hex[:8]}", "result": "posted",
                                              "progress": True}, ids, first, out.kv)
    text = "".join(t for _, t, _ in whole)
    stop = text[len(text) // 2:len(text) // 2 + 3]  # ends the answer about half way, once it spans a cut
    body = {**base, "stop": [stop], "stream_options": {"include_usage": True}}
    seen: dict = {}
    whole = _claim_writes(stack, path, body, {"handoff_id": f"s-{uuid.uuid4().hex[:8]}", "result": "posted",
                                              "progress": True}, ids, first, out.kv, seen)
    assert seen["roles"] == (1 if chat else 0) and seen["usage"]["prompt_tokens"] == len(ids)
    tokens = [t for w, _, _ in whole for t in w]
    for cut in range(1, len(whole) - 1):
        done = [t for w, _, _ in whole[:cut] for t in w]
        resumed_ids = ids + done
        again = prefill(stack["model"], resumed_ids)
        claim = {"handoff_id": f"r-{uuid.uuid4().hex[:8]}", "result": "posted", "progress": True,
                 "resume": {"output_token_ids": done, "prompt_tokens": len(ids), "context_token_id": ids[-1]}}
        seen_again: dict = {}
        rest = _claim_writes(stack, path, body, claim, resumed_ids, int(again.logits.argmax()), again.kv, seen_again)
        assert seen_again["roles"] == 0 and seen_again["usage"] == seen["usage"], f"cut after write {cut}"
        assert _finish(rest) == _finish(whole) == ("stop", stop), f"cut after write {cut}"
        # (the writes may split otherwise: MTP starts afresh at the cut)
        assert [t for w, _, _ in rest for t in w] == tokens[len(done):], f"cut after write {cut}"
        assert "".join(t for _, t, _ in rest) == "".join(t for _, t, _ in whole[cut:]), f"cut after write {cut}"
    assert tokens and stop in text
