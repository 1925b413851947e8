"""The checks every configuration field goes through, and the error they raise.

:class:`ConfigError` carries one line that names the field (as ``section.field``) and
says how to fix it; the helpers here are what :mod:`jaxmoe.config`'s dataclasses call in
``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and the fix."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def closest(name: str, names: Iterable[str]) -> str | None:
    """The one of ``names`` that ``name`` most likely misspells, or None if none is close:
    what a "did you mean" names. Dotted names (``section.field``, ``--section.field``) are
    compared by their fields, a match in ``name``'s own section first."""
    by_field: dict[str, list[str]] = {}
    for candidate in names:
        by_field.setdefault(candidate.rpartition(".")[2], []).append(candidate)
    head, _, field = name.rpartition(".")
    found = difflib.get_close_matches(field, list(by_field), n=1, cutoff=0.6)
    if not found:
        return None
    candidates = by_field[found[0]]
    return next((c for c in candidates if c.rpartition(".")[0] == head), candidates[0])


def refuse_unknown(
    section: str, given: Iterable[str], known: Iterable[str], elsewhere: Iterable[str] = ()
) -> None:
    """Raise :class:`ConfigError` for the first of ``given`` (field names of ``section``,
    from a file, a dict or a saved configuration) that is not one of ``known``: the line
    names the closest field of the section or of ``elsewhere`` (other sections' fields,
    as ``section.field``), or every field of the section if none is close."""
    known = sorted(known)
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return
    key = f"{section}.{unknown[0]}"
    guess = closest(key, [*(f"{section}.{name}" for name in known), *elsewhere])
    fix = f"did you mean {guess}?" if guess else f"{section} has {', '.join(known)}"
    raise ConfigError(f"unknown field {key}: {fix}")


def matches(value: Any, annotation: Any) -> bool:
    """Whether ``value`` has the field type ``annotation`` (int, float, str, bool, X | None,
    ``tuple[X, ...]``)."""
    if typing.get_origin(annotation) is tuple:
        (item, _) = typing.get_args(annotation)
        return isinstance(value, tuple) and all(matches(element, item) for element in value)
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


@functools.cache
def field_types(cls: type) -> Mapping[str, Any]:
    """The declared type of each field of dataclass ``cls``, resolved once per class (the
    planner builds thousands of configurations; resolving the annotations is most of it)."""
    return types.MappingProxyType(typing.get_type_hints(cls))


@functools.cache
def _declared(cls: type) -> tuple[tuple[str, Any], ...]:
    """Each field of dataclass ``cls`` with its declared type."""
    hints = field_types(cls)
    return tuple((item.name, hints[item.name]) for item in dataclasses.fields(cls))


def check_types(section: str, instance: Any) -> None:
    """Refuse a field whose value is not of its declared type (names the field)."""
    for name, expected in _declared(type(instance)):
        value = getattr(instance, name)
        if not matches(value, expected):
            kind = getattr(expected, "__name__", str(expected))
            raise ConfigError(f"{section}.{name}={value!r}: expected a finite {kind}")


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
