"""``python -m pd_build [--component NAME] [--model-dir DIR]``: this environment's build info as JSON."""

from __future__ import annotations

import argparse

from pd_build.info import collect


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pd_build", description=__doc__)
    parser.add_argument("--component", default="environment")
    parser.add_argument("--model-dir", default=None)
    args = parser.parse_args(argv)
    print(collect(args.component, model_dir=args.model_dir).model_dump_json(indent=2))


if __name__ == "__main__":
    main()
