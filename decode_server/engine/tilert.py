"""TileRT engine: an adapter over TileRT's GLM-5 generator (PyPI ``tilert``, B200 only).

TileRT cannot run on CPU machines; this module imports ``tilert`` lazily, and its
tests drive it with a fake generator exposing the same methods
(``tests/fakes/fake_tilert.py``). What it relies on, read from tilert 0.1.6.post3:

* ``tilert.load_backend("glm5")``; ``GLM5Generator(model_args=ModelArgsGLM5(),
  max_new_tokens=, model_weights_dir=, with_mtp=, use_topp=True, enable_thinking=False)``;
  ``.from_pretrained()`` loads the converted weights (all 8 GPUs of the node).
* One sequence at a time: ``.inject_cache([(indexer_keys, latent, rope)] per layer,
  start_pos=0)`` (bf16; see :mod:`decode_server.engine.tilert_kv`) then
  ``.set_cur_pos(num_prompt_tokens - 1)``.
* Sampling: ``.update_sampling_params(temperature, top_p, top_k, use_topp)``; greedy is
  top-k 1 without top-p; the kernel's top-k pool is 256 (256 = off);
  ``decode_layer.set_sampling_seed(seed, with_mtp=)``.
* MTP decode (3 drafts + 1): ``decode_layer.show_hands(draft[1, 4] int32, ar_steps)``;
  the first call, with a draft of the last prompt token, only primes the MTP layer's
  state and its output is discarded; the next uses the first token (from prefill), later
  ones ``decode_layer.get_next_draft_tokens(0)``. Results: ``ar_accepted_tokens(0)`` =
  ``[count, tokens...]`` and ``ar_num_accepted(0)`` = ``[steps, per-step counts...]``.
* Without MTP: ``set_prefill_valid_tokens(0, with_mtp=False)``,
  ``show_hands_no_mtp(prev[1] int32, ar_steps)``, ``ar_accepted_tokens_no_mtp(0)``.
* ``decode_layer.reset_sequence()`` after each sequence. No logprobs.
* Structured output (when the decode layer has it): ``decode_layer.update_grammar_bitmask(masks)``
  before a verify call, ``masks`` int32 ``[1, rows, vocab_size / 32]`` on TileRT's device (the
  shape of its ``GRAMMAR_BITMASK`` buffer; xgrammar's bit layout), one row per position of the
  call (1 + 3 with MTP: the rows after each draft, see :mod:`decode_server.engine.grammar`),
  one verify step per call (``ar_steps`` 1: the next masks depend on what it accepted);
  ``decode_layer.reset_grammar_bitmask()`` once the grammar is done or the sequence ends.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from connector.layout import GLM5_MAIN_LAYERS, KVLayout, glm5_fp8_ds_mla_layout
from decode_server.engine.base import (
    Cancelled,
    DecodeSession,
    Engine,
    EngineCapabilities,
    EngineError,
    SamplingParams,
    TokenOut,
)
from decode_server.engine.grammar import Constraint
from decode_server.engine.tilert_kv import INDEX_HEAD_DIM, convert_layers, hadamard_matrix
from pd_wire.decode import EngineFeatures

if TYPE_CHECKING:
    from connector.receiver import ReceivedKV
    from pd_wire.handoff import HandoffResult

TILERT_NUM_MTP = 3  # TileRT's GLM-5 MTP verifies 3 drafts per step (--num-mtp 3, or 0: no MTP)
TOP_K_POOL = 256  # TileRT's sampling kernel: top-k over at most 256 candidates; 256 means off
GLM5_VOCAB_SIZE = 154880  # GLM-5's vocabulary (config.json's vocab_size wins)
# What TileRT's GLM-5 decode runtime honours besides temperature / top-p / top-k: nothing
# (its own PD stack refuses penalties, min_p, logit_bias and a per-request seed for this
# model; the adapter does not return logprobs); structured output when TileRT's decode layer
# takes a grammar bitmask (TileRTEngine.capabilities). The router refuses the rest before prefill.
FEATURES = EngineFeatures()
TILERT_VERSION = "0.1.6.post3"  # the TileRT release this adapter was written and oracle-tested against
MISSING_TILERT = (f"the tilert engine needs the `tilert` package (PyPI tilert=={TILERT_VERSION}: Python 3.12, CUDA 13, "
                  "NVIDIA B200/B300), i.e. the TileRT decode image or `pip install 'tilert-pd[tilert]'`; "
                  "on other machines use --engine reference")


def load_glm5_generator(model_dir: Path, max_seq_len: int, with_mtp: bool) -> Any:
    """Build and load TileRT's GLM-5 generator (minutes on 8 x B200)."""
    try:
        import tilert
        from tilert.models.glm_5.generator import GLM5Generator
        from tilert.models.glm_5.model_args import ModelArgsGLM5
    except ImportError as exc:
        raise EngineError(f"{MISSING_TILERT} ({exc})") from exc
    if hasattr(tilert, "load_backend"):
        tilert.load_backend("glm5")
    gen = GLM5Generator(model_args=ModelArgsGLM5(), max_new_tokens=max_seq_len, model_weights_dir=str(model_dir),
                        with_mtp=with_mtp, use_topp=True, enable_thinking=False)
    gen.from_pretrained()
    return gen


def tilert_top_k(top_k: int) -> int:
    return top_k if 1 <= top_k < TOP_K_POOL else TOP_K_POOL


def _flat(tensor: Any) -> list[int]:
    t = tensor.cpu()
    if t.dim() > 1:
        t = t[0]
    return [int(v) for v in t.tolist()]


class TileRTSession(DecodeSession):
    def __init__(self, engine: TileRTEngine, handoff: HandoffResult, params: SamplingParams) -> None:
        self._engine = engine
        self._dl = engine.generator.decode_layer
        self._last_prompt = handoff.last_prompt_token_id
        self._first = handoff.first_token_id
        self._budget = params.max_tokens - 1  # tokens left after the first one
        self._calls = 0
        self._prev_token = handoff.first_token_id
        super().__init__()
        self._closed = False
        self._grammar: Constraint | None = None
        self._mask_written = False
        if params.grammar is not None:
            rows = (TILERT_NUM_MTP if engine.num_mtp else 0) + 1
            self._grammar = Constraint(params.grammar, engine.vocab_size, rows)
            self._grammar.accept_first(handoff.first_token_id)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._clear_mask()
                self._dl.reset_sequence()
            finally:
                self._engine._release()

    def _clear_mask(self) -> None:
        if self._mask_written:
            self._mask_written = False
            self._dl.reset_grammar_bitmask()

    def _constrain(self, drafts: list[int]) -> bool:
        """Before a verify call: this step's masks to TileRT while the grammar is on; True
        when the call must verify one step only."""
        grammar = self._grammar
        if grammar is None:
            return False
        if not grammar.active:
            self._clear_mask()
            return False
        masks = grammar.step_masks(drafts)
        self._dl.update_grammar_bitmask(masks.unsqueeze(0).to(self._engine.device))
        self._mask_written = True
        return True

    def _accept(self, tokens: list[int]) -> None:
        if self._grammar is not None:
            for token in tokens:
                self._grammar.accept(token)

    def _ar_steps(self, per_step: int) -> int:
        return max(1, min(self._engine.ar_steps, -(-self._budget // per_step)))

    def step(self) -> list[TokenOut]:
        if self._cancel.is_set():
            raise Cancelled("cancelled")
        if self._closed:
            raise EngineError("session is closed")
        tokens = self._step_mtp() if self._engine.num_mtp else self._step_plain()
        self._budget -= len(tokens)
        return [TokenOut(t) for t in tokens]

    def _draft(self, token: int) -> Any:
        torch = self._engine.torch
        return torch.full((1, TILERT_NUM_MTP + 1), int(token), dtype=torch.int32, device=self._engine.device)

    def _step_mtp(self) -> list[int]:
        width = TILERT_NUM_MTP + 1
        if self._calls == 0:
            self._dl.set_prefill_valid_tokens(0)
            self._dl.show_hands(self._draft(self._last_prompt), 1)  # primes MTP; output discarded
            draft = self._draft(self._first)
        else:
            draft = self._dl.get_next_draft_tokens(0).reshape(1, width)
        self._calls += 1
        one_step = self._constrain(_flat(draft)[1:])
        self._dl.show_hands(draft, 1 if one_step else self._ar_steps(width))
        accepted = _flat(self._dl.ar_accepted_tokens(0))
        per_step = _flat(self._dl.ar_num_accepted(0))
        tokens = accepted[1:1 + accepted[0]]
        self._accept(tokens)
        steps = per_step[1:1 + per_step[0]]
        self._stats.steps += len(steps)
        self._stats.drafted += TILERT_NUM_MTP * len(steps)
        self._stats.accepted += sum(steps) - len(steps)  # each verify step adds one bonus token
        return tokens

    def _step_plain(self) -> list[int]:
        torch = self._engine.torch
        if self._calls == 0:
            self._dl.set_prefill_valid_tokens(0, with_mtp=False)
        self._calls += 1
        prev = torch.tensor([self._prev_token], dtype=torch.int32, device=self._engine.device)
        one_step = self._constrain([])
        self._dl.show_hands_no_mtp(prev, 1 if one_step else self._ar_steps(1))
        accepted = _flat(self._dl.ar_accepted_tokens_no_mtp(0))
        tokens = accepted[1:1 + accepted[0]]
        self._accept(tokens)
        if tokens:
            self._prev_token = tokens[-1]
        return tokens


class TileRTEngine(Engine):
    """One slot. ``generator`` may be given (tests); otherwise TileRT is loaded."""

    def __init__(self, model_dir: Path | str, *, max_seq_len: int, num_mtp: int = TILERT_NUM_MTP,
                 ar_steps: int = 8, device: str = "cuda:0", generator: Any = None) -> None:
        import torch

        if num_mtp not in (0, TILERT_NUM_MTP):
            raise ValueError(f"num_mtp={num_mtp}: TileRT's GLM-5 MTP drafts {TILERT_NUM_MTP} tokens; use 3 or 0")
        if ar_steps < 1:
            raise ValueError(f"ar_steps={ar_steps}: must be >= 1")
        self.torch = torch
        self.model_dir = Path(model_dir)
        self.num_mtp = num_mtp
        self.ar_steps = ar_steps
        self.device = device
        self._max_seq_len = max_seq_len
        self._layout = glm5_fp8_ds_mla_layout(self._main_layers(), 1 if num_mtp else 0)
        self.vocab_size = self._config().get("vocab_size") or GLM5_VOCAB_SIZE
        self._lock = threading.Lock()
        self._busy = False
        self.generator = generator if generator is not None else load_glm5_generator(
            self.model_dir, max_seq_len, with_mtp=bool(num_mtp))
        self._hadamard: Any = None  # on TileRT's device, made by the first start()

    def _config(self) -> dict[str, Any]:
        cfg_path = self.model_dir / "config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        return cfg if isinstance(cfg, dict) else {}

    def _main_layers(self) -> int:
        layers = self._config().get("num_hidden_layers")
        return layers if isinstance(layers, int) and layers > 0 else GLM5_MAIN_LAYERS

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(model=self.model_dir.name, engine="tilert", slots=1, max_seq_len=self._max_seq_len,
                                  num_mtp=self.num_mtp, features=FEATURES.model_copy(update={
                                      "structured_output": hasattr(self.generator.decode_layer,
                                                                   "update_grammar_bitmask")}))

    @property
    def kv_layout(self) -> KVLayout:
        return self._layout

    def _release(self) -> None:
        with self._lock:
            self._busy = False

    def _apply_sampling(self, params: SamplingParams) -> None:
        gen = self.generator
        if params.greedy:
            gen.update_sampling_params(temperature=1.0, top_p=1.0, top_k=1, use_topp=False)
        else:
            gen.update_sampling_params(temperature=params.temperature, top_p=params.top_p,
                                       top_k=tilert_top_k(params.top_k), use_topp=True)
        if params.seed is not None:
            gen.decode_layer.set_sampling_seed(params.seed, with_mtp=bool(self.num_mtp))

    def start(self, kv: ReceivedKV, handoff: HandoffResult, params: SamplingParams) -> TileRTSession:
        n = handoff.num_prompt_tokens
        if kv.num_tokens != n:
            raise EngineError(f"received {kv.num_tokens} tokens of KV, the handoff says {n}")
        if len(kv.layers) != self._layout.num_layers:
            raise EngineError(f"received {len(kv.layers)} layers, the tilert engine needs {self._layout.num_layers}")
        if n + params.max_tokens > self._max_seq_len:
            raise EngineError(f"{n} prompt + {params.max_tokens} new tokens exceed max_seq_len {self._max_seq_len}")
        if params.logprobs is not None:
            raise EngineError("the tilert engine has no logprobs")
        if params.resumed_from and params.grammar is not None:  # its token at the cut is prefill's, unconstrained
            raise EngineError("the tilert engine resumes a cut sequence only without a grammar")
        with self._lock:
            if self._busy:
                raise EngineError("the tilert engine decodes one sequence at a time and is busy")
            self._busy = True
        try:
            if self._hadamard is None:
                self._hadamard = hadamard_matrix(INDEX_HEAD_DIM, device=self.device)
            layers = convert_layers(kv.layers, n, self._hadamard, device=self.device)  # on TileRT's device
            self.generator.inject_cache(layers, start_pos=0)
            self.generator.set_cur_pos(n - 1)
            self._apply_sampling(params)
            return TileRTSession(self, handoff, params)
        except Exception as exc:
            self._release()
            if isinstance(exc, ValueError):
                raise EngineError(f"bad KV for the tilert engine: {exc}") from exc
            raise

    def shutdown(self) -> None:
        cleanup = getattr(self.generator, "cleanup", None)
        if cleanup is not None:
            cleanup()
