"""The TileRT engine adapter against a fake GLM-5 generator (TileRT itself needs B200):
KV conversion math, call protocol, sampling mapping, MTP accounting, lazy import."""

from __future__ import annotations

import sys

import httpx
import pytest
import torch

from connector.layout import glm5_fp8_ds_mla_layout
from connector.receiver import ReceivedKV
from decode_server.engine.base import EngineError, SamplingParams
from decode_server.engine.tilert import TileRTEngine, tilert_top_k
from decode_server.engine.tilert_kv import convert_layers, dequant_indexer, dequant_latent, hadamard_matrix
from pd_wire.handoff import HandoffResult
from tests.decode_server.helpers import handoff
from tests.fakes.fake_tilert import VOCAB, FakeGLM5Generator, chain, install_fake_tilert

pytestmark = pytest.mark.timeout(60)
FP8_MAX = 448.0


def _quant(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference fp8 e4m3 quantization with one fp32 scale per ``block`` values of a row."""
    rows = x.shape[0]
    xb = x.float().view(rows, -1, block)
    scale = (xb.abs().amax(-1) / FP8_MAX).clamp(min=1e-8)
    q = (xb / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(rows, -1)
    return q, scale.float()


def _sylvester_reference(d: int) -> torch.Tensor:
    i = torch.arange(d)
    parity = torch.tensor([[(a & b).bit_count() % 2 for b in range(d)] for a in range(d)])
    assert parity.shape == (len(i), len(i))
    return (1 - 2 * parity).float() / d ** 0.5


def _pack_kv(latent: torch.Tensor) -> torch.Tensor:
    q, scale = _quant(latent, 128)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8).view(latent.shape[0], 16)], dim=1)


def _pack_indexer(keys: torch.Tensor) -> torch.Tensor:
    t = keys.shape[0]
    pages = -(-t // 64)
    padded = torch.zeros(pages * 64, 128)
    padded[:t] = keys
    q, scale = _quant(padded, 128)  # one scale per token
    fp8 = q.view(torch.uint8).view(pages, 64 * 128)
    sc = scale.contiguous().view(torch.uint8).view(pages, 64 * 4)
    return torch.cat([fp8, sc], dim=1)


def test_latent_dequantization_matches_reference():
    torch.manual_seed(0)
    latent = torch.randn(37, 512) * torch.linspace(0.01, 5, 512)
    raw = _pack_kv(latent)
    assert raw.shape == (37, 528) and raw.dtype == torch.uint8
    q, scale = _quant(latent, 128)
    expect = (q.float().view(37, 4, 128) * scale.unsqueeze(-1)).view(37, 512).to(torch.bfloat16)
    got = dequant_latent(raw)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expect)
    rel = ((got.float() - latent).norm() / latent.norm()).item()
    assert rel < 0.05  # fp8 e4m3 keeps ~3 significant bits
    # a scale from the wrong block is clearly visible
    swapped = raw.clone()
    swapped[:, 512:516], swapped[:, 524:528] = raw[:, 524:528], raw[:, 512:516]
    assert ((dequant_latent(swapped).float() - latent).norm() / latent.norm()).item() > 0.3


def test_indexer_dequantization_and_hadamard_rotation():
    torch.manual_seed(1)
    keys = torch.randn(70, 128)  # two pages, the second partly filled
    pages = _pack_indexer(keys)
    assert pages.shape == (2, 8448)
    h_ref = _sylvester_reference(128)
    assert torch.allclose(hadamard_matrix(128), h_ref)
    got = dequant_indexer(pages, 70, hadamard_matrix(128))
    q, scale = _quant(torch.cat([keys, torch.zeros(58, 128)]), 128)
    deq = (q.float() * scale.unsqueeze(-1).view(-1, 1))[:70].to(torch.bfloat16)
    expect = (deq.float() @ h_ref).to(torch.bfloat16)
    assert got.shape == (70, 128) and torch.allclose(got.float(), expect.float(), atol=1e-2, rtol=1e-2)
    # rotating back (H is orthonormal and symmetric) recovers the keys
    assert ((got.float() @ h_ref - keys).norm() / keys.norm()).item() < 0.06
    with pytest.raises(ValueError, match="pages"):
        dequant_indexer(pages[:1], 70, hadamard_matrix(128))


def _received(num_tokens: int, layers: int) -> ReceivedKV:
    torch.manual_seed(2)
    out = []
    for _ in range(layers):
        out.append({"kv": _pack_kv(torch.randn(num_tokens, 512)),
                    "rope": torch.randn(num_tokens, 64).to(torch.bfloat16),
                    "indexer": _pack_indexer(torch.randn(num_tokens, 128))})
    return ReceivedKV(handoff_id="h", num_tokens=num_tokens, layers=out)


def _handoff(n: int, first: int = 11, last: int = 5) -> HandoffResult:
    return HandoffResult(handoff_id="h", kv_endpoint="x:1", num_prompt_tokens=n, first_token_id=first,
                         last_prompt_token_id=last, status="sent")


def _engine(tmp_path, num_mtp: int = 3, ar_steps: int = 1, layers: int = 3):
    (tmp_path / "config.json").write_text(f'{{"num_hidden_layers": {layers}, "vocab_size": {VOCAB}}}')
    gen = FakeGLM5Generator(with_mtp=bool(num_mtp), last_prompt_token=5)
    return TileRTEngine(tmp_path, max_seq_len=256, num_mtp=num_mtp, ar_steps=ar_steps, device="cpu",
                        generator=gen), gen


def test_start_injects_converted_layers_and_sets_position(tmp_path):
    engine, gen = _engine(tmp_path)
    assert engine.kv_layout == glm5_fp8_ds_mla_layout(3, 1) and engine.capabilities.slots == 1
    kv = _received(20, 4)
    session = engine.start(kv, _handoff(20), SamplingParams(max_tokens=10, temperature=0.0))
    assert ("inject_cache", 4, 20) in gen.calls and ("set_cur_pos", 19) in gen.calls
    assert ("update_sampling_params", 1.0, 1.0, 1, False) in gen.calls  # greedy = top-1, no top-p
    expect = convert_layers(kv.layers, 20, hadamard_matrix(128))
    for (ki, lat, pe), (eki, elat, epe) in zip(gen.injected, expect):
        assert torch.equal(ki, eki) and torch.equal(lat, elat) and torch.equal(pe, epe)
    with pytest.raises(EngineError, match="busy"):
        engine.start(kv, _handoff(20), SamplingParams(max_tokens=10))
    session.close()
    assert gen.calls[-1] == ("reset_sequence",)
    engine.start(kv, _handoff(20), SamplingParams(max_tokens=10)).close()  # free again


def test_mtp_decode_protocol_tokens_and_acceptance(tmp_path):
    engine, gen = _engine(tmp_path)
    session = engine.start(_received(8, 4), _handoff(8, first=11), SamplingParams(max_tokens=40, temperature=0.7,
                                                                                     top_p=0.9, top_k=0, seed=3))
    assert ("update_sampling_params", 0.7, 0.9, 256, True) in gen.calls
    assert ("set_sampling_seed", 3, True) in gen.calls
    tokens: list[int] = []
    for _ in range(4):
        tokens += [t.token_id for t in session.step()]
    assert tokens == chain(11, len(tokens))  # continues after the prefill's first token
    shows = [c for c in gen.calls if c[0] == "show_hands"]
    assert shows[0][1] == [5, 5, 5, 5] and shows[1][1] == [11, 11, 11, 11]
    # accept cycle 4,1,3,2 -> 10 tokens from 4 verify steps, 6 of 12 drafts accepted
    assert len(tokens) == 10
    assert (session.stats.steps, session.stats.drafted, session.stats.accepted) == (4, 12, 6)
    session.cancel()
    with pytest.raises(EngineError):
        session.step()
    session.close()


def test_ar_steps_bounded_by_budget_and_plain_decode(tmp_path):
    engine, gen = _engine(tmp_path, ar_steps=8)
    s = engine.start(_received(8, 4), _handoff(8), SamplingParams(max_tokens=6))
    s.step()
    assert [c[2] for c in gen.calls if c[0] == "show_hands"] == [1, 2]  # 5 tokens left / 4 per step
    s.close()
    engine, gen = _engine(tmp_path, num_mtp=0, ar_steps=4)
    assert engine.kv_layout.num_layers == 3
    s = engine.start(_received(8, 3), _handoff(8, first=11), SamplingParams(max_tokens=100))
    out = [t.token_id for t in s.step()] + [t.token_id for t in s.step()]
    assert out == chain(11, 8)
    assert [c[1] for c in gen.calls if c[0] == "show_hands_no_mtp"] == [11, out[3]]
    s.close()


def test_start_rejects_bad_kv_logprobs_and_a_resumed_sequence_with_a_grammar(tmp_path):
    engine, _ = _engine(tmp_path)
    with pytest.raises(EngineError, match="layers"):
        engine.start(_received(8, 3), _handoff(8), SamplingParams(max_tokens=5))
    with pytest.raises(EngineError, match="tokens of KV"):
        engine.start(_received(8, 4), _handoff(9), SamplingParams(max_tokens=5))
    bad = _received(8, 4)
    bad.layers[2]["rope"] = bad.layers[2]["rope"].float()
    with pytest.raises(EngineError, match="layer 2"):
        engine.start(bad, _handoff(8), SamplingParams(max_tokens=5))
    with pytest.raises(EngineError, match="logprobs"):
        engine.start(_received(8, 4), _handoff(8), SamplingParams(max_tokens=5, logprobs=1))
    with pytest.raises(EngineError, match="only without a grammar"):
        engine.start(_received(8, 4), _handoff(8), SamplingParams(max_tokens=5, resumed_from=(7, 9), grammar=object()))
    engine.start(_received(8, 4), _handoff(8), SamplingParams(max_tokens=5)).close()  # not left busy


def test_a_resumed_sequence_goes_on_from_the_prefill_token_at_the_cut(tmp_path):
    """TileRT's sampler cannot be positioned: a resumed sequence's token at the cut is prefill's
    (greedy: the uninterrupted one), and the engine decodes on from it as from any first token."""
    engine, _ = _engine(tmp_path)
    s = engine.start(_received(8, 4), _handoff(8, first=11), SamplingParams(max_tokens=5, resumed_from=(7, 9)))
    assert s.first_token is None  # the server emits prefill's first token
    assert s.step()
    s.close()


def test_tiny_temperatures_are_greedy_in_tilert(tmp_path):
    engine, gen = _engine(tmp_path)
    engine.start(_received(8, 4), _handoff(8), SamplingParams(max_tokens=5, temperature=5e-6, top_k=40)).close()
    assert ("update_sampling_params", 1.0, 1.0, 1, False) in gen.calls  # top-1, as temperature 0


def test_conversion_runs_on_the_engine_device(tmp_path):
    """KV received in host memory is converted on TileRT's device (here PyTorch's meta
    device stands in for the GPU: shapes and dtypes, no data)."""
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 3}')
    gen = FakeGLM5Generator(with_mtp=True, last_prompt_token=5)
    engine = TileRTEngine(tmp_path, max_seq_len=256, num_mtp=3, device="meta", generator=gen)
    kv = _received(20, 4)
    assert all(p.device.type == "cpu" for layer in kv.layers for p in layer.values())
    engine.start(kv, _handoff(20), SamplingParams(max_tokens=10))
    assert [t.device.type for layer in gen.injected for t in layer] == ["meta"] * 12
    assert [(t.dtype, tuple(t.shape)) for t in gen.injected[0]] == [
        (torch.bfloat16, (20, 128)), (torch.bfloat16, (20, 512)), (torch.bfloat16, (20, 64))]


def test_tilert_receives_into_vram_by_default(tmp_path):
    from decode_server.settings import load_settings
    from tests.fakes.fake_glm51_checkpoint import write_fake_glm51_checkpoint

    model = write_fake_glm51_checkpoint(tmp_path / "m")
    base = ["--model", str(model), "--num-mtp", "3"]
    assert load_settings(["--engine", "tilert", *base], env={}).kv_device == "cuda:0"
    assert load_settings(["--engine", "tilert", "--kv-device", "cpu", *base], env={}).kv_device == "cpu"
    assert load_settings(["--engine", "reference", *base], env={}).kv_device == "cpu"


def test_top_k_mapping():
    assert [tilert_top_k(k) for k in (0, -1, 1, 40, 255, 256, 1000)] == [256, 256, 1, 40, 255, 256, 256]


def test_missing_tilert_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tilert", None)
    with pytest.raises(EngineError, match=r"tilert==0\.1\.6\.post3.*B200"):
        TileRTEngine(tmp_path, max_seq_len=128, num_mtp=3)


def test_loads_generator_through_tilert_api(tmp_path, monkeypatch):
    built = install_fake_tilert(monkeypatch)
    engine = TileRTEngine(tmp_path, max_seq_len=4096, num_mtp=3)
    gen = built["generator"]
    assert built["backends"] == ["glm5"] and gen.loaded
    assert (gen.with_mtp, gen.use_topp, gen.enable_thinking, gen.max_new_tokens) == (True, True, False, 4096)
    assert gen.model_weights_dir == str(tmp_path)
    assert engine.kv_layout.num_layers == 79  # GLM-5.1: 78 + MTP without a config.json
    engine.shutdown()
    assert ("cleanup",) in gen.calls


def test_server_with_tilert_adapter(tmp_path, make_server):
    gen = FakeGLM5Generator(with_mtp=True, last_prompt_token=3)
    engine = TileRTEngine(tmp_path, max_seq_len=256, num_mtp=3, device="cpu", generator=gen)
    srv = make_server(engine=engine, engine_name="tilert", slots=1, max_seq_len=256, kv_tokens=7)
    caps = httpx.get(srv.url + "/v1/pd/capabilities").json()
    assert caps["slots"] == 1 and caps["num_mtp"] == 3
    assert caps["layout_fingerprint"].startswith("glm5.1-fp8-ds-mla-79L")
    out = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 9, "ignore_eos": True,
                                                        "kv_transfer_params": handoff(11, num_prompt_tokens=7)})
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["completion_tokens"] == 9
    # the session closes on the engine's thread after the answer's last byte, then frees the slot
    srv.wait_idle()
    assert ("inject_cache", 79, 7) in gen.calls and gen.calls[-1] == ("reset_sequence",)
    lp = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "logprobs": 1,
                                                       "kv_transfer_params": handoff(11, num_prompt_tokens=7)})
    assert lp.status_code == 400 and lp.json()["error"]["param"] == "logprobs"
    srv.wait_idle()
    assert "decode_server_mtp_acceptance_rate" in httpx.get(srv.url + "/metrics").text
