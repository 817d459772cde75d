"""The reference decode engine: PyTorch on CPU, the same safetensors vLLM loads, MLA decode
over the received latent+rope KV of every layer (MTP layer included), MoE, and MTP
speculative decoding (draft with the MTP layer, verify with the main model).

One step of a session with ``k = num_mtp`` drafts ``d1..dk`` pending after token ``t``
at position ``p``: the main model runs ``[t, d1..dk]`` at ``p..p+k``; drafts are accepted
while the chosen token equals them; the first mismatch (or, all accepted, the token after
``dk``) is emitted too. The MTP layer then runs over the positions the main model just
made valid, each fed the *next* token and the main hidden there (the same shift vLLM's
prefill applies, see :mod:`decode_server.reference.prefill`), and proposes the next
drafts (chaining its own output for ``k > 1``). The first step has no drafts: the
hidden state of the last prompt position does not travel with the KV.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from connector.layout import KVLayout, cpu_mla_layout
from connector.prefix import first_written
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
from decode_server.engine.sampling import LogitsAdjuster, choose, position_seed, token_out
from decode_server.reference.decoder import Decoder
from decode_server.reference.model import DTYPES, MlaMoeModel, load_model
from pd_wire.decode import EngineFeatures

if TYPE_CHECKING:
    from connector.receiver import ReceivedKV
    from pd_wire.handoff import HandoffResult

log = logging.getLogger(__name__)
FEATURES = EngineFeatures(logprobs=True, penalties=True, logit_bias=True, min_p=True, seed=True,
                          structured_output=True)
DEFAULT_THREADS = 1  # PyTorch intra-op threads of a process decoding with this engine (see ReferenceEngine)


class ReferenceSession(DecodeSession):
    def __init__(self, decoder: Decoder, caches: torch.Tensor, num_prompt_tokens: int, first_token_id: int,
                 params: SamplingParams, num_mtp: int, capacity: int, release: Callable[[int], None],
                 last_prompt_token_id: int = 0) -> None:
        self._decoder = decoder
        self._caches = list(caches)  # per layer [rows, 576]: main layers, then the MTP layer when drafting
        self._num_main = decoder.cfg.num_hidden_layers
        self._capacity = capacity
        self._len = num_prompt_tokens  # positions whose main KV is valid
        self._pending = first_token_id  # emitted, not yet run through the main model
        self._drafts: list[int] = []
        self._params = params
        self._num_mtp = num_mtp
        self._device = caches.device
        self._gen = torch.Generator(device=self._device)
        # each draw seeded by its position (sampling.position_seed): an unseeded request's seed
        # is drawn once here
        self._seed = params.seed if params.seed is not None else secrets.randbits(63)
        here = params.first_token_here
        self._adjust = (LogitsAdjuster(params, decoder.cfg.vocab_size, None if here else first_token_id,
                                       self._device) if params.adjusts_logits else None)
        super().__init__()
        self._grammar: Constraint | None = None
        if params.grammar is not None:  # structured output: the masks of a step's 1 + num_mtp rows
            self._grammar = Constraint(params.grammar, decoder.cfg.vocab_size, 1 + num_mtp)
            for token in params.resumed_from:  # the output before a cut
                self._grammar.accept(token)
        if here:
            self.first_token = self._choose_first(last_prompt_token_id)
            self._pending = self.first_token.token_id
        if self._grammar is not None:
            self._grammar.accept_first(self._pending)
        self._release = release
        self._closed = False
        self._lock = threading.Lock()

    def _choose_first(self, last_prompt_token_id: int) -> TokenOut:
        """The first output token chosen here: the last prompt position run again (its KV
        row rewritten with the same values) for its logits."""
        with torch.inference_mode():
            _, logits = self._decoder.forward_main(torch.tensor([last_prompt_token_id], device=self._device),
                                                   self._len - 1, self._caches[:self._num_main])
        row = logits[0] if self._adjust is None else self._adjust(logits[0])
        if self._grammar is not None and self._grammar.active:
            row = self._grammar.constrain(row, self._grammar.step_masks([])[0])
        tok = choose(row, self._params, self._at(self._len))
        if self._adjust is not None:
            self._adjust.accept(tok)
        return token_out(logits[0], tok, self._params)

    def _at(self, position: int) -> torch.Generator:
        """The generator for the draw of the token at ``position``."""
        self._gen.manual_seed(position_seed(self._seed, position))
        return self._gen

    @property
    def position(self) -> int:
        """Position of the pending (last emitted) token."""
        return self._len

    @property
    def kept_tokens(self) -> int:
        """Every position before the pending token: their main and MTP rows are this
        sequence's (a rejected draft's rows lie past them)."""
        return self._len

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._caches = []
        self._release(self._len)

    def _check(self) -> None:
        if self._cancel.is_set():
            raise Cancelled("sequence cancelled")
        if self._closed:
            raise EngineError("session is closed")

    def step(self) -> list[TokenOut]:
        self._check()
        tokens = [self._pending, *self._drafts]
        if self._len + len(tokens) + self._num_mtp > self._capacity:
            raise EngineError(f"sequence too long: position {self._len + len(tokens)} "
                              f"reaches the session's capacity of {self._capacity} tokens")
        with torch.inference_mode():
            hidden, logits = self._decoder.forward_main(torch.tensor(tokens, device=self._device), self._len,
                                                        self._caches[:self._num_main])
        self._check()
        if (self._grammar is not None and self._grammar.active) or self._adjust is not None:
            out, accepted = self._choose_each(logits, self._grammar)
        else:
            out, accepted = self._choose(logits)
        self._stats.steps += 1
        self._stats.drafted += len(self._drafts)
        self._stats.accepted += accepted
        new_len = self._len + 1 + accepted
        if self._num_mtp:
            self._drafts = self._propose(tokens[1:1 + accepted] + [out[-1].token_id], hidden[:1 + accepted],
                                         self._len)
        self._len, self._pending = new_len, out[-1].token_id
        return out

    def _choose_each(self, logits: torch.Tensor, grammar: Constraint | None) -> tuple[list[TokenOut], int]:
        """The tokens of one step, position by position, when a position's logits depend on
        the tokens emitted before it: the penalties and logit_bias (``self._adjust``), the
        grammar's mask (a draft the grammar rejects cannot be chosen: rejected). Logprobs
        stay raw, as vLLM reports them."""
        masks = grammar.step_masks(self._drafts) if grammar is not None and grammar.active else None
        out: list[TokenOut] = []
        accepted = 0
        for i in range(len(self._drafts) + 1):
            draft = self._drafts[i] if i < len(self._drafts) else None
            row = logits[i] if self._adjust is None else self._adjust(logits[i])
            if masks is not None and grammar is not None and grammar.active:
                row = grammar.constrain(row, masks[i])
            tok = choose(row, self._params, self._at(self._len + 1 + i))
            if self._adjust is not None:
                self._adjust.accept(tok)
            if grammar is not None:
                grammar.accept(tok)
            out.append(token_out(logits[i], tok, self._params))
            if tok != draft:
                break
            accepted += 1
        return out, accepted

    def _choose(self, logits: torch.Tensor) -> tuple[list[TokenOut], int]:
        greedy = logits.argmax(-1).tolist() if self._params.greedy else None
        out: list[TokenOut] = []
        accepted = 0
        for i, draft in enumerate(self._drafts):
            tok = greedy[i] if greedy is not None else choose(logits[i], self._params, self._at(self._len + 1 + i))
            out.append(token_out(logits[i], tok, self._params))
            if tok != draft:
                break
            accepted += 1
        else:
            tok = greedy[-1] if greedy is not None else choose(logits[-1], self._params,
                                                               self._at(self._len + len(self._drafts) + 1))
            out.append(token_out(logits[-1], tok, self._params))
        return out, accepted

    def _propose(self, next_ids: list[int], hidden: torch.Tensor, start: int) -> list[int]:
        """Run the MTP layer at ``start..start+len(next_ids)-1`` and chain ``num_mtp`` drafts."""
        cache = self._caches[self._num_main]
        drafts: list[int] = []
        ids = torch.tensor(next_ids, device=self._device)
        with torch.inference_mode():
            for _ in range(self._num_mtp):
                mtp_hidden, mtp_logits = self._decoder.forward_mtp(ids, hidden, start, cache, last_only=True)
                drafts.append(int(mtp_logits[-1].argmax()))
                start += ids.shape[0]
                ids = torch.tensor([drafts[-1]], device=self._device)
                hidden = mtp_hidden[-1:]
        return drafts


class ReferenceEngine(Engine):
    """``slots`` concurrent sessions, each decoding in its slot's preallocated KV buffer (one
    per slot, ``layers x max_seq_len x 576``, allocated lazily by the OS on first touch)
    into which ``start`` copies the injected KV. A buffer keeps its last session's rows after
    it closed: a session of the same slot may start from them (``ReceivedKV.reused``: the
    leading rows not received), copying only the rows past them.

    The engine computes in float32, on ``device`` (the CPU in the decode server; a GPU in
    bench/gpu_check.py, which compares the two). ``kv_dtype`` is the dtype of the KV it receives, i.e.
    the dtype vLLM runs the model in: by default the checkpoint's (``bfloat16`` for the
    tiny model, vLLM's default); ``float32`` when vLLM runs with ``--dtype float32`` (the
    closest agreement with vLLM).

    ``threads`` sets PyTorch's intra-op threads for the whole process (``None`` leaves them
    as they are). One by default: a decode step is a chain of small products, which gain
    nothing from splitting, and on a shared machine an OpenMP team waits at every op for
    a thread the OS has descheduled: measured on 2 cores, 2 threads decode 7-10x slower
    than 1 at load average 5 (docs/benchmarks.md, "Decode engine").

    ``split_attention`` (default: on a CPU with more than one core) gives the engine one
    helper thread that takes the older half of every attention over 4096+ cache rows; the
    decoding thread computes the other half and, if the helper has not started its half
    when it is done (its core busy elsewhere), that one too, so a busy machine costs a
    queued task, never a wait for a descheduled thread.

    ``attention_kernel`` (default: where it applies, a float32 model on the CPU with numba)
    computes attention over the cache as one compiled loop instead of PyTorch's products
    (:mod:`decode_server.reference.latent_kernel`); False keeps the products."""

    def __init__(self, model_dir: Path | str, *, slots: int = 1, max_seq_len: int = 4096, num_mtp: int = 1,
                 kv_dtype: str | None = None, model: MlaMoeModel | None = None, device: str = "cpu",
                 threads: int | None = DEFAULT_THREADS, split_attention: bool | None = None,
                 attention_kernel: bool | None = None) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads={threads}: must be >= 1 (or None: leave PyTorch's setting)")
        self._model = model if model is not None else load_model(model_dir, device=device)
        cfg = self._model.cfg
        if slots < 1:
            raise ValueError(f"slots={slots}: must be >= 1")
        if num_mtp < 0 or (num_mtp and not cfg.num_nextn_predict_layers):
            raise ValueError(f"num_mtp={num_mtp}: must be >= 0, and 0 for a model without an MTP layer")
        if not 1 < max_seq_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len}: must be in 2..{cfg.max_position_embeddings} "
                             "(max_position_embeddings)")
        self._kv_dtype = kv_dtype or cfg.dtype
        if self._kv_dtype not in DTYPES:
            raise ValueError(f"kv_dtype={self._kv_dtype!r}: must be one of {sorted(DTYPES)}")
        if threads is not None:
            torch.set_num_threads(threads)
        self._name = Path(model_dir).name
        self._slots, self._max_seq_len, self._num_mtp = slots, max_seq_len, num_mtp
        self._lock = threading.Lock()
        self._layout = cpu_mla_layout(cfg.num_hidden_layers, 1 if num_mtp else 0, self._kv_dtype)
        if split_attention is None:
            split_attention = device == "cpu" and (os.cpu_count() or 1) > 1
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="attention-helper") if split_attention else None
        self._decoder = Decoder(self._model, max_positions=max_seq_len, helper=self._helper, kernel=attention_kernel)
        log.info("reference engine: attention over the cache by %s",
                 "the compiled loop (numba)" if self._decoder.kernel else "PyTorch's products")
        weight = self._model.lm_head.weight
        layers = cfg.num_hidden_layers + (1 if num_mtp else 0)
        self._buffers = [torch.empty(layers, max_seq_len, cfg.kv_width, dtype=weight.dtype, device=weight.device)
                         for _ in range(slots)]
        self._busy: set[int] = set()
        # per free slot: the rows its buffer holds of the last session that ran in it as its own
        # slot (ReceivedKV.slot), what a session reusing them may start from; 0: nothing of use
        # (set as a session closes)
        self._kept_rows = [0] * slots

    @property
    def model(self) -> MlaMoeModel:
        return self._model

    @property
    def busy_slots(self) -> int:
        with self._lock:
            return len(self._busy)

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(model=self._name, engine="reference", slots=self._slots,
                                  max_seq_len=self._max_seq_len, num_mtp=self._num_mtp, features=FEATURES,
                                  keeps_kv=True)

    @property
    def kv_layout(self) -> KVLayout:
        return self._layout

    def _validate(self, kv: ReceivedKV, handoff: HandoffResult) -> None:
        cfg, t = self._model.cfg, handoff.num_prompt_tokens
        # Without MTP decoding, KV that still carries the MTP layer (prefill ran with MTP) is accepted.
        if len(kv.layers) not in (self._layout.num_layers, self._model.num_layers):
            raise EngineError(f"received {len(kv.layers)} KV layers, the layout has {self._layout.num_layers}")
        if kv.num_tokens != t:
            raise EngineError(f"received KV for {kv.num_tokens} tokens, the handoff says {t}")
        if t + 1 >= self._max_seq_len:
            raise EngineError(f"prompt of {t} tokens leaves no room under max_seq_len={self._max_seq_len}")
        if not 0 <= handoff.first_token_id < cfg.vocab_size:
            raise EngineError(f"first_token_id={handoff.first_token_id} is outside the vocabulary")
        for i, layer in enumerate(kv.layers):
            plane = layer.get("kv")
            if plane is None or tuple(plane.shape) != (t, cfg.kv_width):
                shape = None if plane is None else tuple(plane.shape)
                raise EngineError(f"KV layer {i}: expected plane 'kv' of shape {(t, cfg.kv_width)}, got {shape}")

    def shutdown(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=True, cancel_futures=True)

    def _release(self, index: int, own: bool, rows: int) -> None:
        with self._lock:
            self._busy.discard(index)
            self._kept_rows[index] = rows if own else 0

    def _take(self, kv: ReceivedKV) -> tuple[int, bool]:
        """The buffer of the handoff's slot (``own``), or, when that one is busy (KV built
        outside a decode server's slot table) and nothing is reused, any free one."""
        with self._lock:
            index = kv.slot
            if 0 <= index < self._slots and index not in self._busy:
                if kv.reused > self._kept_rows[index]:
                    raise EngineError(f"slot {index} keeps KV for {self._kept_rows[index]} tokens, the handoff "
                                      f"reuses {kv.reused}")
                self._busy.add(index)
                return index, True
            if kv.reused:
                raise EngineError(f"the handoff reuses the KV kept in slot {index}, which is not free")
            free = [i for i in range(self._slots) if i not in self._busy]
            if not free:
                raise EngineError(f"all {self._slots} decode slots are busy")
            self._busy.add(free[-1])
            return free[-1], False

    def start(self, kv: ReceivedKV, handoff: HandoffResult, params: SamplingParams) -> ReferenceSession:
        """A session in the handoff's slot's buffer: the received rows ``[kv.reused, T)`` copied
        in (an MTP layer's from one block earlier: :func:`connector.prefix.first_written`), the
        rows before them kept from the slot's last session (``kv.reused`` > 0)."""
        self._validate(kv, handoff)
        index, own = self._take(kv)
        buffer = self._buffers[index]
        try:
            t, m = handoff.num_prompt_tokens, kv.reused
            capacity = min(self._max_seq_len, t + max(params.max_tokens, 1) + self._num_mtp + 1)
            with torch.inference_mode():
                # without MTP decoding, a received MTP layer is left out
                for i, (cache, layer) in enumerate(zip(buffer, kv.layers)):
                    start = first_written(m, self._layout.is_mtp(i))
                    cache[start:t] = layer["kv"][start:]
            return ReferenceSession(self._decoder, buffer, t, handoff.first_token_id, params, self._num_mtp,
                                    capacity, functools.partial(self._release, index, own),
                                    handoff.last_prompt_token_id)
        except BaseException:
            self._release(index, own, 0)
            raise
