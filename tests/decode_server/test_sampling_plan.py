"""Sampling controls in the decode server's plan (issue 15): the checkpoint's
generation_config.json defaults for a field the request leaves unset (as vLLM's
``--generation-config auto``), logit_bias clamped to +-100, the prompt's token ids for the
repetition penalty, and what the capabilities endpoint advertises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decode_server.engine.reference import FEATURES as REFERENCE_FEATURES
from decode_server.engine.tilert import FEATURES as TILERT_FEATURES
from decode_server.server.api_errors import InvalidRequest
from decode_server.server.request_plan import ServerLimits, build_plan
from decode_server.server.text import GenerationDefaults
from pd_wire.decode import EngineFeatures
from pd_wire.requests import ChatCompletionRequest, check
from tests.decode_server.helpers import handoff

LIMITS = ServerLimits(max_seq_len=100, features=REFERENCE_FEATURES, engine="reference", model_name="m")
GEN_CONFIG = {"eos_token_id": [9], "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
              "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.1}


def _defaults(tmp_path: Path, config: dict) -> GenerationDefaults:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return GenerationDefaults.from_model_dir(tmp_path)


def _plan(defaults: GenerationDefaults, kv: dict | None = None, **body):
    req = ChatCompletionRequest.model_validate({"kv_transfer_params": kv or handoff(5, num_prompt_tokens=4,
                                                                                   prompt_token_ids=[1, 2, 3, 4]),
                                                **body})
    return build_plan("chat", req, "r", LIMITS, defaults)


def test_generation_config_defaults_apply_to_unset_fields(tmp_path):
    defaults = _defaults(tmp_path, GEN_CONFIG)
    s = _plan(defaults).sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.6, 0.9, 20, 0.05)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.1, 0.2, 0.1)
    assert s.prompt_token_ids == (1, 2, 3, 4)
    s = _plan(defaults, temperature=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0).sampling
    assert (s.temperature, s.min_p, s.repetition_penalty, s.presence_penalty) == (1.0, 0.0, 1.0, 0.0)
    assert s.frequency_penalty == 0.1 and s.prompt_token_ids == ()  # not needed without repetition
    assert defaults.sampling.repetition_penalty == 1.1  # advertised: the router asks prefill for the prompt ids


def test_without_generation_config_the_values_are_vllms_neutral_ones(tmp_path):
    s = _plan(GenerationDefaults()).sampling
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.logit_bias) == \
        (0.0, 0.0, 0.0, 1.0, ())


def test_repetition_penalty_needs_the_prompt_ids(tmp_path):
    kv = handoff(5, num_prompt_tokens=4)
    with pytest.raises(InvalidRequest) as err:
        _plan(GenerationDefaults(), kv=kv, repetition_penalty=1.2)
    assert err.value.param == "kv_transfer_params.prompt_token_ids"
    assert _plan(GenerationDefaults(), kv=kv, presence_penalty=1.0).sampling.presence_penalty == 1.0


def test_logit_bias_is_clamped_and_its_keys_must_be_token_ids():
    s = _plan(GenerationDefaults(), logit_bias={"3": 150, "7": -300.5, "8": 2.5}).sampling
    assert s.logit_bias == ((3, 100.0), (7, -100.0), (8, 2.5))
    with pytest.raises(InvalidRequest) as err:
        _plan(GenerationDefaults(), logit_bias={"x": 1})
    assert err.value.param == "logit_bias"


def test_a_default_the_engine_cannot_apply_is_named_at_start_up(tmp_path):
    defaults = _defaults(tmp_path, GEN_CONFIG)
    assert defaults.unsupported_by(REFERENCE_FEATURES) is None
    assert defaults.unsupported_by(TILERT_FEATURES) == "generation_config.json sets min_p=0.05"
    assert _defaults(tmp_path, {"temperature": 1.0, "top_p": 0.95}).unsupported_by(TILERT_FEATURES) is None


@pytest.mark.parametrize("field,value", [("presence_penalty", 0.5), ("frequency_penalty", -0.5),
                                         ("repetition_penalty", 1.3), ("min_p", 0.1), ("logit_bias", {"1": 2}),
                                         ("seed", 3)])
def test_the_shared_check_follows_the_features(field, value):
    body = {"messages": [{"role": "user", "content": "x"}], field: value, "temperature": 0.8}
    assert check("chat", body, REFERENCE_FEATURES, "reference") is None
    refusal = check("chat", body, TILERT_FEATURES, "tilert")
    assert refusal is not None and refusal.param == field and "tilert" in refusal.message
    assert check("chat", body, EngineFeatures(penalties=True, min_p=True, logit_bias=True, seed=True),
                 "x") is None
