"""Building blocks of a GLM-4.x-Lite / DeepSeek-V3 style decoder, written for clarity.

Parameter names follow the Hugging Face checkpoint, so ``state_dict()`` keys are the
safetensors keys vLLM loads. Shapes: ``x`` is ``[B, T, hidden]``; ``positions`` is a
1-D LongTensor of ``T`` consecutive positions shared by the batch.

MLA cache convention (what vLLM's CPU MLA backend stores per token and layer, see
``CPUMLAImpl.do_kv_cache_update``): ``[kv_a_layernorm(c_kv) (512) | rope(k_pe) (64)]``,
where ``[c_kv | k_pe] = kv_a_proj_with_mqa(h)`` and the rope is GPT-J style (adjacent
pairs rotated, vLLM's ``is_neox_style=False``). Attention is computed in the
weight-absorbed form over that latent cache, which is how vLLM decodes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decode_server.reference.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=positions.device) / dim))
    freqs = positions.to(torch.float).unsqueeze(-1) * inv_freq  # [T, dim/2]
    return freqs.cos(), freqs.sin()


def apply_rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]); ``x`` is ``[..., T, (H,) dim]``."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, n = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, n * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, n * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_width, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * cfg.v_head_dim, h, bias=False)

    def latent_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The cache entries of ``x``: ``[B, T, 576]`` (normed latent, then rope'd k_pe)."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], -1)
        return torch.cat([self.kv_a_layernorm(c_kv), apply_rope_gptj(k_pe, cos, sin)], dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of ``x`` at ``positions`` over the cache.

        ``cache``: ``[B, S, 576]`` with ``S > positions[-1]``; this call writes the new
        entries at ``positions`` and reads ``cache[:, :positions[-1] + 1]``. Without a
        cache the sequence attends only to itself (positions must start at 0).
        """
        cfg = self.cfg
        bsz, t, _ = x.shape
        n, nope, rope, v_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        new_kv = self.latent_kv(x, cos, sin)
        if cache is None:
            kv = new_kv
        else:
            start = int(positions[0])
            cache[:, start:start + t] = new_kv.to(cache.dtype)
            kv = cache[:, :start + t].to(x.dtype)
        latent, k_pe = kv.split([cfg.kv_lora_rank, rope], dim=-1)

        if cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(bsz, t, n, cfg.qk_head_dim)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        q_pe = apply_rope_gptj(q_pe, cos.unsqueeze(-2), sin.unsqueeze(-2))

        w_kv = self.kv_b_proj.weight.view(n, nope + v_dim, cfg.kv_lora_rank)
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
        q_lat = torch.einsum("bthd,hdc->bhtc", q_nope, w_uk)  # query absorbed into latent space
        scores = torch.einsum("bhtc,bsc->bhts", q_lat, latent)
        scores = scores + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
        scores = scores.float() * cfg.softmax_scale
        key_pos = torch.arange(kv.shape[1], device=kv.device)
        mask = key_pos.unsqueeze(0) > positions.unsqueeze(1)  # [T, S]: future keys
        probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1).to(x.dtype)
        o_lat = torch.einsum("bhts,bsc->bthc", probs, latent)
        out = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(bsz, t, n * v_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid scores; selection on scores + e_score_correction_bias (noaux_tc)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[N, hidden]`` -> (topk weights ``[N, k]``, topk expert ids ``[N, k]``)."""
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if cfg.n_group > 1:
            grouped = choice.view(x.shape[0], cfg.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(cfg.topk_group, -1).indices, 1)
            choice = grouped.masked_fill(keep.unsqueeze(-1) == 0, float("-inf")).view(x.shape[0], -1)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids


class MoE(nn.Module):
    FEW_TOKENS = 4

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.n_routed_experts))
        if cfg.n_shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat)
        if flat.shape[0] <= self.FEW_TOKENS:  # decode: per token, fewer (dispatch-bound) ops
            routed = torch.cat([
                sum(self.experts[e](flat[t:t + 1]) * w for e, w in zip(chosen, ws))
                for t, (chosen, ws) in enumerate(zip(ids.tolist(), weights.tolist()))])
        else:
            routed = torch.zeros_like(flat)
            for e in torch.unique(ids).tolist():  # only the experts some token chose
                rows, slot = (ids == e).nonzero(as_tuple=True)
                contrib = self.experts[e](flat[rows]) * weights[rows, slot].unsqueeze(-1).to(flat.dtype)
                routed = routed.index_add(0, rows, contrib)
        out = routed * self.cfg.routed_scaling_factor
        if self.cfg.n_shared_experts:
            out = out + self.shared_experts(flat)
        return out.view(shape)


class DecoderBlock(nn.Module):
    """Attention + (dense MLP or MoE), pre-norm, residual adds."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), positions, cos, sin, cache)
        return h + self.mlp(self.post_attention_layernorm(h))
