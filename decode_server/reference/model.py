"""The whole model: N main decoder layers plus the MTP (next-n) layer at index N.

MTP semantics follow vLLM's GLM-4-Lite / DeepSeek MTP drafter:

* the MTP layer uses the main model's ``embed_tokens`` and ``lm_head`` (the tiny-model
  generator writes identical copies under the MTP prefix anyway);
* its input at position ``i`` is ``eh_proj(cat[enorm(embed(token[i+1])), hnorm(h[i])])``
  where ``h[i]`` is the main model's *final-normed* hidden state at ``i``, and the
  embedding is zeroed at position 0;
* its output is ``block(...)`` (residual included, no final norm); its logits are
  ``lm_head(shared_head.norm(output))`` and predict ``token[i+2]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from decode_server.reference.config import ModelConfig
from decode_server.reference.layers import DecoderBlock, RMSNorm, rope_cos_sin

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class MTPLayer(DecoderBlock):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers: list[nn.Module] = [DecoderBlock(cfg, i) for i in range(n)]
        layers += [MTPLayer(cfg, n + j) for j in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MlaMoeModel(nn.Module):
    """Main model + MTP layer(s). ``caches[i]`` is layer ``i``'s ``[B, S, 576]`` MLA cache
    (main layers first, then MTP layers), exactly vLLM's per-token cache rows."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def num_main_layers(self) -> int:
        return self.cfg.num_hidden_layers

    @property
    def num_layers(self) -> int:
        return self.cfg.num_hidden_layers + self.cfg.num_nextn_predict_layers

    @property
    def mtp_layer(self) -> MTPLayer:
        layer = self.model.layers[self.cfg.num_hidden_layers]
        assert isinstance(layer, MTPLayer)
        return layer

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.cfg.qk_rope_head_dim, self.cfg.rope_theta)

    def forward_main(self, ids: torch.Tensor, positions: torch.Tensor,
                     caches: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` ``[B, T]`` at ``positions`` -> (final-normed hidden ``[B, T, H]``, logits)."""
        cos, sin = self._rope(positions)
        x = self.model.embed_tokens(ids)
        for i in range(self.cfg.num_hidden_layers):
            x = self.model.layers[i](x, positions, cos, sin, None if caches is None else caches[i])
        hidden = self.model.norm(x)
        return hidden, self.lm_head(hidden)

    def forward_mtp(self, next_ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                    cache: torch.Tensor | None = None, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP at ``positions``: ``next_ids[i]`` is the token at ``positions[i] + 1`` and
        ``prev_hidden[i]`` the main (or previous MTP) hidden at ``positions[i]``.
        Returns (MTP output hidden, logits predicting the token at ``positions + 2``;
        only for the last position with ``last_only``)."""
        layer = self.mtp_layer
        cos, sin = self._rope(positions)
        emb = self.model.embed_tokens(next_ids)
        emb = emb.masked_fill((positions == 0).view(1, -1, 1), 0.0)
        x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(prev_hidden)], dim=-1))
        out = DecoderBlock.forward(layer, x, positions, cos, sin, cache)
        return out, self.lm_head(layer.shared_head.norm(out[:, -1:] if last_only else out))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensors; the MTP layer's embedding and head are the main ones."""
        state = {k: v.detach().clone().contiguous() for k, v in self.state_dict().items()}
        prefix = f"model.layers.{self.cfg.num_hidden_layers}."
        state[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        state[prefix + "shared_head.head.weight"] = state["lm_head.weight"].clone()
        return state


def load_model(model_dir: Path | str, dtype: str = "float32", device: str = "cpu") -> MlaMoeModel:
    """Load config.json + *.safetensors from ``model_dir`` (what vLLM loads), computing in
    ``dtype`` (float32 by default: bf16 weights upcast exactly) on ``device``."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    with torch.device("meta"):
        model = MlaMoeModel(cfg)
    model = model.to_empty(device=device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: checkpoint does not match config.json: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    return model.to(torch_dtype).eval().requires_grad_(False)
