"""``python -m decode_server.tiny_model --out DIR [--seed S] [--layers N]`` (console script
``tiny-model``; options also ``PD_TINY_MODEL_<OPTION>``, :mod:`pd_settings.loader`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from pd_settings.loader import EntrySettings, load
from pd_settings.problems import SettingsError


class TinyModelSettings(EntrySettings):
    """Generate the tiny GLM-family model (MLA + MoE + 1 MTP layer), trained briefly on local text."""

    model_config = SettingsConfigDict(env_prefix="PD_TINY_MODEL_", cli_prog_name="tiny-model")

    out: Path = Field(description="directory to write (must be absent or empty)")
    seed: int = Field(0, description="the seed of every random choice")
    layers: int = Field(2, ge=1, description="main decoder layers (plus 1 MTP layer)")

    @field_validator("out")
    @classmethod
    def _empty(cls, value: Path) -> Path:
        if value.exists() and any(value.iterdir()):
            raise ValueError("directory exists and is not empty")
        return value


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = load(TinyModelSettings, sys.argv[1:] if argv is None else argv)
    except SettingsError as exc:
        print(f"tiny-model: {exc}", file=sys.stderr)
        return 2
    from decode_server.tiny_model.generate import generate  # torch

    t0 = time.monotonic()
    generate(args.out, seed=args.seed, layers=args.layers, log=lambda m: print(m, file=sys.stderr))
    print(f"wrote {args.out} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
