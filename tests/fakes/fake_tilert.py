"""A fake of TileRT's GLM-5 generator (same method names as tilert 0.1.6.post3's
``GLM5Generator`` and its ``decode_layer``), recording every call.

Its "model" is a fixed token chain: after token ``t`` comes ``next_token(t)``. MTP verify
steps accept ``accept_cycle`` tokens in turn (1..4: accepted drafts + the bonus token).
It checks the call protocol the adapter must follow (inject before decode, the MTP
priming call with the last prompt token, then the first token, then the drafts it
handed out) and raises AssertionError otherwise.

Structured output: ``update_grammar_bitmask(masks)`` records the masks (int32
``[1, rows, VOCAB / 32]``, xgrammar's bit layout) and, until ``reset_grammar_bitmask()``,
the next verify call honours them: the token at position ``i`` of a step is the chain's
next token if row ``i`` allows it, else the smallest allowed token above it (wrapping).

``install_fake_tilert(monkeypatch)`` makes ``import tilert`` (and the generator and
model-args modules) resolve to this fake.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch

VOCAB = 1000


def next_token(t: int) -> int:
    return (t * 31 + 7) % VOCAB


def chain(start: int, n: int) -> list[int]:
    out, t = [], start
    for _ in range(n):
        t = next_token(t)
        out.append(t)
    return out


class FakeDecodeLayer:
    def __init__(self, gen: FakeGLM5Generator) -> None:
        self._gen = gen
        self.calls = gen.calls
        self._accepted = torch.zeros(1, dtype=torch.int64)
        self._num = torch.zeros(1, dtype=torch.int64)
        self._next_draft = torch.zeros(1, 4, dtype=torch.int32)
        self._verify = 0
        self._expect_draft: list[int] | None = None
        self._primed = False
        self.masks: torch.Tensor | None = None  # the grammar bitmask in force
        self.mask_history: list[torch.Tensor] = []

    def update_grammar_bitmask(self, masks: torch.Tensor) -> None:
        assert masks.dtype == torch.int32 and masks.dim() == 3 and masks.shape[0] == 1, masks.shape
        assert masks.shape[2] == (VOCAB + 31) // 32, masks.shape
        self.calls.append(("update_grammar_bitmask", tuple(masks.shape)))
        self.masks = masks.clone()
        self.mask_history.append(self.masks)

    def reset_grammar_bitmask(self) -> None:
        self.calls.append(("reset_grammar_bitmask",))
        self.masks = None

    def _allowed(self, row: int, token: int) -> bool:
        if self.masks is None:
            return True
        word = int(self.masks[0, row, token // 32])
        return bool((word >> (token % 32)) & 1)

    def _next(self, last: int, row: int) -> int:
        token = next_token(last)
        for shift in range(VOCAB):
            candidate = (token + shift) % VOCAB
            if self._allowed(row, candidate):
                return candidate
        raise AssertionError(f"mask row {row} allows no token")

    def set_prefill_valid_tokens(self, n: int, with_mtp: bool | None = None) -> None:
        self.calls.append(("set_prefill_valid_tokens", n, with_mtp))

    def set_sampling_seed(self, seed: int, with_mtp: bool | None = None) -> None:
        self.calls.append(("set_sampling_seed", seed, with_mtp))

    def _check_ready(self) -> None:
        assert self._gen.injected is not None, "decode before inject_cache"
        assert self._gen.cur_pos == self._gen.injected_tokens - 1, "set_cur_pos(seq_len - 1) missing"

    def show_hands(self, draft: torch.Tensor, ar_steps: int = 1) -> None:
        self._check_ready()
        assert draft.dtype == torch.int32 and tuple(draft.shape) == (1, 4), draft
        row = [int(v) for v in draft[0].tolist()]
        self.calls.append(("show_hands", row, ar_steps))
        if not self._primed:
            assert row == [self._gen.last_prompt_token] * 4, (
                f"first MTP call must prime with the last prompt token: {row}")
            self._primed = True
            self._emit([], [])
            return
        if self._expect_draft is None:
            assert len(set(row)) == 1, f"second MTP call must carry the first token: {row}"
        else:
            assert row == self._expect_draft, f"draft {row} is not the one handed out {self._expect_draft}"
        cycle = self._gen.accept_cycle
        tokens: list[int] = []
        counts: list[int] = []
        last = row[0]
        assert self.masks is None or ar_steps == 1, "a grammar mask holds for one verify step only"
        for _ in range(ar_steps):
            n = cycle[self._verify % len(cycle)]
            self._verify += 1
            step = []
            for i in range(n):
                step.append(self._next(step[-1] if step else last, i))
            tokens += step
            counts.append(n)
            last = step[-1]
        self._emit(tokens, counts)
        self._expect_draft = [last] + chain(last, 3)
        self._next_draft = torch.tensor([self._expect_draft], dtype=torch.int32)

    def show_hands_no_mtp(self, prev: torch.Tensor, ar_steps: int = 1) -> None:
        self._check_ready()
        assert prev.dtype == torch.int32 and tuple(prev.shape) == (1,), prev
        self.calls.append(("show_hands_no_mtp", int(prev[0]), ar_steps))
        assert self.masks is None or ar_steps == 1, "a grammar mask holds for one verify step only"
        tokens = [self._next(int(prev[0]), 0)] if self.masks is not None else chain(int(prev[0]), ar_steps)
        self._emit(tokens, [1] * ar_steps)

    def _emit(self, tokens: list[int], counts: list[int]) -> None:
        # [batch=1, 1 + n] as TileRT returns them (its own adapter takes row 0)
        self._accepted = torch.tensor([[len(tokens), *tokens]], dtype=torch.int64)
        self._num = torch.tensor([[len(counts), *counts]], dtype=torch.int64)

    def ar_accepted_tokens(self, dev: int = 0) -> torch.Tensor:
        return self._accepted

    def ar_num_accepted(self, dev: int = 0) -> torch.Tensor:
        return self._num

    def ar_accepted_tokens_no_mtp(self, dev: int = 0) -> torch.Tensor:
        return self._accepted

    def get_next_draft_tokens(self, device_id: int = 0) -> torch.Tensor:
        return self._next_draft

    def reset_sequence(self) -> None:
        assert self.masks is None, "reset_grammar_bitmask must come before the sequence ends"
        self.calls.append(("reset_sequence",))
        self._primed = False
        self._expect_draft = None
        self._verify = 0
        self._gen.injected = None


@dataclass
class FakeGLM5Generator:
    model_args: Any = None
    max_new_tokens: int = 100
    model_weights_dir: str = ""
    with_mtp: bool = False
    use_topp: bool = False
    enable_thinking: bool = False
    accept_cycle: tuple[int, ...] = (4, 1, 3, 2)
    calls: list[tuple] = field(default_factory=list)
    injected: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    injected_tokens: int = 0
    cur_pos: int = -1
    last_prompt_token: int = -1  # set by the test (TileRT itself does not know it)
    loaded: bool = False

    def __post_init__(self) -> None:
        self.decode_layer = FakeDecodeLayer(self)

    def from_pretrained(self) -> None:
        self.calls.append(("from_pretrained",))
        self.loaded = True

    def inject_cache(self, layer_caches: list, start_pos: int = 0, end_pos: int | None = None) -> None:
        assert start_pos == 0
        for ki, kv, pe in layer_caches:
            assert ki.dtype == kv.dtype == pe.dtype == torch.bfloat16
            assert ki.shape[1] == 128 and kv.shape[1] == 512 and pe.shape[1] == 64
        self.calls.append(("inject_cache", len(layer_caches), layer_caches[0][0].shape[0]))
        self.injected = layer_caches
        self.injected_tokens = layer_caches[0][0].shape[0]

    def set_cur_pos(self, cur_pos: int) -> None:
        self.calls.append(("set_cur_pos", cur_pos))
        self.cur_pos = cur_pos

    def update_sampling_params(self, temperature: float = 1.0, top_p: float = 0.95, top_k: int = 256,
                               use_topp: bool = True) -> None:
        self.calls.append(("update_sampling_params", temperature, top_p, top_k, use_topp))

    def cleanup(self) -> None:
        self.calls.append(("cleanup",))


def install_fake_tilert(monkeypatch: Any) -> dict[str, Any]:
    """Make ``import tilert`` find this fake; returns a record of what was built."""
    built: dict[str, Any] = {"backends": []}
    pkg = types.ModuleType("tilert")
    pkg.load_backend = lambda name: built["backends"].append(name)  # type: ignore[attr-defined]
    gen_mod = types.ModuleType("tilert.models.glm_5.generator")
    args_mod = types.ModuleType("tilert.models.glm_5.model_args")

    class ModelArgsGLM5:
        n_layers = 78

    def make_generator(**kwargs: Any) -> FakeGLM5Generator:
        gen = FakeGLM5Generator(**kwargs)
        built["generator"] = gen
        return gen

    gen_mod.GLM5Generator = make_generator  # type: ignore[attr-defined]
    args_mod.ModelArgsGLM5 = ModelArgsGLM5  # type: ignore[attr-defined]
    for name, mod in {"tilert": pkg, "tilert.models": types.ModuleType("tilert.models"),
                      "tilert.models.glm_5": types.ModuleType("tilert.models.glm_5"),
                      "tilert.models.glm_5.generator": gen_mod, "tilert.models.glm_5.model_args": args_mod}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return built
