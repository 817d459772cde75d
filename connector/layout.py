"""KV layouts: what one handoff's bytes look like, per layer and plane.

(Initial definition; the connector issue owns and extends this module. The names
below are used by the decode server and must stay.)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Plane:
    """One array per layer. Either per token (``bytes_per_token``) or per page of
    ``page_tokens`` tokens (``bytes_per_page``), never both."""

    name: str
    dtype: str  # torch dtype name of the typed view, e.g. "bfloat16", "float32", "uint8"
    width: int  # elements per token (per page for paged planes) in the typed view
    bytes_per_token: int = 0
    bytes_per_page: int = 0
    page_tokens: int = 0

    def nbytes(self, num_tokens: int) -> int:
        if self.bytes_per_token:
            return self.bytes_per_token * num_tokens
        pages = -(-num_tokens // self.page_tokens)
        return self.bytes_per_page * pages


@dataclass(frozen=True)
class KVLayout:
    profile: str  # e.g. "tiny-mla" or "glm5.1-fp8-ds-mla"
    num_main_layers: int
    num_mtp_layers: int
    planes: tuple[Plane, ...]

    @property
    def num_layers(self) -> int:
        return self.num_main_layers + self.num_mtp_layers

    def bytes_per_layer(self, num_tokens: int) -> int:
        return sum(p.nbytes(num_tokens) for p in self.planes)

    def fingerprint(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return f"{self.profile}-{self.num_layers}L-" + hashlib.sha256(blob).hexdigest()[:16]


def cpu_mla_layout(num_main_layers: int, num_mtp_layers: int, dtype: str = "bfloat16") -> KVLayout:
    """vLLM's CPU MLA cache: 512 latent + 64 rope values per token, model dtype."""
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    plane = Plane(name="kv", dtype=dtype, width=576, bytes_per_token=576 * itemsize)
    return KVLayout("tiny-mla", num_main_layers, num_mtp_layers, (plane,))


def glm5_fp8_ds_mla_layout(num_main_layers: int = 78, num_mtp_layers: int = 1) -> KVLayout:
    """GLM-5.1 decode-side layout (FACTS.md §3)."""
    planes = (
        Plane(name="kv", dtype="uint8", width=528, bytes_per_token=528),  # 512 fp8 e4m3 + 4 fp32 scales
        Plane(name="rope", dtype="bfloat16", width=64, bytes_per_token=128),
        Plane(name="indexer", dtype="uint8", width=8448, bytes_per_page=8448, page_tokens=64),
    )
    return KVLayout("glm5.1-fp8-ds-mla", num_main_layers, num_mtp_layers, planes)
