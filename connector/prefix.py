"""A prompt's prefix as the KV channel compares it: chained hashes of its token ids in blocks
of :data:`PREFIX_BLOCK_TOKENS`.

The sender (vLLM's scheduler side) puts the hashes of every full block of a prompt in its
``Admit`` (``Admit.prefix``) with the ids past the last full block (``Admit.tail``); the decode
server compares them with the hashes of the sequence it keeps in the slot (its prompt and its
answer, :mod:`decode_server.server.slots`) and answers how many leading tokens it keeps
(``Admitted.reused``, a whole number of blocks), so the sender writes only the KV past them.

Block ``i``'s hash is BLAKE2b-128 of block ``i - 1``'s hash and the block's ids (8 bytes each,
little-endian): equal hashes at block ``i`` mean equal ids up to its end (to a collision of a
128-bit hash, as vLLM's own prefix cache settles it). A block is 64 tokens: a multiple of
vLLM's block sizes (16 on the CPU, 64 for GLM-5.1 on CUDA) and the indexer's page, so a skip
of whole blocks is a skip of whole pages of every plane.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

PREFIX_BLOCK_TOKENS = 64
# what an Admit offers of a prompt: its block hashes and the ids past them
Prefix = tuple[Sequence[str], Sequence[int]]
NO_PREFIX: Prefix = ((), ())


def _block(previous: bytes, ids: Sequence[int]) -> bytes:
    data = array("q", ids)
    if data.itemsize != 8:  # pragma: no cover - every platform we run has 8-byte long long
        raise RuntimeError("array('q') is not 8 bytes here")
    return hashlib.blake2b(previous + data.tobytes(), digest_size=16).digest()


def block_hashes(token_ids: Sequence[int], after: str | None = None) -> list[str]:
    """The hashes of the full blocks of ``token_ids`` (a trailing partial block has none), the
    first chained to ``after`` (the hash of the block before them; None: they start the
    sequence)."""
    previous = bytes.fromhex(after) if after else b""
    out: list[str] = []
    for start in range(0, len(token_ids) - PREFIX_BLOCK_TOKENS + 1, PREFIX_BLOCK_TOKENS):
        previous = _block(previous, token_ids[start:start + PREFIX_BLOCK_TOKENS])
        out.append(previous.hex())
    return out


def split_prompt(token_ids: Sequence[int]) -> Prefix:
    """``(hashes of the full blocks, the ids past them)``: what an ``Admit`` carries."""
    hashes = block_hashes(token_ids)
    return hashes, list(token_ids[len(hashes) * PREFIX_BLOCK_TOKENS:])


def first_written(reused: int, mtp_layer: bool) -> int:
    """The first token whose KV a handoff reusing ``reused`` tokens writes in a layer. An MTP
    layer's row ``p`` is computed from token ``p + 1``, which may differ between the kept
    sequence and the new prompt at the first token past the match: its rows are written from
    one block earlier (a whole page of a paged plane)."""
    return max(0, reused - PREFIX_BLOCK_TOKENS) if mtp_layer and reused else reused


def matched_tokens(offered: Sequence[str], kept: Sequence[str], kept_tokens: int, num_tokens: int) -> int:
    """The leading tokens of a prompt (``num_tokens`` long, its block hashes ``offered``) that a
    kept sequence (``kept_tokens`` long, its block hashes ``kept``) holds: whole blocks whose
    hashes agree, within the kept length, and at least one token short of the prompt (its last
    token's KV always comes with the handoff)."""
    blocks = 0
    for mine, theirs in zip(offered, kept):
        if mine != theirs:
            break
        blocks += 1
    limit = min(kept_tokens, num_tokens - 1) // PREFIX_BLOCK_TOKENS
    return min(blocks, limit) * PREFIX_BLOCK_TOKENS
