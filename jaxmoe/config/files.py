"""Configuration files: TOML, and the ``config.json`` a run saves, read and written.

A configuration file holds the sections and fields of the command line's flags, a table
per section (``--moe.top_k 2`` is ``top_k = 2`` under ``[moe]``); ``"none"`` sets an
optional field to None, as on the command line (TOML has no null). A run's
``config.json`` (:meth:`Config.to_dict` as JSON) is read the same way, so that it
repeats the run. Both give the nested dict that :meth:`Config.from_dict` validates, read
name by name first (:func:`~jaxmoe.config.config.config_sections`), so that a file's
unknown section or field is refused naming the file and the closest name. The presets
are such files (:mod:`jaxmoe.presets`); :func:`to_toml` writes one. No JAX here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxmoe.config.checks import ConfigError
from jaxmoe.config.config import config_sections

# The one file format; a run's saved configuration is JSON.
SUFFIXES = (".toml", ".json")


def read_config_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """The sections of the TOML file (or saved ``config.json``) at ``path``, each name
    checked; ConfigError in one line beginning with the path otherwise."""
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise ConfigError(
            f"{path}: a configuration file is TOML (.toml), or a run's config.json: "
            "give one of those"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = (getattr(error, "strerror", None) or str(error)).lower()
        raise ConfigError(
            f"{path}: {reason}: give a configuration file (TOML), or a run's config.json"
        ) from None
    saved = path.suffix.lower() == ".json"
    try:
        values = json.loads(text) if saved else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"{path}: not valid {'JSON' if saved else 'TOML'} ({error})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a table of sections, not {type(values).__name__}")
    try:
        return config_sections(values)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def _scalar(value: Any) -> str:
    """A field's value in TOML: None as ``"none"``, strings as basic strings, a list (of
    ``data.sources``) as an array of inline tables."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{key} = {_scalar(item)}" for key, item in value.items()) + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_scalar(item) for item in value) + "]"
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} has no TOML form a configuration uses")
        return repr(value)
    if isinstance(value, str):
        # JSON's escapes are TOML's, but for DEL, which TOML requires escaped.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    raise TypeError(f"no TOML form for {value!r}")


def _table(name: str, values: Mapping[str, Any], lines: list[str]) -> None:
    lines += ["", f"[{name}]"]
    lines += [f"{key} = {_scalar(v)}" for key, v in values.items() if not isinstance(v, Mapping)]
    for key, value in values.items():
        if isinstance(value, Mapping):  # a field that is a table: schedule.profile's own
            _table(f"{name}.{key}", value, lines)


def to_toml(values: Mapping[str, Mapping[str, Any]], header: str = "") -> str:
    """The nested dict ``values`` (:meth:`Config.to_dict`'s, or some of its fields) as a
    configuration file, a table per section; ``header`` first, as comment lines."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for name, section in values.items():
        _table(name, section, lines)
    if lines and not lines[0]:
        lines.pop(0)
    return "\n".join(lines) + "\n"
