"""A grammar matcher with xgrammar's ``GrammarMatcher`` methods over a toy language, for
the engines' mask plumbing where a real tokenizer does not fit (the fake TileRT's
1000-token vocabulary): ``length`` tokens, each a multiple of ``step``, then a stop
token. Records every accept and rollback."""

from __future__ import annotations

import torch


class FakeMatcher:
    def __init__(self, vocab_size: int, length: int, step: int = 2, stop_token: int = 1) -> None:
        self.vocab_size, self.length, self.step, self.stop_token = vocab_size, length, step, stop_token
        self.accepted: list[int] = []
        self.rollbacks: list[int] = []
        self.terminated = False

    def allows(self, token: int) -> bool:
        if self.terminated:
            return False
        if len(self.accepted) == self.length:
            return token == self.stop_token
        return token % self.step == 0

    def accept_token(self, token_id: int) -> bool:
        if not self.allows(token_id):
            return False
        self.accepted.append(token_id)
        self.terminated = len(self.accepted) > self.length
        return True

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        row = torch.zeros(bitmask.shape[1] * 32, dtype=torch.int64)
        for t in range(self.vocab_size):
            row[t] = int(self.allows(t))
        words = (row.view(-1, 32) << torch.arange(32)).sum(-1)
        bitmask[index] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    def rollback(self, num_tokens: int = 1) -> None:
        self.rollbacks.append(num_tokens)
        del self.accepted[len(self.accepted) - num_tokens:]
        self.terminated = len(self.accepted) > self.length

    def is_terminated(self) -> bool:
        return self.terminated
