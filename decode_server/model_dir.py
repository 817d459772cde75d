"""The decode server's model directory: which files it needs besides the weights, how a
weight conversion completes it from the checkpoint, and a check of it.

TileRT's converter writes only weight shards (and their index), but the decode server and
TileRT's generator read more from the directory they load:

* ``tokenizer.json``: detokenization (:class:`decode_server.server.text.TextTokenizer`);
  ``tokenizer_config.json`` with it: TileRT's ``GLM5Generator`` loads the tokenizer with
  ``AutoTokenizer.from_pretrained`` (which also reads ``config.json``);
* ``chat_template.jinja``: ``GLM5Generator`` opens it unconditionally;
* ``config.json``: ``num_hidden_layers`` sizes the KV layout (:class:`TileRTEngine`), and
  an ``eos_token_id`` fallback;
* ``generation_config.json``: the stop tokens and default sampling, as vLLM applies them
  (:class:`decode_server.server.text.GenerationDefaults`).

``python -m decode_server.model_dir complete --source CHECKPOINT --engine tilert
--files "..." DIR`` copies what the converter did not write (deploy/slurm/setup_deps.sh
runs it on the fresh conversion) and checks the result; ``check`` only checks.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

Engine = Literal["reference", "tilert"]
CHAT_TEMPLATE = "chat_template.jinja"
# Files each engine's decode server reads from its model directory (weights aside).
MODEL_FILES: dict[str, tuple[str, ...]] = {
    "reference": ("config.json", "tokenizer.json"),
    "tilert": ("tokenizer.json", "tokenizer_config.json", CHAT_TEMPLATE, "config.json", "generation_config.json"),
}
_JSON_OBJECTS = ("config.json", "generation_config.json", "tokenizer_config.json")


def missing_files(model_dir: Path, engine: str) -> list[str]:
    """The files ``engine`` needs that ``model_dir`` lacks (or holds empty)."""
    return [name for name in MODEL_FILES[engine]
            if not (model_dir / name).is_file() or (model_dir / name).stat().st_size == 0]


def _template_from_tokenizer_config(source: Path) -> str | None:
    path = source / "tokenizer_config.json"
    if not path.is_file():
        return None
    template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    return template if isinstance(template, str) and template.strip() else None


def complete(model_dir: Path, source: Path, files: Sequence[str]) -> tuple[list[str], list[str]]:
    """Copy each of ``files`` the directory lacks from ``source``; a missing
    ``chat_template.jinja`` is written from the checkpoint's ``tokenizer_config.json``
    when only that holds the template. Returns (what was provided, what could not be)."""
    provided, unavailable = [], []
    for name in files:
        target = model_dir / name
        if target.is_file() and target.stat().st_size:
            continue
        if (source / name).is_file():
            shutil.copyfile(source / name, target)
            provided.append(name)
        elif name == CHAT_TEMPLATE and (template := _template_from_tokenizer_config(source)) is not None:
            target.write_text(template, encoding="utf-8")
            provided.append(f"{name} (from tokenizer_config.json)")
        else:
            unavailable.append(name)
    return provided, unavailable


def check(model_dir: Path, engine: str) -> tuple[list[str], list[int]]:
    """Problems that would stop ``engine``'s decode server (or make it decode wrongly),
    and the stop token ids it would use."""
    from decode_server.server.text import GenerationDefaults, TextTokenizer

    problems = [f"{name}: missing or empty" for name in missing_files(model_dir, engine)]
    for name in _JSON_OBJECTS:
        path = model_dir / name
        if path.is_file() and path.stat().st_size:
            try:
                if not isinstance(json.loads(path.read_text(encoding="utf-8")), dict):
                    problems.append(f"{name}: not a JSON object")
            except (ValueError, UnicodeDecodeError) as exc:
                problems.append(f"{name}: not valid JSON ({exc})")
    if engine == "tilert" and not problems:
        layers = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("num_hidden_layers")
        if not isinstance(layers, int) or layers < 1:
            problems.append(f"config.json: num_hidden_layers is {layers!r}, not a positive integer")
    if problems:
        return problems, []
    try:
        tokenizer = TextTokenizer.from_model_dir(model_dir)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the problem to report
        return [f"tokenizer.json: cannot be loaded ({exc})"], []
    stops = sorted(GenerationDefaults.from_model_dir(model_dir, tokenizer).eos_token_ids)
    if not stops:
        problems.append("no stop token: neither generation_config.json, config.json nor the tokenizer names one")
    return problems, stops


def _report(model_dir: Path, engine: str) -> int:
    problems, stops = check(model_dir, engine)
    for problem in problems:
        print(f"{model_dir}: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"{model_dir}: complete for the {engine} engine; stop token ids {stops}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decode_server.model_dir", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("check", "complete"):
        cmd = sub.add_parser(name)
        cmd.add_argument("model_dir", type=Path)
        cmd.add_argument("--engine", choices=sorted(MODEL_FILES), default="tilert")
        if name == "complete":
            cmd.add_argument("--source", type=Path, required=True, help="the checkpoint the weights came from")
            cmd.add_argument("--files", default=None,
                             help="space-separated files to copy (default: the engine's)")
    args = parser.parse_args(argv)
    if args.cmd == "complete":
        files = args.files.split() if args.files is not None else list(MODEL_FILES[args.engine])
        provided, unavailable = complete(args.model_dir, args.source, files)
        if provided:
            print(f"{args.model_dir}: copied from {args.source}: {', '.join(provided)}")
        if unavailable:
            print(f"{args.model_dir}: {', '.join(unavailable)}: in neither the conversion output nor {args.source}",
                  file=sys.stderr)
            return 1
    return _report(args.model_dir, args.engine)


if __name__ == "__main__":
    sys.exit(main())
