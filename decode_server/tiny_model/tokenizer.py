"""A byte-level BPE tokenizer trained locally, GLM-style special tokens and chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (
    EOS_TOKEN, "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>",
)
# Generation stops at any of these (GLM convention): end of text, the user's or a tool's turn.
STOP_TOKENS = (EOS_TOKEN, "<|user|>", "<|observation|>")

# GLM-style: "[gMASK]<sop>" once, then "<|role|>\n" + content per message; the assistant turn
# may open with "<think>...</think>\n"; tool calls as "<tool_call>name\n{json}</tool_call>";
# tool results as "<|observation|>\n...". enable_thinking=false pre-fills an empty think block.
# No whitespace control: every newline in the output is an explicit "\n".
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% if tools %}<|system|>\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>\n{{ m.content }}"
    "{% elif m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>\n{% endif %}"
    "{{ m.content or '' }}"
    "{% for tc in (m.tool_calls or []) %}<tool_call>{{ tc.function.name }}\n"
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}"
    "{% else %}{{ tc.function.arguments | tojson }}{% endif %}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<|observation|>\n{{ m.content }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}"
    "{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != EOS_TOKEN],
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "model_max_length": max_len,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special_map = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
                   "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != EOS_TOKEN]}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, sort_keys=True) + "\n")


def stop_token_ids(tok: Tokenizer) -> list[int]:
    ids = [tok.token_to_id(t) for t in STOP_TOKENS]
    missing = [t for t, i in zip(STOP_TOKENS, ids) if i is None]
    if missing:
        raise ValueError(f"the tokenizer lacks the stop tokens {missing}")
    return [i for i in ids if i is not None]
