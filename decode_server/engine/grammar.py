"""Grammar-constrained decoding in the engines: the per-request matcher (an
``xgrammar.GrammarMatcher``, compiled by :mod:`decode_server.engine.structured`) and the token
bitmasks of one verify step.

A step verifies ``[pending, d1..dk]`` (``k`` MTP drafts): row 0 of its masks is the
grammar's state after every emitted token; row ``i`` the state after the drafts
``d1..di`` too, when the grammar accepts them (each draft is accepted tentatively to
fill the next row, then the matcher rolls back). Row ``i``'s token is chosen from the
masked logits, so a draft the grammar rejects is never chosen there: it is rejected,
and only speed is lost. Rows past a draft the grammar rejects repeat the last valid
mask (their tokens are discarded anyway). The matcher then advances with exactly the
emitted tokens (:meth:`Constraint.accept`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from decode_server.engine.base import EngineError


class GrammarMatcher(Protocol):
    """What the engines use of ``xgrammar.GrammarMatcher``."""

    def accept_token(self, token_id: int) -> bool: ...

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> Any: ...

    def rollback(self, num_tokens: int = 1) -> None: ...

    def is_terminated(self) -> bool: ...


class AfterReasoning:
    """A matcher that holds once the model's reasoning ended, as vLLM's structured output with a
    reasoning parser: tokens before are free (their mask rows allow every token); an
    ``explicit`` end token (``</think>``) starts the grammar after it, an ``implicit`` one
    (``<tool_call>``, which ends the reasoning and begins a call) is the grammar's first token.
    It rolls back any number of tokens, as the matcher it wraps."""

    def __init__(self, inner: GrammarMatcher, explicit: frozenset[int], implicit: frozenset[int]) -> None:
        self.inner = inner
        self._explicit, self._implicit = explicit, implicit
        self._waiting = True
        self._implicit_start = False
        self._before = 0  # tokens accepted while waiting (an explicit end token included)
        self._inner = 0  # tokens the wrapped matcher accepted

    @property
    def waiting(self) -> bool:
        return self._waiting

    def accept_token(self, token_id: int) -> bool:
        if not self._waiting:
            ok = self.inner.accept_token(token_id)
            self._inner += ok
            return ok
        if token_id in self._implicit:
            if not self.inner.accept_token(token_id):
                return False
            self._waiting, self._implicit_start = False, True
            self._inner += 1
            return True
        self._before += 1
        if token_id in self._explicit:
            self._waiting, self._implicit_start = False, False
        return True

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> Any:
        if self._waiting:
            bitmask[index] = -1
            return None
        return self.inner.fill_next_token_bitmask(bitmask, index)

    def rollback(self, num_tokens: int = 1) -> None:
        inner = min(num_tokens, self._inner)
        if inner:
            self.inner.rollback(inner)
            self._inner -= inner
            if self._implicit_start and self._inner == 0:
                self._waiting = True  # the <tool_call> that ended the reasoning is undone
        rest = num_tokens - inner
        if rest > self._before:
            raise EngineError(f"rollback of {num_tokens} tokens past the grammar's start")
        if rest and not self._waiting:
            self._waiting = True  # the </think> is undone
        self._before -= rest

    def is_terminated(self) -> bool:
        return not self._waiting and self.inner.is_terminated()


@dataclass(frozen=True)
class ThinkingBudgetSpec:
    """A request's thinking budget on its way to its matcher (:class:`ThinkingBudget`): the
    reasoning tokens allowed, and the prompt's last token (the reasoning is open from the start
    when it is the reasoning's start token)."""

    tokens: int
    last_prompt_token_id: int


class ThinkingBudget:
    """vLLM's ``thinking_token_budget``: once the model's reasoning holds ``budget`` tokens, its
    end token (``</think>``) is the only one allowed. The reasoning is open from the start when
    the prompt ends with its start token (``reasoning_open``), or from a start token the model
    emits; its tokens are those after the start token. Wraps the request's grammar matcher, if
    any (``inner``: its mask, then this one's; terminated when it is), else never terminates: a
    reasoning block the model opens again gets the budget again, as in vLLM. Rolls back any
    number of tokens."""

    def __init__(self, inner: GrammarMatcher | None, budget: int, start: int, end: int,
                 reasoning_open: bool) -> None:
        self.inner = inner
        self._budget, self._start, self._end = budget, start, end
        self._state = (reasoning_open, 0)  # (in a reasoning block, its tokens so far)
        self._before: list[tuple[bool, int]] = []  # the state before each accepted token

    @property
    def forcing(self) -> bool:
        open_, tokens = self._state
        return open_ and tokens >= self._budget

    def accept_token(self, token_id: int) -> bool:
        if self.forcing and token_id != self._end:
            return False
        if self.inner is not None and not self.inner.accept_token(token_id):
            return False
        self._before.append(self._state)
        open_, tokens = self._state
        if open_:
            self._state = (False, 0) if token_id == self._end else (True, tokens + 1)
        elif token_id == self._start:
            self._state = (True, 0)
        return True

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> Any:
        if self.forcing:  # the end token alone, as vLLM forces it whatever else would be allowed
            bitmask[index] = 0
            word, bit = divmod(self._end, 32)
            bitmask[index, word] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32 bits
            return None
        if self.inner is None:
            bitmask[index] = -1
            return None
        return self.inner.fill_next_token_bitmask(bitmask, index)

    def rollback(self, num_tokens: int = 1) -> None:
        if num_tokens > len(self._before):
            raise EngineError(f"rollback of {num_tokens} tokens past the budget's start")
        if self.inner is not None:
            self.inner.rollback(num_tokens)
        for _ in range(num_tokens):
            self._state = self._before.pop()

    def is_terminated(self) -> bool:
        return self.inner is not None and self.inner.is_terminated()


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row (xgrammar's layout: bit ``t % 32`` of word ``t // 32``)."""
    return (vocab_size + 31) // 32


class Constraint:
    """One request's matcher and the bitmask rows of its steps (``rows`` = 1 + drafts)."""

    def __init__(self, matcher: GrammarMatcher, vocab_size: int, rows: int, device: Any = "cpu") -> None:
        import torch

        self.matcher = matcher
        self.vocab_size = vocab_size
        self.masks = torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)
        self._device = device

    @property
    def active(self) -> bool:
        """False once the grammar is complete (then nothing is masked: only stop tokens
        were allowed, and the server stops at one)."""
        return not self.matcher.is_terminated()

    def accept_first(self, token_id: int) -> None:
        """Prefill's first token: it must follow the grammar (vLLM sampled it under the
        same one), else the request fails."""
        if not self.matcher.accept_token(int(token_id)):
            raise EngineError(f"the first token {token_id} (sampled by prefill) does not follow the request's "
                              "grammar: prefill did not get the same response_format / tool_choice")

    def accept(self, token_id: int) -> None:
        """An emitted token; after the grammar completed, tokens are not checked."""
        if self.active and not self.matcher.accept_token(int(token_id)):
            raise EngineError(f"token {token_id} was emitted against the request's grammar")

    def step_masks(self, drafts: list[int]) -> Any:
        """Rows ``0..len(drafts)`` of the masks for verifying ``[pending, *drafts]`` (see the
        module doc); the matcher is left where it was."""
        rows = 1 + len(drafts)
        if rows > self.masks.shape[0]:
            raise EngineError(f"{len(drafts)} drafts: the grammar's masks hold {self.masks.shape[0] - 1}")
        self.matcher.fill_next_token_bitmask(self.masks, 0)
        advanced = 0
        for i, draft in enumerate(drafts, start=1):
            if advanced == i - 1 and not self.matcher.is_terminated() and self.matcher.accept_token(int(draft)):
                advanced += 1
                if self.matcher.is_terminated():
                    self.masks[i] = -1  # complete: the engine's stop conditions take over
                else:
                    self.matcher.fill_next_token_bitmask(self.masks, i)
            else:
                self.masks[i] = self.masks[i - 1]
        if advanced:
            self.matcher.rollback(advanced)
        return self.masks[:rows]

    def allowed(self, mask_row: Any) -> Any:
        """A bool tensor ``[vocab_size]``: which tokens ``mask_row`` allows."""
        import torch

        bits = torch.arange(32, dtype=torch.int32)
        expanded = (mask_row.unsqueeze(-1) >> bits) & 1
        return expanded.flatten()[: self.vocab_size].bool()

    def constrain(self, logits: Any, mask_row: Any) -> Any:
        """``logits`` ``[vocab]`` with the disallowed tokens at -inf (a new tensor)."""
        allowed = self.allowed(mask_row).to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))
