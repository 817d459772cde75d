"""Decode-time passes of :class:`~decode_server.reference.model.MlaMoeModel` in few PyTorch ops.

``layers.py`` and ``model.py`` say what the model computes, for clarity; they run the
reference prefill. Decoding runs the same function on 1-3 new tokens per pass over a long
cache, where their form is slow twice over: at short context every step is a few hundred
tiny ops whose dispatch costs more than their arithmetic, and at long context attention
reads the whole cache of every layer, twice. :class:`Decoder` computes the same function
from the same weights with:

* fused projections, built once: ``q_a_proj | kv_a_proj_with_mqa`` in one matrix; ``gate |
  up`` of the dense MLP; every routed expert and the shared expert of a MoE block as one
  up-projection and one down-projection (the router's weights scale each expert's
  activations before the shared down-projection, which is the same sum);
* MLA attention in the latent space with absorbed projections: ``q_nope`` goes through
  ``W_UK`` into the 512-wide latent space, and the queries of all heads and tokens attend
  over the 576-wide cache rows (latent | rope) as one matrix ``[heads * tokens, 576]``: one
  product for the scores, one for the latent output, which ``W_UV`` takes back per head.
  No per-step decompression of K/V;
* over caches longer than :data:`FLASH_MIN_LEN`, attention in chunks of
  :data:`FLASH_CHUNK` rows with an online softmax (the flash-decoding form), so the second
  product reads a chunk while it is still in the CPU cache instead of streaming the whole
  cache from memory again;
* rope from a table of ``cos + i sin`` per position as one complex product per tensor
  (GPT-J pairs are complex numbers);
* ``F.rms_norm``;
* the LM head of a pass over 2+ rows by oneDNN on a packed copy of its weight (see :class:`_Head`);
* on the CPU in float32, attention over the cache as one compiled loop
  (:mod:`~decode_server.reference.latent_kernel`) instead of the products above, where
  numba is available.

Results equal the clear model's up to float rounding (summation order), checked by
``tests/reference/test_decoder.py`` and, through the engine, against vLLM by the
equivalence tests. Caches are the engine's ``[capacity, 576]`` tensors; a pass over
positions ``start .. start + t - 1`` writes their rows and attends over rows ``0 .. start + t - 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F

from decode_server.reference import latent_kernel
from decode_server.reference.layers import MLP, DecoderBlock, MLAAttention, MoE, RMSNorm, rope_cos_sin
from decode_server.reference.model import MlaMoeModel

FLASH_MIN_LEN = 2048  # below, two products over the whole cache; measured in docs/benchmarks.md
FLASH_CHUNK = 1024  # rows per chunk: 1024 x 576 float32 = 2.3 MB, about one core's L2
SPLIT_MIN_LEN = 4096  # with a helper thread, attention over at least this many rows is split in two;
# below, handing half to the helper costs more wall time than it saves (docs/benchmarks.md)
MAX_NEW_TOKENS = 16  # tokens per pass (1 + drafts; the decode server allows up to 8 drafts)


def _t(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's ``[out, in]`` weight as a contiguous ``[in, out]`` matrix: MKL's
    products of a few rows run about twice as fast on it as on the transposed view
    ``F.linear`` passes (measured in docs/benchmarks.md)."""
    return weight.detach().t().contiguous()


@dataclass(frozen=True)
class _Norm:
    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, norm: RMSNorm) -> _Norm:
        return cls(norm.weight.detach(), norm.eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


@dataclass(frozen=True)
class _Attention:
    w_a: torch.Tensor  # [H, q_lora + 576] (q_a_proj | kv_a_proj_with_mqa), or [H, n*qk + 576] (q_proj | ...)
    q_norm: _Norm | None  # q_a_layernorm; None without q_lora
    w_qb: torch.Tensor | None  # q_b_proj [q_lora, n*qk]
    kv_norm: _Norm
    w_uk: torch.Tensor  # [n, nope, 512]: q_nope -> latent
    w_uv: torch.Tensor  # [n, 512, v]: latent -> per-head value
    w_o: torch.Tensor  # o_proj [n*v, H]

    @classmethod
    def of(cls, attn: MLAAttention) -> _Attention:
        cfg = attn.cfg
        n, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        w_kv = attn.kv_b_proj.weight.detach().view(n, nope + v, cfg.kv_lora_rank)
        kv_a = attn.kv_a_proj_with_mqa.weight.detach()
        if cfg.q_lora_rank:
            w_a = torch.cat([attn.q_a_proj.weight.detach(), kv_a])
            q_norm, w_qb = _Norm.of(attn.q_a_layernorm), _t(attn.q_b_proj.weight)
        else:
            w_a, q_norm, w_qb = torch.cat([attn.q_proj.weight.detach(), kv_a]), None, None
        return cls(_t(w_a), q_norm, w_qb, _Norm.of(attn.kv_a_layernorm), w_kv[:, :nope].contiguous(),
                   w_kv[:, nope:].transpose(1, 2).contiguous(), _t(attn.o_proj.weight))


@dataclass(frozen=True)
class _DenseMLP:
    w_gu: torch.Tensor  # [H, 2I]: gate columns, then up columns
    w_down: torch.Tensor  # [I, H]

    @classmethod
    def of(cls, mlp: MLP) -> _DenseMLP:
        return cls(_t(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])), _t(mlp.down_proj.weight))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.mm(x, self.w_gu).chunk(2, dim=-1)
        return torch.mm(F.silu(gate) * up, self.w_down)


@dataclass(frozen=True)
class _MoE:
    """Every expert at once: ``[t, H] @ [H, G]`` gates and ups (G = the routed experts'
    widths + the shared experts'), ``silu(gate) * up`` scaled per column by the weight the
    router gave that column's expert (1 for the shared expert, 0 for the unchosen ones),
    one ``[t, G] @ [G, H]`` down-projection. On a few tokens this is ~12 ops instead of a
    few per (token, expert) pair; the unchosen experts' arithmetic is cheaper than their
    dispatch."""

    module: MoE  # its router (gate) runs as it is
    w_gu: torch.Tensor  # [H, 2G]: every gate column, then every up column
    w_down: torch.Tensor  # [G, H]
    column_expert: torch.Tensor  # [G] index into the per-token weights [t, E + 1] (E = shared)
    num_experts: int
    scale: float

    @classmethod
    def of(cls, moe: MoE) -> _MoE:
        experts = [cast(MLP, e) for e in moe.experts]
        widths = [e.gate_proj.weight.shape[0] for e in experts]
        if moe.cfg.n_shared_experts:
            experts.append(moe.shared_experts)
            widths.append(moe.shared_experts.gate_proj.weight.shape[0])
        gates = [e.gate_proj.weight.detach() for e in experts]
        ups = [e.up_proj.weight.detach() for e in experts]
        column = torch.repeat_interleave(torch.arange(len(experts), device=gates[0].device),
                                         torch.tensor(widths, device=gates[0].device))
        return cls(moe, _t(torch.cat(gates + ups)), _t(torch.cat([e.down_proj.weight for e in experts], dim=1)),
                   column, len(moe.experts), moe.cfg.routed_scaling_factor)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.module.gate(x)
        per_expert = torch.zeros(x.shape[0], self.num_experts + 1, dtype=x.dtype, device=x.device)
        per_expert.scatter_(1, ids, (weights * self.scale).to(x.dtype))
        per_expert[:, self.num_experts] = 1.0  # the shared expert (column unused without one)
        gate, up = torch.mm(x, self.w_gu).chunk(2, dim=-1)
        act = F.silu(gate) * up * per_expert[:, self.column_expert]
        return torch.mm(act, self.w_down)


@dataclass(frozen=True)
class _Head:
    """The LM head ``[H, V]``. One row: MKL's product. Two or more (the pass verifying a
    draft): oneDNN's product on a copy of the weight packed once for it, whose cost hardly
    grows with the rows, where MKL's doubles from one row to two (measured in
    docs/benchmarks.md). ``packed`` is None off the CPU or where oneDNN does not agree."""

    w: torch.Tensor  # [H, V]
    packed: torch.Tensor | None  # oneDNN's layout of the [V, H] weight

    @classmethod
    def of(cls, weight: torch.Tensor) -> _Head:
        w = _t(weight)
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
            return cls(w, None)
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 2)
            probe = torch.linspace(-1.0, 1.0, 2 * w.shape[0], dtype=w.dtype).view(2, -1)
            agree = torch.allclose(_linear(probe, packed), torch.mm(probe, w), rtol=1e-4, atol=1e-5)
        except (RuntimeError, AttributeError):  # a build without these ops
            return cls(w, None)
        return cls(w, packed if agree else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.shape[0] < 2:
            return torch.mm(x, self.w)
        return _linear(x, self.packed)


def _linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` by oneDNN, ``packed`` being ``W`` reordered by ``_reorder_linear_weight``."""
    return cast(torch.Tensor, torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))


@dataclass(frozen=True)
class _Block:
    input_norm: _Norm
    attn: _Attention
    post_norm: _Norm
    mlp: _DenseMLP | _MoE

    @classmethod
    def of(cls, block: DecoderBlock) -> _Block:
        mlp = _MoE.of(block.mlp) if isinstance(block.mlp, MoE) else _DenseMLP.of(block.mlp)
        return cls(_Norm.of(block.input_layernorm), _Attention.of(block.self_attn),
                   _Norm.of(block.post_attention_layernorm), mlp)


class Decoder:
    """The main model and the MTP layer over a few new tokens at a time (see the module doc).

    Built once per model (it holds fused copies of the weights, ~1.5x the attention and MLP
    weights) and shared by every session; a pass allocates only its activations."""

    def __init__(self, model: MlaMoeModel, max_positions: int, helper: Executor | None = None,
                 kernel: bool | None = None) -> None:
        """``kernel``: attention over the cache by the compiled loop of
        :mod:`~decode_server.reference.latent_kernel` (None: where it applies, a float32
        model on the CPU, and numba loads; False: PyTorch's products; True: required)."""
        cfg = model.cfg
        self._helper = helper
        self.cfg = cfg
        self._n = cfg.num_attention_heads
        self._nope, self._rope, self._v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self._lora, self._scale = cfg.kv_lora_rank, cfg.softmax_scale
        weight = model.lm_head.weight
        self._dtype, self._device = weight.dtype, weight.device
        layers = model.model.layers
        self._main = [_Block.of(cast(DecoderBlock, layers[i])) for i in range(cfg.num_hidden_layers)]
        self._embed = model.model.embed_tokens.weight.detach()
        self._final_norm = _Norm.of(model.model.norm)
        self._lm_head = _Head.of(weight)
        self._mtp: _Block | None = None
        if cfg.num_nextn_predict_layers:
            mtp = model.mtp_layer
            self._mtp = _Block.of(mtp)
            self._enorm, self._hnorm = _Norm.of(mtp.enorm), _Norm.of(mtp.hnorm)
            self._eh_proj = _t(mtp.eh_proj.weight)
            self._head_norm = _Norm.of(mtp.shared_head.norm)
        cos, sin = rope_cos_sin(torch.arange(max_positions, device=self._device), self._rope, cfg.rope_theta)
        self._rope_table = torch.complex(cos, sin)  # [positions, rope/2]: rotation of each GPT-J pair
        causal = torch.full((MAX_NEW_TOKENS, MAX_NEW_TOKENS), float("-inf"), dtype=self._dtype, device=self._device)
        self._causal = causal.triu(1)  # [i, j]: new token i may not see new token j > i
        applies = self._device.type == "cpu" and self._dtype == torch.float32
        self._kernel = latent_kernel.load() if kernel or (kernel is None and applies) else None
        if kernel and (self._kernel is None or not applies):
            raise ValueError("kernel=True: the latent attention kernel needs numba and a float32 model on the CPU")

    @property
    def kernel(self) -> bool:
        """Whether attention over the cache runs as the compiled loop."""
        return self._kernel is not None

    @property
    def max_positions(self) -> int:
        return self._rope_table.shape[0]

    def forward_main(self, ids: torch.Tensor, start: int, caches: list[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` ``[t]`` at positions ``start..`` -> (final-normed hidden ``[t, H]``, logits ``[t, V]``)."""
        x = F.embedding(ids, self._embed)
        for block, cache in zip(self._main, caches):
            x = self._block(block, x, start, cache)
        hidden = self._final_norm(x)
        return hidden, self._lm_head(hidden)

    def forward_mtp(self, next_ids: torch.Tensor, prev_hidden: torch.Tensor, start: int, cache: torch.Tensor,
                    last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer at ``start..``: ``next_ids[i]`` is the token after position ``start + i``,
        ``prev_hidden[i]`` the main model's final-normed hidden there. Returns (MTP output
        ``[t, H]``, logits predicting the token two positions on ``[t, V]``); with
        ``last_only`` both for the last row only, which is all that is computed past the
        KV rows."""
        if self._mtp is None:
            raise ValueError("the model has no MTP layer")
        emb = F.embedding(next_ids, self._embed)
        if start == 0:
            emb = emb.clone()
            emb[0] = 0.0  # as vLLM's MTP: no embedding at position 0
        x = torch.mm(torch.cat([self._enorm(emb), self._hnorm(prev_hidden)], dim=-1), self._eh_proj)
        out = self._block(self._mtp, x, start, cache, last_only)
        return out, self._lm_head(self._head_norm(out))

    def _block(self, block: _Block, x: torch.Tensor, start: int, cache: torch.Tensor,
               last_only: bool = False) -> torch.Tensor:
        """The block over ``x`` at ``start..``: every row's KV is written; with ``last_only``
        only the last row goes on (queries, attention, MLP: nothing after attends to the
        others), and only it is returned."""
        attn = self._attention(block.attn, block.input_norm(x), start, cache, last_only)
        h = (x[-1:] if last_only else x) + attn
        return h + block.mlp(block.post_norm(h))

    def _rotate(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """GPT-J rope of ``x`` ``[..., rope]`` (a view whose pairs are adjacent) by ``table``."""
        pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
        return torch.view_as_real(pairs * table).flatten(-2)

    def _attention(self, w: _Attention, x: torch.Tensor, start: int, cache: torch.Tensor,
                   last_only: bool = False) -> torch.Tensor:
        new, n, nope, rope, lora = x.shape[0], self._n, self._nope, self._rope, self._lora
        if new > MAX_NEW_TOKENS:
            raise ValueError(f"{new} tokens in one pass: at most {MAX_NEW_TOKENS}")
        table = self._rope_table[start:start + new]
        a = torch.mm(x, w.w_a)
        q_in, c_kv, k_pe = a.split([a.shape[1] - lora - rope, lora, rope], dim=-1)
        rows = cache[start:start + new]
        rows[:, :lora] = w.kv_norm(c_kv)
        rows[:, lora:] = self._rotate(k_pe, table)
        if last_only:  # queries of the last row only: it sees every row, masks nothing
            q_in, table, t = q_in[-1:], table[-1:], 1
        else:
            t = new
        q = q_in if w.w_qb is None else torch.mm(w.q_norm(q_in), w.w_qb)  # type: ignore[misc]
        q = q.view(t, n, nope + rope)
        q_lat = torch.bmm(q[:, :, :nope].transpose(0, 1), w.w_uk)  # [n, t, 512]
        q_pe = self._rotate(q[:, :, nope:], table.unsqueeze(1)).transpose(0, 1)  # [n, t, 64]
        queries = torch.cat([q_lat, q_pe], dim=-1).view(n * t, lora + rope).mul_(self._scale)  # rows: head-major
        o_lat = self._attend(queries, cache[:start + new], t)
        o = torch.bmm(o_lat.view(n, t, lora), w.w_uv)  # [n, t, v]
        return torch.mm(o.transpose(0, 1).reshape(t, n * self._v), w.w_o)

    def _scores(self, queries: torch.Tensor, kv: torch.Tensor, t: int, masked: bool) -> torch.Tensor:
        """Scores ``[n*t, rows]`` of the (scaled) queries; ``masked``: the rows end with the
        ``t`` new ones. Fewer than 8 query rows: computed as ``kv @ queries^T`` (MKL streams
        a long cache faster that way round; measured in docs/benchmarks.md)."""
        if queries.shape[0] < 8 and kv.shape[0] > FLASH_CHUNK // 2:
            scores = torch.mm(kv, queries.t()).t()
        else:
            scores = torch.mm(queries, kv.t())
        if masked and t > 1:
            scores.unflatten(0, (self._n, t))[:, :, -t:] += self._causal[:t, :t]
        return scores

    def _attend(self, queries: torch.Tensor, kv: torch.Tensor, t: int) -> torch.Tensor:
        """Latent attention output ``[n*t, 512]`` of ``queries`` over ``kv`` (whose last ``t``
        rows are the new tokens'): two products over the whole cache when it is short, else
        chunks with an online softmax, split with the helper thread when there is one."""
        length = kv.shape[0]
        partials = self._partials if self._kernel is None else self._kernel_partials
        if self._helper is not None and length >= SPLIT_MIN_LEN:
            cut = length // 2  # the helper takes the older half, this thread the half with the new rows
            try:
                theirs: Future[list[_Partial]] | None = self._helper.submit(
                    self._partials_inference, partials, queries, kv[:cut], t, False)
            except RuntimeError:  # the engine is shutting down
                theirs = None
            mine = partials(queries, kv[cut:], t, True)
            # not started yet (the helper's core is busy elsewhere): do it here instead of waiting
            if theirs is None or theirs.cancel():
                return _merge(partials(queries, kv[:cut], t, False) + mine)
            return _merge(theirs.result() + mine)
        if self._kernel is not None:
            return _merge(partials(queries, kv, t, True))
        if length >= FLASH_MIN_LEN:
            return _merge(self._partials(queries, kv, t, True))
        probs = torch.softmax(self._scores(queries, kv, t, True), dim=-1)
        return torch.mm(probs, kv[:, :self._lora])

    def _partials_inference(self, partials: _PartialsFn, queries: torch.Tensor, kv: torch.Tensor, t: int,
                            masked: bool) -> list[_Partial]:
        with torch.inference_mode():  # thread-local: the helper thread's own
            return partials(queries, kv, t, masked)

    def _kernel_partials(self, queries: torch.Tensor, kv: torch.Tensor, t: int, masked: bool) -> list[_Partial]:
        """One partial over all of ``kv`` by the compiled loop (it releases the GIL: the
        helper thread's half runs beside this thread's)."""
        rows = queries.shape[0]
        out = torch.empty(rows, self._lora, dtype=queries.dtype)
        peak = torch.empty(rows, 1, dtype=queries.dtype)
        total = torch.empty(rows, 1, dtype=queries.dtype)
        assert self._kernel is not None
        self._kernel(queries.contiguous().numpy(), kv.contiguous().numpy(), self._lora, t if masked and t > 1 else 0,
                     out.numpy(), peak.view(-1).numpy(), total.view(-1).numpy())
        return [_Partial(out, peak, total)]

    def _partials(self, queries: torch.Tensor, kv: torch.Tensor, t: int, masked: bool) -> list[_Partial]:
        """Chunks of at most FLASH_CHUNK rows, the last one full (it holds the new rows)."""
        length = kv.shape[0]
        first = length % FLASH_CHUNK or FLASH_CHUNK
        bounds = [0, *range(first, length + 1, FLASH_CHUNK)]
        out = []
        for lo, hi in zip(bounds, bounds[1:]):
            chunk = kv[lo:hi]
            scores = self._scores(queries, chunk, t, masked and hi == length)
            peak = scores.amax(dim=-1, keepdim=True)
            probs = scores.sub_(peak).exp_()
            out.append(_Partial(torch.mm(probs, chunk[:, :self._lora]), peak, probs.sum(dim=-1, keepdim=True)))
        return out


class _Partial(NamedTuple):
    """Softmax attention over some rows, unnormalised: ``out = sum_j exp(s_j - peak) v_j``,
    ``total = sum_j exp(s_j - peak)`` (per query row)."""

    out: torch.Tensor  # [n*t, 512]
    peak: torch.Tensor  # [n*t, 1]
    total: torch.Tensor  # [n*t, 1]


_PartialsFn = Callable[[torch.Tensor, torch.Tensor, int, bool], list[_Partial]]


def _merge(parts: list[_Partial]) -> torch.Tensor:
    """The attention output over the union of the parts' rows."""
    if len(parts) == 1:
        return parts[0].out / parts[0].total
    peaks = torch.cat([p.peak for p in parts], dim=-1)  # [n*t, parts]
    rescale = peaks.sub_(peaks.amax(dim=-1, keepdim=True)).exp_()
    total = (torch.cat([p.total for p in parts], dim=-1) * rescale).sum(dim=-1, keepdim=True)
    weighted = torch.stack([p.out for p in parts]).mul_(rescale.t().unsqueeze(-1)).sum(dim=0)
    return weighted.div_(total)
