"""The tiny-model generator: deterministic bytes, the files and metadata vLLM needs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import decode_server.tiny_model.generate as generate_module
from decode_server.reference import ModelConfig, load_model
from decode_server.tiny_model import TrainSettings, ensure_tiny_model
from decode_server.tiny_model.generate import generate
from tests.procs import REPO

pytestmark = pytest.mark.timeout(900)  # the tiny_model_dir fixture may train the model first
QUICK = TrainSettings(steps=3, batch=2, seq_len=32)
SPECIALS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
            "</think>", "<tool_call>", "</tool_call>", "<|endoftext|>"]


def _digests(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = generate(tmp_path / "a", seed=3, layers=1, settings=QUICK)
    b = generate(tmp_path / "b", seed=3, layers=1, settings=QUICK)
    c = generate(tmp_path / "c", seed=4, layers=1, settings=QUICK)
    da, db, dc = _digests(a), _digests(b), _digests(c)
    assert da == db
    assert set(da) >= {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                       "tokenizer_config.json"}
    assert da["model.safetensors"] != dc["model.safetensors"]


@pytest.mark.slow
def test_generated_model_layout(tiny_model_dir: Path) -> None:
    size = sum(f.stat().st_size for f in tiny_model_dir.iterdir())
    assert size < 50 * 2**20, size
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    cfg = ModelConfig.from_hf(raw)
    assert cfg.architecture == "Glm4MoeLiteForCausalLM"
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_nextn_predict_layers) == (512, 64, 1)
    assert cfg.n_shared_experts == 1 and cfg.n_routed_experts > cfg.num_experts_per_tok
    load_model(tiny_model_dir)  # strict: every tensor in the file is used, none missing
    n = cfg.num_hidden_layers
    state = load_file(str(tiny_model_dir / "model.safetensors"))
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "embed_tokens.weight", "self_attn.kv_a_proj_with_mqa.weight",
                 "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight"):
        assert f"model.layers.{n}.{name}" in state, name
    # vLLM's MTP drafter uses the main embedding and lm_head: the MTP copies are identical
    assert torch.equal(state[f"model.layers.{n}.shared_head.head.weight"], state["lm_head.weight"])
    assert torch.equal(state[f"model.layers.{n}.embed_tokens.weight"], state["model.embed_tokens.weight"])


@pytest.mark.slow
def test_tokenizer_and_chat_template(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for special in SPECIALS:
        ids = tok.encode(special, add_special_tokens=False)
        assert len(ids) == 1, (special, ids)
    text = "naïve café 日本語 🙂"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
            {"role": "user", "content": "More"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == ("[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\n<think>greet</think>\n"
                        "Hello.<|user|>\nMore<|assistant|>\n")
    no_think = tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
    assert no_think.endswith("<|assistant|>\n<think></think>\n")
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|endoftext|>") in gen["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|user|>") in gen["eos_token_id"]


@pytest.mark.slow
def test_ensure_reuses_a_complete_model(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    marker = json.loads((tiny_model_dir / "tiny-model.json").read_text())

    def no_generation(*args: object, **kwargs: object) -> None:
        raise AssertionError("a complete model was generated again")

    monkeypatch.setattr(generate_module, "generate", no_generation)
    again = ensure_tiny_model(tiny_model_dir.parent, seed=marker["seed"], layers=marker["layers"])
    assert again == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize(("args", "message"), [(["--layers", "0"], "--layers='0': Input should be greater than"),
                                               (["--seed", "x"], "--seed='x': Input should be a valid integer")])
def test_cli_refuses_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "decode_server.tiny_model", "--out", str(tmp_path / "m"), *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "m").exists()


def test_cli_refuses_a_non_empty_out_dir(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    proc = subprocess.run([sys.executable, "-m", "decode_server.tiny_model", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "not empty" in proc.stderr, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
