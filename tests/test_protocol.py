import pytest
from pydantic import ValidationError

from connector.layout import cpu_mla_layout, glm5_fp8_ds_mla_layout
from pd_wire.handoff import HandoffResult, HandoffTarget


def test_handoff_target_ignores_foreign_keys():
    t = HandoffTarget.model_validate({"handoff_id": "r1", "kv_endpoint": "127.0.0.1:9100", "do_remote_decode": True})
    assert t.handoff_id == "r1"


def test_handoff_result_rejects_missing_first_token():
    with pytest.raises(ValidationError):
        HandoffResult.model_validate({"handoff_id": "r1", "kv_endpoint": "h:1", "num_prompt_tokens": 3,
                                      "last_prompt_token_id": 1, "status": "sent"})


def test_layout_fingerprint_depends_on_layer_count_and_dtype():
    assert glm5_fp8_ds_mla_layout(78, 1).fingerprint() != glm5_fp8_ds_mla_layout(78, 0).fingerprint()
    assert cpu_mla_layout(2, 1, "bfloat16").fingerprint() != cpu_mla_layout(2, 1, "float32").fingerprint()
    glm = glm5_fp8_ds_mla_layout()
    assert glm.num_layers == 79
    # 528 + 128 per token; indexer 8448 B per 64-token page
    assert glm.bytes_per_layer(64) == 64 * (528 + 128) + 8448
    assert glm.bytes_per_layer(65) == 65 * (528 + 128) + 2 * 8448
