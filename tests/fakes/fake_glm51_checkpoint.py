"""A fake GLM-5.1 Hugging Face checkpoint directory: the files a real one has next to its
weights (GLM's special tokens in a small working tokenizer, ``tokenizer_config.json``,
``chat_template.jinja``, ``config.json`` with GLM-5.1's architecture fields,
``generation_config.json``) and a few small stand-in weight shards. Token ids are this
tokenizer's, not GLM-5.1's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

SPECIAL = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
           "<|assistant|>", "<|observation|>"]
WORDS = ["hello", "world", "the", "answer", "is", "42", "."]
CHAT_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def write_fake_glm51_checkpoint(path: Path, *, shards: int = 2, eos: tuple[str, ...] = ("<|endoftext|>",),
                                chat_template_file: bool = True, template_in_tokenizer_config: bool = False,
                                generation_config: bool = True) -> Path:
    """``eos``: the tokens ``generation_config.json`` lists as ``eos_token_id``."""
    path.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS + ["[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(path / "tokenizer.json"))
    eos_ids = [vocab[t] for t in eos]
    tok_cfg: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                     "pad_token": "<|endoftext|>", "model_max_length": 202752}
    if template_in_tokenizer_config:
        tok_cfg["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    if chat_template_file:
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    config = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "num_hidden_layers": 78,
              "num_nextn_predict_layers": 1, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128,
              "index_n_heads": 32, "index_topk": 2048, "eos_token_id": eos_ids, "pad_token_id": vocab["<|endoftext|>"],
              "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if generation_config:
        (path / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": eos_ids, "pad_token_id": vocab["<|endoftext|>"], "temperature": 1.0, "top_p": 0.95,
             "do_sample": True}, indent=2))
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        (path / name).write_bytes(os.urandom(64))
        weight_map[f"model.layers.{i}.weight"] = name
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def token_ids(*names: str) -> set[int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS + ["[UNK]"])}
    return {vocab[n] for n in names}
