"""The model's tokenizer and generation defaults, read from the model directory,
and incremental detokenization.

Only ``tokenizer.json`` (Hugging Face ``tokenizers``), ``generation_config.json``,
``config.json`` and ``tokenizer_config.json`` are read; no chat template is needed
on the decode side (the prompt already is KV). With TileRT these files are copied next to
the converted weights (:mod:`decode_server.model_dir`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from pd_wire.decode import EngineFeatures, SamplingDefaults

REPLACEMENT = "\ufffd"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


# GLM's role tokens that end an assistant turn (the next turn is the user's, or a tool's
# result); GLM checkpoints list them as EOS, TileRT's generator stops on them too.
TURN_END_TOKENS = ("<|user|>", "<|observation|>")


@dataclass(frozen=True)
class GenerationDefaults:
    """``generation_config.json`` as vLLM applies it: EOS ids and default sampling.

    Stop tokens: the checkpoint's EOS list (``generation_config.json``, else
    ``config.json``), the tokenizer's EOS token, and :data:`TURN_END_TOKENS` where the
    tokenizer has them as special tokens (GLM tokenizers)."""

    eos_token_ids: frozenset[int] = frozenset()
    sampling: SamplingDefaults = SamplingDefaults()  # also what the capabilities endpoint reports
    # the model's vocabulary (config.json's ``vocab_size``, as vLLM reads it, else the tokenizer's;
    # 0: unknown): the token ids a request may name (``logit_bias``)
    vocab_size: int = 0

    def unsupported_by(self, features: EngineFeatures) -> str | None:
        """The default an engine with ``features`` cannot apply, described; None: all can be."""
        neutral = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
        for name, value in neutral.items():
            got = getattr(self.sampling, name)
            needs = features.min_p if name == "min_p" else features.penalties
            if got is not None and got != value and not needs:
                return f"generation_config.json sets {name}={got}"
        return None

    @classmethod
    def from_model_dir(cls, model_dir: Path, tokenizer: TextTokenizer | None = None) -> GenerationDefaults:
        gen = _read_json(model_dir / "generation_config.json")
        cfg = _read_json(model_dir / "config.json")
        eos = _id_list(gen.get("eos_token_id")) or _id_list(cfg.get("eos_token_id"))
        vocab = cfg.get("vocab_size")
        vocab_size = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else 0
        if tokenizer is not None:
            vocab_size = vocab_size or tokenizer.vocab_size
            tok_cfg = _read_json(model_dir / "tokenizer_config.json")
            name = tok_cfg.get("eos_token")
            name = name.get("content") if isinstance(name, dict) else name
            names = [name] if isinstance(name, str) else []
            ids = [tokenizer.token_id(n) for n in names] + [tokenizer.special_id(n) for n in TURN_END_TOKENS]
            eos += [i for i in ids if i is not None]
        sampling = {k: gen[k] for k in SamplingDefaults.model_fields
                    if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool)}
        return cls(eos_token_ids=frozenset(eos), sampling=SamplingDefaults.model_validate(sampling),
                   vocab_size=vocab_size)


@dataclass
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the few operations the server needs.

    ``token_text`` caches per instance (the vocabulary is fixed)."""

    tokenizer: Tokenizer
    special_ids: frozenset[int]
    _token_cache: dict[tuple[int, bool], str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> TextTokenizer:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json in the model directory")
        tok = Tokenizer.from_file(str(path))
        special = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        return cls(tok, special)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str) -> int | None:
        return self.tokenizer.token_to_id(text)

    def special_id(self, text: str) -> int | None:
        """The id of ``text`` if the tokenizer has it as a special token."""
        tid = self.tokenizer.token_to_id(text)
        return tid if tid in self.special_ids else None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int, skip_special_tokens: bool = False) -> str:
        """One token's text as logprobs show it (may hold U+FFFD for a partial character)."""
        key = (token_id, skip_special_tokens)
        text = self._token_cache.get(key)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)
            self._token_cache[key] = text
        return text


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas without ever splitting a
    multi-byte UTF-8 character: text ending in U+FFFD is held back until the
    following tokens complete it.

    Decoding restarts from a short window (``prefix``..end) each time, so the cost
    per token stays constant; ``context`` (e.g. the last prompt token) gives the
    first generated token the left context some decoders need for spacing.

    ``keep_special``: with ``skip_special_tokens``, the special tokens (by text) that are
    written all the same (an output parser's markers); the others add no text.
    """

    def __init__(self, tokenizer: TextTokenizer, context: list[int] | None = None,
                 skip_special_tokens: bool = True, keep_special: frozenset[str] = frozenset()) -> None:
        self._tok = tokenizer
        kept = {tokenizer.special_id(t) for t in keep_special} if skip_special_tokens else set()
        # the special tokens left out; with none kept, the tokenizer's own skipping does it
        self._left_out = tokenizer.special_ids - kept if kept - {None} else frozenset()
        self._skip = skip_special_tokens and not self._left_out
        self._ids: list[int] = [t for t in context or [] if t not in self._left_out]
        self._prefix = 0
        self._read = len(self._ids)

    def feed(self, token_id: int) -> str:
        if token_id in self._left_out:
            return ""
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""  # nothing new yet, or an incomplete character: wait for more tokens
        self._prefix = self._read
        self._read = len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """Text still held back at the end of the sequence (an incomplete character)."""
        if self._read == len(self._ids):
            return ""
        before = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix:], self._skip)
        self._prefix = self._read = len(self._ids)
        return after[len(before):]
