"""The decode-time passes (decode_server/reference/decoder.py) against the clear model they
re-express: same logits, hidden states and cache rows up to float rounding, on random
weights of several architectures (q_lora or not, grouped routing, no shared expert), over
caches shorter and longer than the chunked-attention threshold, 1-3 new tokens, with and
without the helper thread that takes half of a long attention, with attention over the
cache as PyTorch's products and as the compiled loop (latent_kernel)."""

from __future__ import annotations

import threading
from concurrent.futures import Executor, ThreadPoolExecutor

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
    "two_heads": {"num_attention_heads": 2, "num_key_value_heads": 2},  # masked scores with < 8 query rows
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


KERNELS = [pytest.param(False, id="torch"), pytest.param(True, id="kernel")]


def _compare(model: MlaMoeModel, length: int, t: int, helper: Executor | None = None, kernel: bool = False) -> float:
    """Largest difference over hidden, logits, written rows and MTP outputs of one pass,
    relative to the tensor's largest value (at least 1)."""
    gen = torch.Generator().manual_seed(length * 10 + t)
    caches = [torch.randn(length + t, model.cfg.kv_width, generator=gen) for _ in range(model.num_layers)]
    ids = torch.randint(0, model.cfg.vocab_size, (t,), generator=gen)
    positions = torch.arange(length, length + t)
    clear = [c.clone().unsqueeze(0) for c in caches]
    fast = [c.clone() for c in caches]
    decoder = Decoder(model, max_positions=length + t, helper=helper, kernel=kernel)
    assert decoder.kernel == kernel
    clear_last, fast_last = clear[-1].clone(), fast[-1].clone()
    with torch.inference_mode():
        h1, l1 = model.forward_main(ids.unsqueeze(0), positions, clear[:-1])
        h2, l2 = decoder.forward_main(ids, length, fast[:-1])
        m1, ml1 = model.forward_mtp(ids.unsqueeze(0), h1, positions, clear[-1])
        m2, ml2 = decoder.forward_mtp(ids, h2, length, fast[-1])
        # last_only: every KV row written, the rest computed for the last row alone
        last_h1, last1 = model.forward_mtp(ids.unsqueeze(0), h1, positions, clear_last, last_only=True)
        last_h2, last2 = decoder.forward_mtp(ids, h2, length, fast_last, last_only=True)
    assert last_h2.shape == (1, model.cfg.hidden_size) and last2.shape == (1, model.cfg.vocab_size)
    pairs = [(h1[0], h2), (l1[0], l2), (m1[0], m2), (ml1[0], ml2), (last_h1[0, -1:], last_h2), (last1[0], last2)]
    pairs += [(a[0], b) for a, b in zip(clear + [clear_last], fast + [fast_last])]
    return max(float((a - b).abs().max()) / max(1.0, float(a.abs().max())) for a, b in pairs)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("length", "t"), [(1, 1), (7, 2), (127, 2), (300, 3), (700, 3)])
def test_decoder_computes_the_clear_model(variant: str, length: int, t: int, kernel: bool) -> None:
    """(127, 2): the new rows straddle two of the kernel's blocks of 128 rows."""
    assert _compare(_random_model(VARIANTS[variant]), length, t, kernel=kernel) < TOLERANCE


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("length", [decoder_module.FLASH_MIN_LEN, decoder_module.FLASH_MIN_LEN + 517])
@pytest.mark.parametrize("t", [1, 2])
def test_chunked_attention_over_long_caches(length: int, t: int, kernel: bool) -> None:
    """At and past the threshold (a partial first chunk, the new rows in the last one)."""
    assert _compare(_random_model({}), length, t, kernel=kernel) < TOLERANCE


def test_position_zero_has_no_mtp_embedding() -> None:
    """As vLLM's MTP (and the clear model): the embedding is zeroed at position 0."""
    assert _compare(_random_model({}), 0, 2) < TOLERANCE


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("length", [decoder_module.SPLIT_MIN_LEN, decoder_module.FLASH_MIN_LEN + 517])
@pytest.mark.parametrize("t", [1, 2])
def test_attention_split_with_a_helper_thread(length: int, t: int, kernel: bool) -> None:
    with ThreadPoolExecutor(1) as helper:
        assert _compare(_random_model({}), length, t, helper, kernel) < TOLERANCE


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_busy_helper_is_not_waited_for(kernel: bool) -> None:
    """The helper's half not started yet (its thread busy): this thread computes it."""
    release = threading.Event()
    with ThreadPoolExecutor(1) as helper:
        helper.submit(release.wait)  # occupies the helper until the check is done
        try:
            assert _compare(_random_model({}), decoder_module.SPLIT_MIN_LEN, 2, helper, kernel) < TOLERANCE
        finally:
            release.set()


def test_without_the_kernel_the_products_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """No numba (or a kernel that fails its check): the decoder keeps PyTorch's products,
    and asking for the kernel is an error, not a silent fallback."""
    from decode_server.reference import latent_kernel

    model = _random_model({})
    assert Decoder(model, max_positions=8).kernel  # numba is installed here
    monkeypatch.setattr(latent_kernel, "_compiled", lambda: None)
    assert not Decoder(model, max_positions=8).kernel
    with pytest.raises(ValueError, match="numba"):
        Decoder(model, max_positions=8, kernel=True)

    def wrong(q, kv, lora, t, out, peak, total) -> None:  # type: ignore[no-untyped-def]
        out[:] = 0.0
        peak[:] = 0.0
        total[:] = 1.0

    monkeypatch.setattr(latent_kernel, "_compiled", lambda: wrong)
    assert not Decoder(model, max_positions=8).kernel
