"""The checks every configuration field goes through, and the error they raise.

:class:`ConfigError` carries one line that names the field (as ``section.field``) and
says how to fix it; the helpers here are what :mod:`jaxmoe.config`'s dataclasses call in
``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and the fix."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def matches(value: Any, annotation: Any) -> bool:
    """Whether ``value`` has the field type ``annotation`` (int, float, str, bool, X | None)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(matches(value, option) for option in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    return isinstance(value, annotation)


def check_types(section: str, instance: Any) -> None:
    """Refuse a field whose value is not of its declared type (names the field)."""
    hints = typing.get_type_hints(type(instance))
    for item in dataclasses.fields(instance):
        value, expected = getattr(instance, item.name), hints[item.name]
        if not matches(value, expected):
            kind = getattr(expected, "__name__", str(expected))
            raise ConfigError(f"{section}.{item.name}={value!r}: expected a finite {kind}")


def positive_int(section: str, name: str, value: Any) -> None:
    require(
        isinstance(value, int) and not isinstance(value, bool) and value > 0,
        f"{section}.{name}={value!r}: must be a positive integer",
    )


def non_negative(section: str, name: str, value: Any) -> None:
    require(
        isinstance(value, int | float) and not isinstance(value, bool) and value >= 0,
        f"{section}.{name}={value!r}: must be a number >= 0",
    )


def positive_or_none(section: str, name: str, value: Any, none_means: str) -> None:
    """A number > 0, or None, which ``none_means`` explains ("to disable", ...)."""
    require(
        value is None or value > 0,
        f"{section}.{name}={value!r}: must be > 0, or None {none_means}",
    )


def one_of(section: str, name: str, value: Any, options: tuple[str, ...]) -> None:
    require(value in options, f"{section}.{name}={value!r}: must be one of {', '.join(options)}")
