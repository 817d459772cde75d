"""``POST /tokenize`` and ``POST /detokenize``: vLLM's own routes, served by a prefill server.

The request and the answer are vLLM's shapes, passed through unchanged (``model``,
``prompt`` or ``messages``, ``add_special_tokens``, ... -> ``count``, ``max_model_len``,
``tokens``; ``tokens`` -> ``prompt``), so that clients written for vLLM count tokens with the
model's own tokenizer and chat template. The least-loaded healthy prefill server serving the
body's ``model`` (any, when the body names none) answers; its 4xx is relayed as it is.
"""

from __future__ import annotations

import uuid
from typing import Any

from pd_router.apis.completions import json_object
from pd_router.errors import ModelNotFound, NoHealthyBackend
from pd_router.state import RouterState
from pd_router.upstream import calls

TOKENIZE = "/tokenize"
PATHS = (TOKENIZE, "/detokenize")
TIMEOUT_S = 30.0


async def forward(state: RouterState, path: str, raw: bytes) -> dict[str, Any]:
    """The prefill server's answer to ``raw`` on ``path``."""
    body = json_object(raw)
    served = state.backends.prefill_models()
    model = body.get("model")
    if model is None:
        if not served:
            raise NoHealthyBackend("no healthy prefill server")
        model = sorted(served)[0]
    elif model not in served:
        raise ModelNotFound(f"model {model!r} does not exist; served: {sorted(served)}", param="model",
                            code="model_not_found")
    backend = state.backends.pick_prefill(model)
    if backend is None:
        raise NoHealthyBackend(f"no healthy prefill server for model {model!r}")
    backend.in_flight += 1
    try:
        return await calls.post_json(state.connections, backend.target, path, raw, f"tok-{uuid.uuid4().hex}",
                                     TIMEOUT_S)
    finally:
        backend.in_flight -= 1
