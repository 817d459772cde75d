"""The receiving half of the KV handoff, used by the decode server.

(Initial definition of the types the decode server consumes; the connector issue
implements the receiver itself here and must keep these names.)

``ReceivedKV.layers[i][plane]`` is a typed torch view of layer ``i`` (main layers
first, then MTP layers) for plane ``plane`` of the layout:
per-token planes have shape ``[num_tokens, width]``, paged planes
``[num_pages, width]``. The views stay valid until the handoff is released.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class ReceivedKV:
    handoff_id: str
    num_tokens: int
    layers: list[dict[str, "torch.Tensor"]]
