"""The router refuses, before prefill, what the chosen decode server would refuse: the
features it advertises on ``/v1/pd/capabilities`` (:class:`EngineFeatures`) and the body
checks of ``pd_wire.requests``. Against fake backends: prefill never sees the
request, the slot is back, and a server that advertises the feature gets the request."""

from __future__ import annotations

import httpx
import pytest

from decode_server.engine.tilert import FEATURES as TILERT_FEATURES
from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}

# refused by a decode server with TileRT's features (none beyond temperature/top-p/top-k)
TILERT_REFUSES = {
    "presence_penalty": {**CHAT, "presence_penalty": 0.5},
    "frequency_penalty": {**CHAT, "frequency_penalty": 0.5},
    "repetition_penalty": {**CHAT, "repetition_penalty": 1.2},
    "logit_bias": {**CHAT, "logit_bias": {"5": 10}},
    "min_p": {**CHAT, "min_p": 0.1},
    "seed": {**CHAT, "seed": 7, "temperature": 0.8},
    "logprobs": {**CHAT, "logprobs": True},
}
# refused by every decode server (whatever its engine)
ALWAYS_REFUSED = {
    "best_of": ("/v1/completions", {**COMPLETION, "best_of": 2}),
    "suffix": ("/v1/completions", {**COMPLETION, "suffix": "x"}),
    "top_logprobs": ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}),
    "stop_token_ids": ("/v1/chat/completions", {**CHAT, "stop_token_ids": [-1]}),
    "temperature": ("/v1/chat/completions", {**CHAT, "temperature": -1}),
}


def _refused(resp: httpx.Response, param: str) -> str:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err["message"]


@pytest.mark.parametrize("param", sorted(TILERT_REFUSES))
def test_what_the_tilert_engine_cannot_do_is_refused_before_prefill(make_rig, param):
    rig = make_rig(decode={"engine": "tilert", "features": TILERT_FEATURES.model_dump()})
    message = _refused(httpx.post(rig.url + "/v1/chat/completions", json=TILERT_REFUSES[param], timeout=10), param)
    assert "tilert engine" in message
    assert rig.records(rig.prefills[0])["requests"] == []
    assert rig.records(rig.decodes[0])["requests"] == []
    rig.assert_no_leaks()
    ok = httpx.post(rig.url + "/v1/chat/completions", json={**CHAT, "seed": 7, "temperature": 0}, timeout=10)
    assert ok.status_code == 200, ok.text  # a seed with greedy decoding changes nothing: accepted


@pytest.mark.parametrize("param", sorted(ALWAYS_REFUSED))
def test_what_no_decode_server_does_is_refused_before_prefill(make_rig, param):
    rig = make_rig()
    path, body = ALWAYS_REFUSED[param]
    _refused(httpx.post(rig.url + path, json=body, timeout=10), param)
    assert rig.records(rig.prefills[0])["requests"] == []
    rig.assert_no_leaks()


def test_a_server_that_advertises_the_features_gets_the_request(make_rig):
    rig = make_rig(decode={"features": {"logprobs": True, "penalties": True, "logit_bias": True, "min_p": True,
                                        "seed": True}})
    for param, body in TILERT_REFUSES.items():
        resp = httpx.post(rig.url + "/v1/chat/completions", json=body, timeout=10)
        assert resp.status_code == 200, (param, resp.text)
    assert len(rig.records(rig.prefills[0])["requests"]) == len(TILERT_REFUSES)
    rig.assert_no_leaks()
