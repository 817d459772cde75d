"""The decode server's model directory (decode_server/model_dir.py): stop tokens read from
the copied checkpoint files, completing a conversion's output, and the checks the TileRT
decode server makes at start-up. Full conversion runs: tests/deploy/test_conversion.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from decode_server.model_dir import MODEL_FILES, check, complete, main
from decode_server.server.text import GenerationDefaults, TextTokenizer
from decode_server.settings import SettingsError, load_settings
from tests.fakes.fake_glm51_checkpoint import token_ids as ids
from tests.fakes.fake_glm51_checkpoint import write_fake_glm51_checkpoint

pytestmark = pytest.mark.timeout(60)


def _converted(tmp_path: Path) -> Path:
    """What TileRT's converter leaves: weight shards only."""
    out = tmp_path / "converted"
    out.mkdir()
    (out / "model-0.safetensors").write_bytes(b"w" * 16)
    return out


def test_stop_tokens_are_the_eos_list_plus_glms_turn_end_tokens(tmp_path: Path) -> None:
    src = write_fake_glm51_checkpoint(tmp_path / "ckpt", eos=("<|endoftext|>",))
    defaults = GenerationDefaults.from_model_dir(src, TextTokenizer.from_model_dir(src))
    assert defaults.eos_token_ids == ids("<|endoftext|>", "<|user|>", "<|observation|>")
    assert (defaults.sampling.temperature, defaults.sampling.top_p) == (1.0, 0.95)
    # a checkpoint that lists them itself (as GLM's do) gives the same set
    full = write_fake_glm51_checkpoint(tmp_path / "full", eos=("<|endoftext|>", "<|user|>", "<|observation|>"))
    assert GenerationDefaults.from_model_dir(full, TextTokenizer.from_model_dir(full)).eos_token_ids == \
        defaults.eos_token_ids


def test_complete_copies_what_the_converter_did_not_write(tmp_path: Path) -> None:
    src = write_fake_glm51_checkpoint(tmp_path / "ckpt")
    dst = _converted(tmp_path)
    assert check(dst, "tilert")[0] == [f"{name}: missing or empty" for name in MODEL_FILES["tilert"]]
    provided, unavailable = complete(dst, src, MODEL_FILES["tilert"])
    assert sorted(provided) == sorted(MODEL_FILES["tilert"]) and unavailable == []
    for name in MODEL_FILES["tilert"]:
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    problems, stops = check(dst, "tilert")
    assert problems == [] and set(stops) == ids("<|endoftext|>", "<|user|>", "<|observation|>")
    assert complete(dst, src, MODEL_FILES["tilert"]) == ([], [])  # nothing left to do
    assert not (dst / "model.safetensors.index.json").exists()  # weights are the converter's business


def test_chat_template_from_tokenizer_config_or_missing(tmp_path: Path) -> None:
    src = write_fake_glm51_checkpoint(tmp_path / "ckpt", chat_template_file=False, template_in_tokenizer_config=True)
    dst = _converted(tmp_path)
    provided, unavailable = complete(dst, src, MODEL_FILES["tilert"])
    assert "chat_template.jinja (from tokenizer_config.json)" in provided and unavailable == []
    assert (dst / "chat_template.jinja").read_text() == json.loads((src / "tokenizer_config.json").read_text())[
        "chat_template"]
    bare = write_fake_glm51_checkpoint(tmp_path / "bare", chat_template_file=False, generation_config=False)
    dst2 = tmp_path / "converted2"
    dst2.mkdir()
    assert complete(dst2, bare, MODEL_FILES["tilert"])[1] == ["chat_template.jinja", "generation_config.json"]


def test_check_reports_broken_files(tmp_path: Path) -> None:
    src = write_fake_glm51_checkpoint(tmp_path / "ckpt")
    (src / "generation_config.json").write_text("{not json")
    assert check(src, "tilert")[0][0].startswith("generation_config.json: not valid JSON")
    src = write_fake_glm51_checkpoint(tmp_path / "ckpt2")
    (src / "config.json").write_text(json.dumps({"num_hidden_layers": "78"}))
    assert check(src, "tilert")[0] == ["config.json: num_hidden_layers is '78', not a positive integer"]
    (src / "config.json").write_text(json.dumps({"num_hidden_layers": 78}))
    (src / "tokenizer.json").write_text('{"model": {}}')
    assert check(src, "tilert")[0][0].startswith("tokenizer.json: cannot be loaded")


def test_cli_complete_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_fake_glm51_checkpoint(tmp_path / "ckpt")
    dst = _converted(tmp_path)
    assert main(["check", str(dst)]) == 1
    assert main(["complete", "--source", str(src), "--engine", "tilert", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "copied from" in out and "complete for the tilert engine; stop token ids" in out


def test_tilert_settings_refuse_an_incomplete_model_dir(tmp_path: Path) -> None:
    src = write_fake_glm51_checkpoint(tmp_path / "ckpt")
    settings = load_settings(["--engine", "tilert", "--model", str(src), "--num-mtp", "3"], env={})
    assert settings.model == src
    assert not settings.engine_process  # the engine on the slot's worker thread by default
    shutil.copytree(src, tmp_path / "partial")
    (tmp_path / "partial" / "chat_template.jinja").unlink()
    (tmp_path / "partial" / "generation_config.json").unlink()
    with pytest.raises(SettingsError) as info:
        load_settings(["--engine", "tilert", "--model", str(tmp_path / "partial"), "--num-mtp", "3"], env={})
    assert "chat_template.jinja, generation_config.json" in str(info.value)
    assert "setup_deps.sh" in str(info.value)
    # the reference engine reads only config.json and tokenizer.json
    assert load_settings(["--engine", "reference", "--model", str(tmp_path / "partial")], env={})
