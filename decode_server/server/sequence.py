"""From generated token ids to OpenAI text deltas: stop conditions, detokenization,
stop strings and logprobs of one sequence. Pure and synchronous; its token-level half runs on
the slot's worker thread between engine steps, its text half on the event loop beside the
next step (:class:`SequenceProcessor`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decode_server.engine.base import TokenOut
from decode_server.server.stops import StopStringMatcher
from decode_server.server.text import IncrementalDetokenizer, TextTokenizer

MIN_LOGPROB = -9999.0  # what OpenAI (and vLLM) send for -inf; JSON has no infinities


@dataclass(frozen=True)
class StopSpec:
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    keep_special: frozenset[str] = frozenset()  # with skip_special_tokens: special tokens written all the same


@dataclass(frozen=True)
class TokenLogprob:
    """One position's logprobs, by token text (as both OpenAI shapes report them)."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()


@dataclass
class Delta:
    """What one engine step adds to the sequence."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop token id or stop string


@dataclass(frozen=True)
class Cut:
    """The tokens of one engine step that belong to the sequence, as its token-level stop
    conditions see them (:meth:`SequenceProcessor.cut`): those after an EOS or stop token, or
    past ``max_tokens``, dropped; ``finish_reason`` "stop" (the last token is the EOS or stop
    token: it adds no text) or "length"."""

    tokens: list[TokenOut]
    finish_reason: str | None = None
    stop_reason: int | None = None


class SequenceProcessor:
    """In two halves, so that the engine's next step never waits for the text: :meth:`cut` (the
    token-level stop conditions: EOS, stop tokens, ``max_tokens``; microseconds) on the slot's
    worker thread between steps, and :meth:`text` (detokenization, stop strings, logprobs) on
    the event loop beside the next step. A stop string found by :meth:`text` ends the sequence
    there; tokens of a step the engine ran meanwhile are dropped. :meth:`feed` runs both."""

    def __init__(self, tokenizer: TextTokenizer, spec: StopSpec, context_ids: list[int],
                 logprobs: int | None = None, tokens_as_ids: bool = False) -> None:
        self._tok = tokenizer
        self._spec = spec
        self._detok = IncrementalDetokenizer(tokenizer, context_ids, spec.skip_special_tokens, spec.keep_special)
        self._stops = StopStringMatcher(spec.stop_strings, spec.include_stop_str_in_output)
        self._logprobs = logprobs
        self._tokens_as_ids = tokens_as_ids
        self.num_cut = 0  # tokens :meth:`cut` passed (the worker's count)
        self.cut_finished = False
        self.num_generated = 0  # tokens :meth:`text` took (the answer's)
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_label(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._tokens_as_ids else self._tok.token_text(token_id)

    def cut(self, tokens: list[TokenOut]) -> Cut:
        """The token-level stop conditions over one step's tokens, in order."""
        spec = self._spec
        kept: list[TokenOut] = []
        for tok in tokens:
            if self.cut_finished:
                break
            self.num_cut += 1
            kept.append(tok)
            may_stop = self.num_cut >= spec.min_tokens
            if may_stop and not spec.ignore_eos and tok.token_id in spec.eos_token_ids:
                self.cut_finished = True
                return Cut(kept, "stop")
            if may_stop and tok.token_id in spec.stop_token_ids:
                self.cut_finished = True
                return Cut(kept, "stop", tok.token_id)
            if self.num_cut >= spec.max_tokens:
                self.cut_finished = True
                return Cut(kept, "length")
        return Cut(kept)

    def text(self, cut: Cut, first_logprob: TokenLogprob | None = None) -> Delta:
        """A step's :class:`Cut` as the answer's delta; empty once the sequence ended.

        ``first_logprob`` replaces the logprobs of the first token (from prefill)."""
        delta = Delta(logprobs=[] if self._logprobs is not None else None)
        if self.finished:
            return delta
        parts: list[str] = []
        last = len(cut.tokens) - 1
        for i, tok in enumerate(cut.tokens):
            self.num_generated += 1
            delta.token_ids.append(tok.token_id)
            if delta.logprobs is not None:
                delta.logprobs.append(first_logprob if (i == 0 and first_logprob) else self._logprob_of(tok))
            if i == last and cut.finish_reason == "stop":  # the EOS or stop token: no text
                self._finish(delta, parts, "stop", cut.stop_reason)
                break
            parts.append(self._stops.feed(self._detok.feed(tok.token_id)))
            if self._stops.matched is not None:
                self._finish(delta, parts, "stop", self._stops.matched)
                break
        else:
            if cut.finish_reason == "length":
                parts.append(self._stops.feed(self._detok.flush()))
                self._finish(delta, parts, "length", None)
            elif cut.finish_reason == "stop" and not cut.tokens:
                self._finish(delta, parts, "stop", cut.stop_reason)
        delta.text = "".join(parts)
        return delta

    def feed(self, tokens: list[TokenOut], first_logprob: TokenLogprob | None = None) -> Delta:
        """Both halves at once: the tokens in order until the sequence finishes; later ones are dropped."""
        return self.text(self.cut(tokens), first_logprob)

    def _finish(self, delta: Delta, parts: list[str], reason: str, stop_reason: int | str | None) -> None:
        parts.append(self._stops.flush())
        self.finish_reason = delta.finish_reason = reason
        delta.stop_reason = stop_reason

    def _logprob_of(self, tok: TokenOut) -> TokenLogprob:
        top = tok.top_logprobs or ()
        k = self._logprobs or 0
        return TokenLogprob(
            token=self.token_label(tok.token_id),
            logprob=None if tok.logprob is None else max(tok.logprob, MIN_LOGPROB),
            top=tuple((self.token_label(t), max(lp, MIN_LOGPROB)) for t, lp in top[:k]),
        )
