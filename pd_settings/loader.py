"""Settings of a command from its command line, its environment and a YAML file, all read
from one pydantic-settings model and validated once.

A command's settings are a subclass of :class:`EntrySettings` whose ``model_config`` sets
``env_prefix`` (``PD_<COMPONENT>_``) and ``cli_prog_name``. Every field is then

* a command-line option ``--<field-name-with-dashes>`` (booleans also ``--no-<name>``;
  tuple fields repeat the option or take a comma-separated list),
* an environment variable ``<env_prefix><FIELD_NAME>`` (lists comma-separated),
* a key of the YAML file named by ``--config`` / ``<env_prefix>CONFIG``,

in that order of precedence over the field's default. ``--help`` lists every option with
its variable. :func:`load` raises :class:`pd_settings.problems.SettingsError` naming, for
each problem, the option as its source spells it, the value and the reason; argparse
itself exits 2 on an unknown option or a missing argument.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    EnvSettingsSource,
    InitSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
    get_subcommand,
)
from pydantic_settings import SettingsError as PydanticSettingsError
from pydantic_settings.sources.utils import parse_env_vars

from pd_settings.problems import UNSET, Problem, SettingsError, problems_of

S = TypeVar("S", bound="EntrySettings")

# How every command reads its settings (subclasses add env_prefix and cli_prog_name).
ENTRY_CONFIG = SettingsConfigDict(
    extra="forbid",
    frozen=True,
    case_sensitive=False,
    cli_kebab_case=True,
    cli_implicit_flags="dual",
    cli_hide_none_type=True,
    cli_avoid_json=True,
    cli_show_env_vars=True,
    cli_exit_on_error=True,
)


def split_list(value: Any) -> Any:
    """A list option given as one string (an environment variable, or ``--opt a,b``):
    split on commas and white space. For ``mode="before"`` validators of list fields
    annotated with ``pydantic_settings.NoDecode``."""
    if isinstance(value, str):
        return tuple(v for v in re.split(r"[,\s]+", value) if v)
    if isinstance(value, (list, tuple)):  # --opt a --opt b,c
        return tuple(v for item in value for v in (split_list(item) if isinstance(item, str) else (item,)))
    return value


class EntrySettings(BaseSettings):
    """Base of every command's settings: the ``--config`` file option, the common rules."""

    model_config = ENTRY_CONFIG

    config: Path | None = Field(None, description="YAML file with any of these settings (keys: the option "
                                                  "names with _); the command line and the environment win")


class _Environ(EnvSettingsSource):
    """The environment source reading a given mapping (``os.environ`` by default)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(model: type[EntrySettings], field: str) -> str:
    return f"{model.model_config.get('env_prefix', '')}{field}".upper()


def load(model: type[S], argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> S:
    """``model``'s settings from ``argv`` (None: no command line), ``env`` (None:
    ``os.environ``) and the YAML file they name; raises :class:`SettingsError`."""
    import os

    cli = dict(CliSettingsSource(model, cli_parse_args=list(argv))()) if argv is not None else {}
    environ = dict(_Environ(model, os.environ if env is None else env)())
    path = cli.get("config") or environ.get("config")
    from_file: dict[str, Any] = {}
    if path:
        import yaml

        option = "--config" if "config" in cli else env_name(model, "config")
        if not Path(path).is_file():
            raise SettingsError([Problem(option, str(path), "no such file")])
        try:
            from_file = dict(YamlConfigSettingsSource(model, yaml_file=Path(path))())
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise SettingsError([Problem(option, str(path), f"cannot read it: {exc}")]) from None
    values = {**from_file, **environ, **cli}

    def locate(field: str) -> tuple[str, Any]:
        if field in cli:
            return _flag(field), cli[field]
        if field in environ:
            return env_name(model, field), environ[field]
        if field in from_file:
            return f"{path}: {field}", from_file[field]
        info = model.model_fields.get(field)
        default = UNSET if info is None or info.is_required() else info.get_default(call_default_factory=True)
        return f"{_flag(field)} / {env_name(model, field)}", values.get(field, default)

    return _validated(model, values, locate)


def validate(model: type[S], values: Mapping[str, Any]) -> S:
    """``model``'s settings from a mapping of field names to values only (tests,
    embedding): no command line, no environment, no file; raises :class:`SettingsError`."""
    return _validated(model, dict(values), lambda field: (field, values.get(field, UNSET)))


def _validated(model: type[S], values: dict[str, Any], locate: Callable[[str], tuple[str, Any]]) -> S:
    # A BaseSettings reads its own sources when validated (also through model_validate):
    # give it exactly the values merged here.
    try:
        return model(_build_sources=((InitSettingsSource(model, init_kwargs=values),), {}))  # type: ignore[call-arg]
    except ValidationError as exc:
        raise SettingsError(problems_of(exc, locate, lambda: ", ".join(
            _flag(f) for f in sorted(model.model_fields)))) from None



def subcommand(settings: EntrySettings) -> Any:
    """The subcommand (a ``pydantic_settings.CliSubCommand`` field) the command line chose;
    :class:`SettingsError` when it chose none."""
    try:
        return get_subcommand(settings, is_required=True, cli_exit_on_error=False)
    except PydanticSettingsError:
        names = [(f.alias or name).replace("_", "-") for name, f in type(settings).model_fields.items()
                 if "_CliSubCommand" in repr(f.metadata)]
        raise SettingsError([Problem("<command>", UNSET, f"choose one of {', '.join(names)}")]) from None
