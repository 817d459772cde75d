"""The TileRT adapter against TileRT's own PD code (``tilert/pd_vllm/profiles/mla_nsa.py``
of tilert 0.1.6.post3, see tests/tilert_oracle.py), on CPU:

* KV conversion: ``MlaNsaProfile._dequant_kv`` / ``_dequant_ki`` (fp8_ds_mla latent,
  indexer keys + Hadamard) against :mod:`decode_server.engine.tilert_kv`, bit for bit
  in bf16, with odd page tails and garbage in the unused tail of the last page;
* the decode call protocol: TileRT's ``MlaNsaEngineAdapter`` and our ``TileRTEngine``
  drive two identical recording generators (tests/fakes/fake_tilert.py); the calls they
  make and the tokens they return must agree, with and without MTP;
* the sampling mapping (greedy threshold, top-p, top-k pool) the same way.

TileRT's adapter creates its draft tensors on ``cuda:0``; :class:`CudaOnCpu` runs those
factory calls on the CPU (this CPU-only torch has no CUDA) and changes nothing else.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from connector.receiver import ReceivedKV
from decode_server.engine.base import SamplingParams
from decode_server.engine.tilert import TileRTEngine
from decode_server.engine.tilert_kv import (
    INDEX_HEAD_DIM,
    INDEX_PAGE_TOKENS,
    convert_layers,
    dequant_indexer,
    dequant_latent,
    hadamard_matrix,
)
from pd_wire.handoff import HandoffResult
from tests.fakes.fake_tilert import FakeGLM5Generator
from tests.fakes.vllm_fp8 import quantize_fp8_ds_mla
from tests.tilert_oracle import load_mla_nsa

pytestmark = pytest.mark.timeout(600)  # the first run downloads the 8 MB wheel


@pytest.fixture(scope="module")
def mla_nsa() -> ModuleType:
    return load_mla_nsa()


class CudaOnCpu(TorchFunctionMode):
    """Factory calls asking for a CUDA device get the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _latent_rows(num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """fp8_ds_mla kv rows [T, 528] of latents spanning several orders of magnitude."""
    latent = torch.randn(num_tokens, 512, generator=gen) * torch.exp(3 * torch.randn(num_tokens, 4, 1, generator=gen)
                                                                      ).repeat(1, 1, 128).view(num_tokens, 512)
    return quantize_fp8_ds_mla(latent)


def _indexer_pages(num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Indexer pages [P, 8448]: 64 x 128 fp8 keys then 64 fp32 scales; the unused rows of the
    last page hold whatever a previous request left there (random bytes, non-NaN fp8)."""
    pages = -(-num_tokens // INDEX_PAGE_TOKENS)
    keys = torch.randn(pages * INDEX_PAGE_TOKENS, INDEX_HEAD_DIM, generator=gen) * 4
    scale = keys.abs().amax(-1, keepdim=True).clamp(min=1e-6) / 448.0
    fp8 = (keys / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    scale = scale * torch.exp(torch.randn(scale.shape, generator=gen))
    fp8[num_tokens:] = torch.randint(0, 0x7E, fp8[num_tokens:].shape, dtype=torch.uint8, generator=gen)
    return torch.cat([fp8.view(pages, -1), scale.contiguous().view(torch.uint8).view(pages, -1)], dim=1)


@pytest.mark.parametrize("num_tokens", [1, 63, 64, 65, 333])
def test_latent_dequantization_is_bit_identical_to_tilert(mla_nsa: ModuleType, num_tokens: int) -> None:
    raw = _latent_rows(num_tokens, torch.Generator().manual_seed(num_tokens))
    ours, theirs = dequant_latent(raw), mla_nsa.MlaNsaProfile._dequant_kv(raw, num_tokens)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("num_tokens", [1, 63, 64, 65, 333])
def test_indexer_dequantization_and_hadamard_are_bit_identical_to_tilert(mla_nsa: ModuleType,
                                                                         num_tokens: int) -> None:
    # TileRT rotates with fast_hadamard_transform when it is installed, else with scipy's
    # Hadamard matrix (its wheel depends on scipy): this compares against the latter
    assert importlib.util.find_spec("fast_hadamard_transform") is None
    pages = _indexer_pages(num_tokens, torch.Generator().manual_seed(100 + num_tokens))
    ours = dequant_indexer(pages, num_tokens, hadamard_matrix(INDEX_HEAD_DIM))
    theirs = mla_nsa.MlaNsaProfile._dequant_ki(pages, num_tokens, False)
    assert ours.shape == theirs.shape == (num_tokens, INDEX_HEAD_DIM)
    assert torch.equal(ours, theirs)


def test_converted_layers_are_what_tilert_injects(mla_nsa: ModuleType) -> None:
    """Per layer: TileRT's convert() builds (indexer keys, latent, rope) in that order."""
    gen, n = torch.Generator().manual_seed(7), 333
    layers = [{"kv": _latent_rows(n, gen), "rope": torch.randn(n, 64, generator=gen).to(torch.bfloat16),
               "indexer": _indexer_pages(n, gen)} for _ in range(3)]
    ours = convert_layers(layers, n, hadamard_matrix(INDEX_HEAD_DIM))
    for (ki, kv, pe), planes in zip(ours, layers):
        assert torch.equal(ki, mla_nsa.MlaNsaProfile._dequant_ki(planes["indexer"], n, False))
        assert torch.equal(kv, mla_nsa.MlaNsaProfile._dequant_kv(planes["kv"], n))
        assert torch.equal(pe, planes["rope"].view(torch.uint8).view(torch.bfloat16).contiguous())


# ------------------------------------------------------------------------- decode calls

FIRST, LAST_PROMPT, PROMPT = 11, 5, 8


def _layers() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(PROMPT, 128, dtype=torch.bfloat16), torch.zeros(PROMPT, 512, dtype=torch.bfloat16),
             torch.zeros(PROMPT, 64, dtype=torch.bfloat16)) for _ in range(2)]


def _generator(with_mtp: bool, cycle: tuple[int, ...]) -> FakeGLM5Generator:
    return FakeGLM5Generator(with_mtp=with_mtp, accept_cycle=cycle, last_prompt_token=LAST_PROMPT)


def tilert_decode(mla_nsa: ModuleType, with_mtp: bool, cycle: tuple[int, ...], max_tokens: int,
                  sampling: dict[str, Any]) -> tuple[list[int], list[tuple]]:
    gen = _generator(with_mtp, cycle)
    adapter = mla_nsa.MlaNsaEngineAdapter(gen, with_mtp)
    with CudaOnCpu():
        adapter.inject(SimpleNamespace(layers=_layers(), seq_len=PROMPT, last_prompt_token=LAST_PROMPT))
        tokens = adapter.decode(FIRST, max_tokens, sampling)
    return tokens, gen.calls


def our_decode(tmp_path, with_mtp: bool, cycle: tuple[int, ...], max_tokens: int,
               params: dict[str, Any]) -> tuple[list[int], list[tuple]]:
    """Our adapter driven as the decode server drives it: steps until max_tokens (the first
    token, prefill's, included), then close."""
    gen = _generator(with_mtp, cycle)
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 1}')
    engine = TileRTEngine(tmp_path, max_seq_len=4096, num_mtp=3 if with_mtp else 0, device="cpu", generator=gen)
    handoff = HandoffResult(handoff_id="h", kv_endpoint="x:1", num_prompt_tokens=PROMPT, first_token_id=FIRST,
                            last_prompt_token_id=LAST_PROMPT, status="sent")
    session = _start_with_layers(engine, handoff, SamplingParams(max_tokens=max_tokens, **params))
    tokens = [FIRST]
    while len(tokens) < max_tokens:
        tokens += [t.token_id for t in session.step()]
    session.close()
    return tokens[:max_tokens], gen.calls


def _start_with_layers(engine: TileRTEngine, handoff: HandoffResult, params: SamplingParams):
    """engine.start with received planes that convert to zero tensors of the right shapes."""
    planes = {"kv": torch.zeros(PROMPT, 528, dtype=torch.uint8), "rope": torch.zeros(PROMPT, 64, dtype=torch.bfloat16),
              "indexer": torch.zeros(1, 8448, dtype=torch.uint8)}
    kv = ReceivedKV(handoff_id="h", num_tokens=PROMPT, layers=[planes] * engine.kv_layout.num_layers)
    return engine.start(kv, handoff, params)


def _decode_layer_calls(calls: list[tuple]) -> list[tuple]:
    """What both drive on the generator from the sampling set-up to the end of the sequence."""
    start = next(i for i, c in enumerate(calls) if c[0] == "update_sampling_params")
    return calls[start:]


@pytest.mark.parametrize("with_mtp", [True, False])
@pytest.mark.parametrize("cycle", [(4, 1, 3, 2), (1,), (4,)])
@pytest.mark.parametrize("max_tokens", [2, 7, 40, 129])
def test_decode_calls_and_tokens_match_tilerts_adapter(mla_nsa: ModuleType, tmp_path, with_mtp: bool,
                                                       cycle: tuple[int, ...], max_tokens: int) -> None:
    theirs, their_calls = tilert_decode(mla_nsa, with_mtp, cycle, max_tokens, {"temperature": 0.0})
    ours, our_calls = our_decode(tmp_path, with_mtp, cycle, max_tokens, {"temperature": 0.0})
    assert ours == theirs
    assert _decode_layer_calls(our_calls) == _decode_layer_calls(their_calls)
    assert [c[0] for c in our_calls[:2]] == [c[0] for c in their_calls[:2]] == ["inject_cache", "set_cur_pos"]


SAMPLING = [  # (request temperature, top_p, top_k) -> both must set the same kernel parameters
    (0.0, None, None), (5e-6, 0.9, 40), (1e-5, None, None), (0.6, 0.95, None), (1.0, None, 1), (0.7, 0.9, 255),
    (0.7, None, 256), (0.7, None, 1000), (0.7, None, -1), (0.7, None, 0),
]


@pytest.mark.parametrize("temperature, top_p, top_k", SAMPLING)
def test_sampling_parameters_match_tilerts_adapter(mla_nsa: ModuleType, tmp_path, temperature: float,
                                                   top_p: float | None, top_k: int | None) -> None:
    request = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    _, their_calls = tilert_decode(mla_nsa, True, (4,), 2, {k: v for k, v in request.items() if v is not None})
    params = {"temperature": temperature, "top_p": 1.0 if top_p is None else top_p, "top_k": top_k or 0}
    _, our_calls = our_decode(tmp_path, True, (4,), 2, params)
    mine = [c for c in our_calls if c[0] == "update_sampling_params"]
    assert mine == [c for c in their_calls if c[0] == "update_sampling_params"]
