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

import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from pydantic_settings import CliPositionalArg, CliSubCommand, SettingsConfigDict

from pd_settings.loader import EntrySettings, load, subcommand
from pd_settings.problems import SettingsError

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


class _Target(BaseModel):
    model_dir: CliPositionalArg[Path]
    engine: Engine = Field("tilert", description="the decode engine the directory is for")


class Check(_Target):
    """check that the directory holds what the engine's decode server reads"""


class Complete(_Target):
    """copy from the checkpoint what the converter did not write, then check"""

    source: Path = Field(description="the checkpoint the weights came from")
    files: str | None = Field(None, description="space-separated files to copy (default: the engine's)")


class ModelDirCommand(EntrySettings):
    """The decode server's model directory: check it, or complete a converted one."""

    model_config = SettingsConfigDict(env_prefix="PD_MODEL_DIR_", cli_prog_name="python -m decode_server.model_dir")

    check: CliSubCommand[Check]
    complete: CliSubCommand[Complete]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cmd = subcommand(load(ModelDirCommand, sys.argv[1:] if argv is None else argv))
    except SettingsError as exc:
        print(f"decode_server.model_dir: {exc}", file=sys.stderr)
        return 2
    if isinstance(cmd, Complete):
        files = cmd.files.split() if cmd.files is not None else list(MODEL_FILES[cmd.engine])
        provided, unavailable = complete(cmd.model_dir, cmd.source, files)
        if provided:
            print(f"{cmd.model_dir}: copied from {cmd.source}: {', '.join(provided)}")
        if unavailable:
            print(f"{cmd.model_dir}: {', '.join(unavailable)}: in neither the conversion output nor {cmd.source}",
                  file=sys.stderr)
            return 1
    return _report(cmd.model_dir, cmd.engine)


if __name__ == "__main__":
    sys.exit(main())
