"""``python -m decode_server.tiny_model --out DIR [--seed S] [--layers N]``"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from decode_server.tiny_model.generate import generate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiny-model", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="directory to write (must be absent or empty)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2, help="main decoder layers (plus 1 MTP layer)")
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error(f"--layers={args.layers}: need at least 1 main layer")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out={args.out}: directory exists and is not empty")
    t0 = time.monotonic()
    generate(args.out, seed=args.seed, layers=args.layers, log=lambda m: print(m, file=sys.stderr))
    print(f"wrote {args.out} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
