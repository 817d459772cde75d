"""The decode-time passes (decode_server/reference/decoder.py) against the clear model they
re-express: same logits, hidden states and cache rows up to float rounding, on random
weights of several architectures (q_lora or not, grouped routing, no shared expert), over
caches shorter and longer than the chunked-attention threshold, 1-3 new tokens."""

from __future__ import annotations

import pytest
import torch

from decode_server.reference import MlaMoeModel, ModelConfig
from decode_server.reference import decoder as decoder_module
from decode_server.reference.decoder import Decoder
from decode_server.tiny_model.config import hf_config

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-5  # relative to each tensor's largest value: float32 summation-order rounding

VARIANTS = {
    "tiny": {},
    "no_q_lora_grouped_routing": {"q_lora_rank": None, "n_group": 2, "topk_group": 1},
    "no_shared_expert": {"n_shared_experts": 0, "first_k_dense_replace": 0},
}


def _random_model(change: dict) -> MlaMoeModel:
    raw = {**hf_config(2, 512, 2, [0], 0), "dtype": "float32", **change}
    torch.manual_seed(0)
    model = MlaMoeModel(ModelConfig.from_hf(raw))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05 if p.dim() > 1 else 1.0)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return model.eval().requires_grad_(False)


def _compare(model: MlaMoeModel, length: int, t: int) -> float:
    """Largest difference over hidden, logits, written rows and MTP outputs of one pass,
    relative to the tensor's largest value (at least 1)."""
    gen = torch.Generator().manual_seed(length * 10 + t)
    caches = [torch.randn(length + t, model.cfg.kv_width, generator=gen) for _ in range(model.num_layers)]
    ids = torch.randint(0, model.cfg.vocab_size, (t,), generator=gen)
    positions = torch.arange(length, length + t)
    clear = [c.clone().unsqueeze(0) for c in caches]
    fast = [c.clone() for c in caches]
    decoder = Decoder(model, max_positions=length + t)
    with torch.inference_mode():
        h1, l1 = model.forward_main(ids.unsqueeze(0), positions, clear[:-1])
        h2, l2 = decoder.forward_main(ids, length, fast[:-1])
        m1, ml1 = model.forward_mtp(ids.unsqueeze(0), h1, positions, clear[-1])
        m2, ml2 = decoder.forward_mtp(ids, h2, length, fast[-1])
        _, last1 = model.forward_mtp(ids.unsqueeze(0), h1, positions, clear[-1].clone(), last_only=True)
        _, last2 = decoder.forward_mtp(ids, h2, length, fast[-1].clone(), last_only=True)
    pairs = [(h1[0], h2), (l1[0], l2), (m1[0], m2), (ml1[0], ml2), (last1[0], last2)]
    pairs += [(a[0], b) for a, b in zip(clear, fast)]
    assert last2.shape == (1, model.cfg.vocab_size)
    return max(float((a - b).abs().max()) / max(1.0, float(a.abs().max())) for a, b in pairs)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("length", "t"), [(1, 1), (7, 2), (300, 3)])
def test_decoder_computes_the_clear_model(variant: str, length: int, t: int) -> None:
    assert _compare(_random_model(VARIANTS[variant]), length, t) < TOLERANCE


@pytest.mark.parametrize("length", [decoder_module.FLASH_MIN_LEN, decoder_module.FLASH_MIN_LEN + 517])
@pytest.mark.parametrize("t", [1, 2])
def test_chunked_attention_over_long_caches(length: int, t: int) -> None:
    """At and past the threshold (a partial first chunk, the new rows in the last one)."""
    assert _compare(_random_model({}), length, t) < TOLERANCE


def test_position_zero_has_no_mtp_embedding() -> None:
    """As vLLM's MTP (and the clear model): the embedding is zeroed at position 0."""
    assert _compare(_random_model({}), 0, 2) < TOLERANCE
