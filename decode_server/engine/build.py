"""How the decode server builds its engine from its settings: a picklable callable, so that
the engine process (:mod:`decode_server.engine.process`) builds the same engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from decode_server.engine.base import Engine


@dataclass(frozen=True)
class EngineBuild:
    engine: str  # reference or tilert
    model: Path
    slots: int
    max_seq_len: int
    num_mtp: int
    kv_dtype: str | None = None  # reference: the received KV's dtype (None: the model's)
    attention_kernel: bool = True  # reference: the compiled attention loop where it applies

    def __call__(self) -> Engine:
        if self.engine == "tilert":
            from decode_server.engine.tilert import TileRTEngine

            return TileRTEngine(self.model, max_seq_len=self.max_seq_len, num_mtp=self.num_mtp)
        from decode_server.engine.reference import ReferenceEngine

        return ReferenceEngine(self.model, slots=self.slots, max_seq_len=self.max_seq_len, num_mtp=self.num_mtp,
                               kv_dtype=self.kv_dtype,
                               attention_kernel=None if self.attention_kernel else False)  # None: where it applies
