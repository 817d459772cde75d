"""The decode engine interface: one contract for the reference engine (PyTorch, CPU)
and the TileRT engine (B200).

Life of one sequence (all calls from one worker thread; engines are not async):

1. The decode server receives the prompt's KV from the connector's receiver as a
   :class:`connector.receiver.ReceivedKV` laid out as :attr:`Engine.kv_layout` says.
2. ``session = engine.start(kv, handoff, params)`` injects that KV (the engine copies
   or adopts it; the receive buffer may be reused once ``start`` returns) and
   prepares to decode after ``handoff.first_token_id`` (the token prefill sampled).
3. ``session.step()`` runs one engine step and returns the tokens it produced, in
   order: one for plain decode, up to ``1 + num_mtp`` with MTP (accepted drafts plus
   the bonus token). The first token (``first_token_id``) is NOT returned by the
   engine: the server emits it itself. The server applies stop conditions
   (max_tokens, EOS, stop ids, stop strings) and simply stops calling ``step``.
4. ``session.cancel()`` may be called from another thread; the next (or current)
   ``step`` then raises :class:`Cancelled`. ``session.close()`` always runs last and
   frees the slot's engine state.

Errors: :class:`EngineError` (bad KV, sequence too long, ...) ends the sequence;
the server maps it to an OpenAI error.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pd_wire.decode import EngineFeatures

if TYPE_CHECKING:
    from connector.layout import KVLayout
    from connector.receiver import ReceivedKV
    from pd_wire.handoff import HandoffResult


# Temperatures below this decode greedily, as vLLM (its sampling epsilon) and TileRT do.
GREEDY_BELOW_TEMPERATURE = 1e-5


class EngineError(RuntimeError):
    """The engine cannot continue this sequence."""


class Cancelled(EngineError):
    """The sequence was cancelled."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    logprobs: int | None = None  # None: off; k >= 0: chosen token + top-k
    # structured output: this request's grammar matcher (decode_server.engine.grammar.GrammarMatcher,
    # at the grammar's start), or None; see decode_server/engine/grammar.py
    grammar: Any = field(default=None, compare=False, repr=False)
    min_p: float = 0.0  # 0: off
    # vLLM's semantics: presence/frequency over the generated tokens (the first one, which
    # prefill sampled, included), repetition over the prompt's and the generated tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    prompt_token_ids: tuple[int, ...] = ()  # needed when repetition_penalty != 1
    # a sequence resumed from a cut (its KV prefilled again with these tokens after the prompt):
    # the output tokens generated before the cut, which count for the penalties and advance the
    # grammar; the engine chooses the token at the cut itself (first_token_here)
    resumed_from: tuple[int, ...] = ()
    greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "greedy", self.temperature < GREEDY_BELOW_TEMPERATURE)

    @property
    def first_token_here(self) -> bool:
        """Whether the engine chooses the first token itself, from the last prompt position
        (:attr:`DecodeSession.first_token`): vLLM refuses ``logit_bias`` and ``min_p`` with
        speculative decoding, which our prefill always runs (MTP), so the router leaves them out
        of the prefill leg; and a resumed sequence's token at the cut is drawn as the
        uninterrupted sequence would have drawn it (``resumed_from``)."""
        return bool(self.logit_bias) or self.min_p > 0.0 or bool(self.resumed_from)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before the choice (bias or penalties): then each
        position's choice depends on the tokens before it."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0


@dataclass(frozen=True)
class TokenOut:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # (token id, logprob), best first


@dataclass(frozen=True)
class EngineCapabilities:
    model: str
    engine: str
    slots: int
    max_seq_len: int
    num_mtp: int
    features: EngineFeatures  # what the decode server advertises and checks requests against
    # a session may start from the KV its slot's last session left (ReceivedKV.reused): the
    # engine keeps each slot's KV after a session and copies only the received rows past it
    keeps_kv: bool = False


@dataclass
class SpecStats:
    """MTP counters of one session (or summed over sessions)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class DecodeSession(ABC):
    """Subclasses call ``super().__init__()``; ``step`` checks ``self._cancel`` and
    updates ``self._stats``."""

    def __init__(self) -> None:
        self._cancel = threading.Event()
        self._stats = SpecStats()
        # the first output token when the engine chose it (SamplingParams.first_token_here);
        # None: prefill's (handoff.first_token_id), which the server emits
        self.first_token: TokenOut | None = None

    @abstractmethod
    def step(self) -> list[TokenOut]: ...

    def cancel(self) -> None:
        """Thread-safe: the current or next ``step`` raises :class:`Cancelled`."""
        self._cancel.set()

    @abstractmethod
    def close(self) -> None: ...

    @property
    def stats(self) -> SpecStats:
        return self._stats

    @property
    def kept_tokens(self) -> int:
        """The positions whose KV the engine holds valid for this sequence (the prompt's and the
        output tokens it ran so far): what its slot keeps after it. 0: it keeps nothing."""
        return 0


class Engine(ABC):
    @property
    @abstractmethod
    def capabilities(self) -> EngineCapabilities: ...

    @property
    @abstractmethod
    def kv_layout(self) -> KVLayout: ...

    @abstractmethod
    def start(self, kv: ReceivedKV, handoff: HandoffResult, params: SamplingParams) -> DecodeSession: ...

    def failure(self) -> str | None:
        """Why this engine can take no more sequences (its process is gone); None while it can."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Free engine resources at server exit."""
