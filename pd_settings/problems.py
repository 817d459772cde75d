"""The one settings error format: each problem names the option as its source spells it
(``--max-queue``, ``PD_ROUTER_MAX_QUEUE``, ``kv_connector_extra_config.profile``, ``FILE:
key``), the value given and the reason: ``<option>=<value>: <reason>``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()  # the value of a required option nobody gave


@dataclass(frozen=True)
class Problem:
    option: str
    value: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.option}={self.value!r}: {self.reason}"


class SettingsError(ValueError):
    """Invalid settings: every problem found, each as ``<option>=<value>: <reason>``."""

    def __init__(self, problems: list[Problem]) -> None:
        if not problems:
            raise ValueError("SettingsError needs at least one problem")
        super().__init__("; ".join(str(p) for p in problems))
        self.problems = problems

    @property
    def option(self) -> str:
        return self.problems[0].option

    @property
    def value(self) -> Any:
        return self.problems[0].value

    @property
    def reason(self) -> str:
        return self.problems[0].reason


def problems_of(exc: ValidationError, locate: Callable[[str], tuple[str, Any]],
                unknown: Callable[[], str] | None = None) -> list[Problem]:
    """One :class:`Problem` per error of ``exc``. ``locate(field)`` says how the field's
    source spells it and what value it gave; ``unknown()`` lists the known options, for an
    unknown one."""
    problems = []
    for err in exc.errors(include_url=False):
        loc = err.get("loc") or ()
        field = str(loc[0]) if loc else ""
        option, value = locate(field) if field else ("<settings>", err.get("input"))
        if len(loc) > 1:
            option += "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
        reason = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            reason = "unknown option" + (f" (known: {unknown()})" if unknown else "")
        problems.append(Problem(option, value, reason))
    return problems


def validate_mapping(model: type[M], data: Mapping[str, Any] | None, prefix: str,
                     error: type[SettingsError] = SettingsError) -> M:
    """Validate settings given as a mapping (no command line, no environment); options are
    named ``<prefix><key>``. Raises ``error`` listing every problem."""
    raw = dict(data or {})
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise error(problems_of(exc, lambda field: (prefix + field, raw.get(field, UNSET)),
                                lambda: ", ".join(sorted(model.model_fields)))) from None
