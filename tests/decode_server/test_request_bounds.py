"""The decode server's own routes under the router's request-bounds fuzz (issue 58): every
field of chat and completions set to wrong types and extreme values
(:mod:`tests.odd_values`), and each count far past its bound, each in a body whose KV has
landed: a 4xx in OpenAI's shape or a 200, never a 5xx, and after each answer the KV
receive slot and the decode slot are free."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pd_wire.errors import ErrorBody
from tests.decode_server.helpers import handoff
from tests.odd_values import bodies, encode, huge_counts, problem

pytestmark = pytest.mark.timeout(300)

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
BASES: dict[str, dict[str, Any]] = {
    "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "completions": {"prompt": "hi", "max_tokens": 2},
}


def _answer(srv, client: httpx.Client, endpoint: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """``body`` sent with the KV of a handoff that has landed (unless the case sets
    ``kv_transfer_params`` itself); the answer, once the server holds nothing again."""
    if "kv_transfer_params" not in body:
        kv = handoff(5)
        srv.receiver.arrive(kv["handoff_id"])
        body = {**body, "kv_transfer_params": kv}
    resp = client.post(srv.url + PATHS[endpoint], content=encode(body), headers={"content-type": "application/json"})
    srv.wait_idle(5)
    return resp.status_code, resp.content


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_field_with_odd_values_is_answered_4xx_or_200(make_server, endpoint):
    srv = make_server(slots=1, tools=True, reasoning=endpoint == "chat")
    problems = []
    cases = list(bodies(endpoint, BASES[endpoint]))
    with httpx.Client(timeout=20) as client:
        for what, body in cases:
            wrong = problem(what, *_answer(srv, client, endpoint, body))
            if wrong is not None:
                problems.append(wrong)
    assert not problems, f"{len(problems)} of {len(cases)}:\n" + "\n".join(problems[:40])


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_count_far_past_its_bound_is_a_400_naming_the_field(make_server, endpoint):
    srv = make_server(slots=1)
    cases = [*huge_counts(endpoint, BASES[endpoint]),
             ("logit_bias id past the vocabulary", {**BASES[endpoint], "logit_bias": {str(2**31 - 1): 1}})]
    with httpx.Client(timeout=20) as client:
        for what, body in cases:
            status, content = _answer(srv, client, endpoint, body)
            assert status == 400, (what, status, content[:300])
            assert ErrorBody.model_validate_json(content).error.param, (what, content[:300])


EXTREMES = [
    {"temperature": 1e308}, {"temperature": 1e-5}, {"top_p": 1e-300}, {"top_k": 2**31 - 1}, {"min_p": 1.0},
    {"repetition_penalty": 1e308}, {"repetition_penalty": 1e-300}, {"presence_penalty": 2.0},
    {"frequency_penalty": -2.0}, {"logit_bias": tuple((t, -100.0) for t in range(64))},
    {"temperature": 1e308, "top_p": 1e-300, "min_p": 1.0, "repetition_penalty": 1e308, "top_k": 1},
]


@pytest.mark.parametrize("extreme", EXTREMES, ids=[",".join(e) for e in EXTREMES])
def test_the_reference_sampler_chooses_a_token_at_every_extreme_the_bounds_let_through(extreme):
    """What the request models accept reaches the reference engine's sampler: each extreme
    (and all at once) still gives a token of the vocabulary, the prompt's tokens all seen and
    every logit negative (where a penalty can push every one to -inf)."""
    import torch

    from decode_server.engine.base import SamplingParams
    from decode_server.engine.sampling import LogitsAdjuster, choose

    vocab = 64
    params = SamplingParams(max_tokens=4, seed=1, prompt_token_ids=tuple(range(vocab)), **extreme)
    adjust = LogitsAdjuster(params, vocab, first_token_id=3, device=torch.device("cpu"))
    logits = -torch.rand(vocab, generator=torch.Generator().manual_seed(0)) - 1.0
    token = choose(adjust(logits), params, torch.Generator().manual_seed(7))
    assert 0 <= token < vocab
