"""kv_connector_extra_config validation and model profiles (layer classification)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from connector.config import ConnectorConfigError, load_settings
from connector.profiles import (
    MTP_FLAG,
    ProfileMismatch,
    cache_row_hint,
    check_layers,
    glm51_profile,
    observed_layout,
    resolve_profile,
    scan_layers,
    tiny_profile,
)


def test_settings_defaults_and_values():
    s = load_settings(
        {"profile": "tiny", "decode_endpoints": "127.0.0.1:9100,127.0.0.1:9101", "transfer_timeout_s": 3}
    )
    assert s.profile == "tiny" and s.decode_endpoints == ("127.0.0.1:9100", "127.0.0.1:9101")
    assert s.transfer_timeout_s == 3.0 and s.max_tokens is None
    assert load_settings(None).profile == "auto"


@pytest.mark.parametrize(
    "extra, option, words",
    [
        ({"profil": "tiny"}, "profil", "unknown option"),
        ({"profile": "glm6"}, "profile", "'glm6'"),
        ({"decode_endpoints": ["localhost"]}, "decode_endpoints", "host:port"),
        ({"transfer_timeout_s": 0}, "transfer_timeout_s", "greater than 0"),
        ({"max_tokens": -5}, "max_tokens", "-5"),
        ({"send_lanes": 0}, "send_lanes", "greater than or equal to 1"),
        ({"send_lanes": 9}, "send_lanes", "less than or equal to 8"),
        ({"pin_send_lanes": "sometimes"}, "pin_send_lanes", "valid boolean"),
    ],
)
def test_bad_settings_name_option_value_and_reason(extra, option, words):
    with pytest.raises(ConnectorConfigError) as info:
        load_settings(extra)
    message = str(info.value)
    assert info.value.option == f"kv_connector_extra_config.{option}"
    assert f"kv_connector_extra_config.{option}" in message and words in message


def test_auto_profile_follows_the_hf_config():
    tiny = resolve_profile("auto", SimpleNamespace(num_hidden_layers=3), "torch.bfloat16")
    assert tiny.name == "tiny" and tiny.layout.num_layers == 4 and tiny.mla_row_bytes == 1152
    glm = resolve_profile("auto", SimpleNamespace(num_hidden_layers=78, index_topk=2048), "torch.bfloat16")
    assert glm.name == "glm5.1" and glm.layout.num_layers == 79 and glm.needs_indexer
    with pytest.raises(ProfileMismatch, match="int8"):
        resolve_profile("tiny", SimpleNamespace(num_hidden_layers=2), "torch.int8")


def _names(n: int, indexer: bool = False) -> list[str]:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(n)]
    if indexer:
        names += [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(n)]
    return names[::-1]  # vLLM's order must not matter


def test_glm51_needs_79_layers_with_indexers():
    profile = glm51_profile()
    layers = scan_layers(_names(79, indexer=True))
    check_layers(layers, profile)
    assert layers.mla[78] == "model.layers.78.self_attn.attn"
    assert layers.indexer[5] == "model.layers.5.self_attn.indexer.k_cache"
    with pytest.raises(ProfileMismatch, match=MTP_FLAG.replace("{", r"\{").replace("}", r"\}")[:20]):
        check_layers(scan_layers(_names(78, indexer=True)), profile)
    with pytest.raises(ProfileMismatch, match="indexer cache"):
        check_layers(scan_layers(_names(79)), profile)


def test_layer_count_mismatch_and_observed_layout():
    profile = tiny_profile(2, "bfloat16")
    no_mtp = scan_layers(_names(2))
    with pytest.raises(ProfileMismatch) as info:
        check_layers(no_mtp, profile)
    assert MTP_FLAG in str(info.value)
    assert observed_layout(no_mtp, profile).num_layers == 2
    with pytest.raises(ProfileMismatch, match="needs 3 MLA layers .* registered 5"):
        check_layers(scan_layers(_names(5)), profile)
    with pytest.raises(ProfileMismatch, match="not 0..1"):
        scan_layers(["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"])


def test_cache_row_hint_names_the_flag_to_add():
    glm = glm51_profile()
    assert glm.mla_row_bytes == 656 and glm.vllm_args == ("--kv-cache-dtype", "fp8_ds_mla", "--block-size", "64")
    assert cache_row_hint(656, glm) is None
    fp8 = cache_row_hint(576, glm)
    assert fp8 is not None and "plain fp8" in fp8 and "--kv-cache-dtype fp8_ds_mla" in fp8
    bf16 = cache_row_hint(1152, glm)
    assert bf16 is not None and "bf16" in bf16 and "--kv-cache-dtype fp8_ds_mla" in bf16
    assert "1000-byte" in (cache_row_hint(1000, glm) or "")
    assert cache_row_hint(1152, tiny_profile(2, "bfloat16")) is None  # bf16 is the tiny profile's own layout
    assert cache_row_hint(576, tiny_profile(2, "bfloat16")) is None  # no flag to name: vLLM's default
