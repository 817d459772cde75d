"""The reference engine computing its own prefill, laid out exactly as vLLM caches it.

With MTP on, vLLM's prefill step runs the main model over the prompt ``t[0..T-1]``, samples
the first token ``t[T]`` and then runs the MTP drafter over the same positions with the
token ids shifted left by one: at position ``i`` the MTP layer sees ``t[i+1]`` (for
``i = T-1`` that is the first sampled token) and the main model's final-normed hidden
``h[i]``; its input embedding is zeroed at position 0. The MTP layer's KV rows
``0..T-1`` are therefore a function of the prompt *and* the first token, and the last
MTP output (position ``T-1``) drafts ``t[T+1]``. Those rows are what the connector ships
as layer ``N``; a decoder continues at position ``T`` with ``t[T]`` as its input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from decode_server.reference.model import MlaMoeModel


class PrefillOutput(NamedTuple):
    kv: list[torch.Tensor]  # N+1 tensors [T, 576] (main layers, then MTP), the model dtype
    logits: torch.Tensor  # [vocab] float32, logits of the first generated token


def prefill(model: MlaMoeModel, token_ids: Sequence[int], first_token_id: int | None = None) -> PrefillOutput:
    """Prefill ``token_ids`` from scratch. ``first_token_id`` (default: the greedy token)
    is the token prefill sampled; it enters the MTP layer's KV at position ``T-1``."""
    if not token_ids:
        raise ValueError("prefill needs at least one prompt token")
    device = model.lm_head.weight.device
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    t = ids.shape[1]
    positions = torch.arange(t, device=device)
    dtype = model.lm_head.weight.dtype
    caches = [torch.zeros(1, t, model.cfg.kv_width, dtype=dtype, device=device) for _ in range(model.num_layers)]
    with torch.inference_mode():
        hidden, logits = model.forward_main(ids, positions, caches)
        last = logits[0, -1].float()
        first = int(last.argmax()) if first_token_id is None else int(first_token_id)
        if model.cfg.num_nextn_predict_layers:
            shifted = torch.cat([ids[:, 1:], torch.tensor([[first]], device=device)], dim=1)
            model.forward_mtp(shifted, hidden, positions, caches[model.num_main_layers])
    return PrefillOutput([c[0] for c in caches], last)
