"""Brief deterministic training of the main model and its MTP layer on the local corpus,
so logits have real margins and MTP drafts are often right."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decode_server.reference.model import MlaMoeModel


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 200
    batch: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.01
    mtp_loss_weight: float = 1.0


def init_weights(model: MlaMoeModel, gen: torch.Generator, std: float = 0.02) -> None:
    """Normal(0, std) for matrices, ones for norms, a small fixed spread for the routing bias."""
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.01, 0.01, b.numel()))


def _batch(stream: torch.Tensor, settings: TrainSettings, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - settings.seq_len - 1, (settings.batch,), generator=gen)
    return torch.stack([stream[s:s + settings.seq_len + 1] for s in starts.tolist()])


def train(model: MlaMoeModel, stream: torch.Tensor, settings: TrainSettings, gen: torch.Generator,
          log: Callable[[str], None] = lambda _: None) -> dict[str, float]:
    """Next-token loss for the main model plus next-next-token loss for the MTP layer
    (fed the main model's detached final-normed hidden, as vLLM feeds it at inference)."""
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay,
                            betas=(0.9, 0.95))
    model.train()
    t0 = time.monotonic()
    positions = torch.arange(settings.seq_len)
    main_loss = mtp_loss = float("nan")
    for step in range(settings.steps):
        lr = settings.lr * min(1.0, (step + 1) / settings.warmup)
        lr *= 0.5 * (1 + math.cos(math.pi * step / settings.steps)) * 0.9 + 0.1
        for group in opt.param_groups:
            group["lr"] = lr
        seq = _batch(stream, settings, gen)
        inputs, targets = seq[:, :-1], seq[:, 1:]
        hidden, logits = model.forward_main(inputs, positions)
        loss_main = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        # MTP at position i: token i+1 and hidden i -> token i+2 (last position has no target).
        _, mtp_logits = model.forward_mtp(targets, hidden.detach(), positions)
        loss_mtp = F.cross_entropy(mtp_logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())
        loss = loss_main + settings.mtp_loss_weight * loss_mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        main_loss, mtp_loss = loss_main.item(), loss_mtp.item()
        if step % 40 == 0 or step == settings.steps - 1:
            log(f"step {step:4d} loss {main_loss:.3f} mtp {mtp_loss:.3f} ({time.monotonic() - t0:.0f} s)")
    model.eval()
    return {"loss": main_loss, "mtp_loss": mtp_loss, "seconds": time.monotonic() - t0}
