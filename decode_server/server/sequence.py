"""From generated token ids to OpenAI text deltas: stop conditions, detokenization,
stop strings and logprobs of one sequence. Pure and synchronous: it runs on the
slot's worker thread, next to the engine, so the event loop only formats bytes.
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


class SequenceProcessor:
    def __init__(self, tokenizer: TextTokenizer, spec: StopSpec, context_ids: list[int],
                 logprobs: int | None = None, tokens_as_ids: bool = False) -> None:
        self._tok = tokenizer
        self._spec = spec
        self._detok = IncrementalDetokenizer(tokenizer, context_ids, spec.skip_special_tokens, spec.keep_special)
        self._stops = StopStringMatcher(spec.stop_strings, spec.include_stop_str_in_output)
        self._logprobs = logprobs
        self._tokens_as_ids = tokens_as_ids
        self.num_generated = 0
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_label(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._tokens_as_ids else self._tok.token_text(token_id)

    def feed(self, tokens: list[TokenOut], first_logprob: TokenLogprob | None = None) -> Delta:
        """Consume tokens in order until the sequence finishes; later ones are dropped.

        ``first_logprob`` replaces the logprobs of the first token (from prefill)."""
        delta = Delta(logprobs=[] if self._logprobs is not None else None)
        parts: list[str] = []
        for i, tok in enumerate(tokens):
            if self.finished:
                break
            self.num_generated += 1
            delta.token_ids.append(tok.token_id)
            if delta.logprobs is not None:
                delta.logprobs.append(first_logprob if (i == 0 and first_logprob) else self._logprob_of(tok))
            self._advance(tok.token_id, delta, parts)
        delta.text = "".join(parts)
        return delta

    def _advance(self, token_id: int, delta: Delta, parts: list[str]) -> None:
        spec = self._spec
        may_stop = self.num_generated >= spec.min_tokens
        if may_stop and not spec.ignore_eos and token_id in spec.eos_token_ids:
            self._finish(delta, parts, "stop", None)
            return
        if may_stop and token_id in spec.stop_token_ids:
            self._finish(delta, parts, "stop", token_id)
            return
        parts.append(self._stops.feed(self._detok.feed(token_id)))
        if self._stops.matched is not None:
            self._finish(delta, parts, "stop", self._stops.matched)
        elif self.num_generated >= spec.max_tokens:
            parts.append(self._stops.feed(self._detok.flush()))
            self._finish(delta, parts, "length", None)

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
