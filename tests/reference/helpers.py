"""Shared helpers of the reference-engine tests: prefill -> handoff -> engine session."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from connector.receiver import ReceivedKV
from decode_server.engine.base import SamplingParams, TokenOut
from decode_server.engine.reference import ReferenceEngine
from decode_server.reference import MlaMoeModel, prefill
from pd_wire.handoff import HandoffResult
from tests.equivalence import Step


def handoff_for(prompt_ids: Sequence[int], first_token_id: int, handoff_id: str = "h") -> HandoffResult:
    return HandoffResult(handoff_id=handoff_id, kv_endpoint="127.0.0.1:1", num_prompt_tokens=len(prompt_ids),
                         first_token_id=first_token_id, last_prompt_token_id=prompt_ids[-1], status="sent")


def received(handoff_id: str, kv: Sequence[torch.Tensor]) -> ReceivedKV:
    return ReceivedKV(handoff_id, kv[0].shape[0], [{"kv": t} for t in kv])


def prefilled(model: MlaMoeModel, prompt_ids: Sequence[int]) -> tuple[ReceivedKV, HandoffResult, list[torch.Tensor]]:
    """The reference prefill of ``prompt_ids`` as the decode side receives it (greedy first token)."""
    out = prefill(model, prompt_ids)
    return received("h", out.kv), handoff_for(prompt_ids, int(out.logits.argmax())), out.kv


def first_token(logits: torch.Tensor, params: SamplingParams) -> TokenOut:
    logp = logits.float().log_softmax(-1)
    tok = int(logits.argmax())
    k = params.logprobs or 0
    values, ids = logp.topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
    return TokenOut(tok, float(logp[tok]), tuple(zip(ids.tolist(), values.tolist())))


def generate_greedy(engine: ReferenceEngine, model: MlaMoeModel, prompt_ids: Sequence[int], n: int,
                    logprobs: int = 5, corrupt_layer: int | None = None) -> tuple[list[TokenOut], object]:
    """Prefill with the reference model, then decode through the engine: ``n`` tokens in all
    (the first from prefill's logits, as the server emits it). Returns (tokens, stats)."""
    params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=logprobs)
    out = prefill(model, prompt_ids)
    kv = [t.clone() for t in out.kv]
    if corrupt_layer is not None:
        gen = torch.Generator().manual_seed(1234)
        kv[corrupt_layer] = torch.randn(kv[corrupt_layer].shape, generator=gen) * kv[corrupt_layer].std()
    first = first_token(out.logits, params)
    session = engine.start(received("h", kv), handoff_for(prompt_ids, first.token_id), params)
    tokens = [first]
    try:
        while len(tokens) < n:
            tokens += session.step()
    finally:
        session.close()
    return tokens[:n], session.stats


def as_steps(tokens: Sequence[TokenOut]) -> list[Step]:
    """Engine tokens in the judge's form, tokens named like vLLM's ``token_id:N``."""
    return [Step(f"token_id:{t.token_id}", float(t.logprob or 0.0),
                 {f"token_id:{i}": lp for i, lp in (t.top_logprobs or ())}) for t in tokens]
